"""``python -m launcher``: :func:`launcher.launch.main` (one group in the foreground)."""

import sys

from launcher.launch import main

sys.exit(main())
