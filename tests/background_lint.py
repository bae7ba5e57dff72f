"""mypy over the project, started beside the suite when ``test_lint.py``'s mypy test is
collected (``conftest.pytest_collection_finish``): a cold run takes ~45 s of one core,
which the suite's waits on JVMs and actors leave idle. ``result()`` waits for it (or
runs it there, when nothing started it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: seconds; a cold mypy run takes ~45 s on 2 quiet cores, a warm one (.mypy_cache) a few
TIMEOUT = 600

_running: dict[str, tuple[subprocess.Popen[bytes], str]] = {}


def _command() -> list[str]:
    # files, strictness and the untyped third-party modules come from [tool.mypy]
    return [sys.executable, "-m", "mypy"]


def _niced(command: list[str]) -> list[str]:
    nice = shutil.which("nice")
    return command if nice is None else [nice, "-n", "10", *command]


def start() -> None:
    """Start mypy in the background, at a lower priority than the tests' own work."""
    if "mypy" in _running:
        return
    fd, path = tempfile.mkstemp(prefix="hybrid-iter-mypy-", suffix=".log")
    try:
        proc = subprocess.Popen(
            _niced(_command()),
            cwd=ROOT,
            stdout=fd,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    finally:
        os.close(fd)
    _running["mypy"] = (proc, path)


def result() -> tuple[int, str]:
    """mypy's exit code and output: the background run's, or a run made now."""
    started = _running.pop("mypy", None)
    if started is None:
        got = subprocess.run(
            _command(), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
        return got.returncode, got.stdout + got.stderr
    proc, path = started
    try:
        code = proc.wait(TIMEOUT)
        return code, Path(path).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(path)


def stop() -> None:
    """End a background run nobody waited for (a session that stopped early)."""
    started = _running.pop("mypy", None)
    if started is not None:
        proc, path = started
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.unlink(path)
