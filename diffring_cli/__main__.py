"""``python -m diffring_cli``: the same as the ``diffring`` command."""

import sys

from diffring_cli.main import main

sys.exit(main())
