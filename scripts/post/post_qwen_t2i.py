"""Post a Qwen-Image text-to-image task to a diffring controller and save the result.

    python -m scripts.post.post_qwen_t2i --prompt "..." --out result.png

Options: --url (default the example group's front door, http://127.0.0.1:8008), --seed,
--steps, --height, --width, --task-id, --timeout; see --help.
"""

from __future__ import annotations

import sys

from scripts.post.post_common import main

if __name__ == "__main__":
    sys.exit(main("qwen_t2i"))
