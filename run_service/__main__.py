"""``python -m run_service ...``: the same as ``python run_service.py ...``."""

import sys

from run_service import main

sys.exit(main())
