"""Post a Wan2.1 image-to-video task to a diffring controller and save the result.

    python -m scripts.post.post_wan_i2v --prompt "..." --image cat.png --out result.mp4

Options: --url (default the example group's front door, http://127.0.0.1:8004), --seed,
--steps, --height, --width, --frames, --fps, --task-id, --timeout; see --help.
"""

from __future__ import annotations

import sys

from scripts.post.post_common import main

if __name__ == "__main__":
    sys.exit(main("wan_i2v"))
