"""Where the project's folders are, for tests in any folder under ``tests/``."""

from __future__ import annotations

from pathlib import Path

#: the folder of the job modules fresh processes import (``PYTHONPATH``), and conftest
TESTS = Path(__file__).resolve().parent
#: the project's root (``pyproject.toml``)
ROOT = TESTS.parent
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"
