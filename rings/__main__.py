"""``python -m rings inspect|serve``: look at a controller's rings, or host one ring."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m rings inspect [--controller HOST] [--slots] [--json] [--watch S]")
        print("       python -m rings serve [--name N] [--slots K] [--slot-size B] [--port P]")
        return 0 if argv else 2
    if argv[0] == "inspect":
        from rings.inspect import main as inspect_main

        return inspect_main(argv[1:])
    if argv[0] == "serve":
        from rings.serve import main as serve_main

        return serve_main(argv[1:])
    print(f"unknown command {argv[0]!r}; commands: inspect, serve", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
