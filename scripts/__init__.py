"""Operator and developer tooling of the repository (see scripts/README.md).

Not shipped with the package: every script runs as a module from the repository root
(``python -m scripts.bench.bench_serving ...``), so it imports the project's packages and its
sibling scripts by name, with no ``sys.path`` edits.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root (where ``run_service.py``, ``configs/`` and ``out/`` are)."""
