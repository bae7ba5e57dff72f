"""mypy (configured in pyproject.toml: the three packages, the coordinator strict) and
ruff pass on the project, run with this interpreter's environment (pure: no Spark, no
Ray). The tools come with the ``test`` extra; a test is skipped only when its tool is not
installed here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

#: seconds; a cold mypy run takes ~30 s on a quiet 2-core machine (over 100 s beside
#: other work), a warm one a few
TIMEOUT = 300

#: mypy's cache, kept per user beside the clone: a fresh clone or worktree (CI's, a
#: reviewer's) starts warm. mypy takes an entry whose file moved only if the file's
#: hash is the one it recorded, so clones never share a stale result.
MYPY_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / (
    "hybrid_iter-tests/mypy"
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def test_mypy_is_clean() -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    # files, strictness and the untyped third-party modules come from [tool.mypy]
    got = _run("mypy", "--cache-dir", str(MYPY_CACHE))
    assert got.returncode == 0, f"mypy failed:\n{got.stdout}{got.stderr}"


def test_ruff_is_clean() -> None:
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e '.[test]'")
    got = _run("ruff", "check", ".")
    assert got.returncode == 0, f"ruff check failed:\n{got.stdout}{got.stderr}"
