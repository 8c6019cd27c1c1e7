"""Post a Qwen-Image-Edit-2509 / 2511 task (one to several input images) to a diffring
controller and save the result.

    python -m scripts.post.post_qwen_i2i_plus --prompt "..." --image person.png \
        --image jacket.png --out result.png

Each --image is a picture, in order ("Picture 1", "Picture 2", ...). Options: --url (default
the example group's front door, http://127.0.0.1:8016), --seed, --steps, --height, --width,
--task-id, --timeout; see --help.
"""

from __future__ import annotations

import sys

from scripts.post.post_common import main

if __name__ == "__main__":
    sys.exit(main("qwen_i2i_plus"))
