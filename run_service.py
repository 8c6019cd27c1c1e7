"""``python run_service.py --service ROLE [--config FILE] [--check]``: start one service.

The code is the ``run_service`` package beside this file (a package, so that the import
contracts in pyproject.toml can check what it imports); this file only keeps the command
where the documentation and the deployments have it. Run as a script, ``import run_service``
finds the package: a package folder wins over a module of the same name.
"""

import sys

from run_service import main

if __name__ == "__main__":
    sys.exit(main())
