"""Where the repository is, for the tests and their helpers (one definition)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: where ``run_service.py``, the docs and the scripts are, and the
working directory of the processes the tests start."""
