"""Run ``<module>.main(case)`` of a job file in ``tests/`` in a fresh Python process (its
own session: a JVM and a Ray of its own) and return the JSON it printed after
``RESULT ``. The process gets its own process group, so a timeout kills whatever it
started too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from paths import ROOT, TESTS


def run_job(
    module: str,
    case: str,
    *,
    timeout: float,
    extra_env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Any:
    _refuse_outside_integration(module)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "RAY_USAGE_STATS_ENABLED": "0",
        **(extra_env or {}),
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # the compat functions it runs count for test_spark_lines.py (compat_trace)
            f"import sys, compat_trace; compat_trace.install(); import {module} as j; "
            f"sys.exit(j.main({case!r}))",
        ],
        cwd=str(cwd or TESTS),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{module} {case!r} did not end in {timeout:g} s\n{stderr[-6000:]}")
    assert proc.returncode == 0, stderr[-6000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, stdout[-3000:] + stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


def _refuse_outside_integration(module: str) -> None:
    """A job starts a JVM and a Ray of its own: only an ``integration`` test may start one
    (the fast lane, ``-m "not integration"``, starts none)."""
    import conftest

    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    if test and test not in conftest.INTEGRATION:
        pytest.fail(
            f"{test} starts the job {module} in a fresh process but is not marked "
            f"integration: mark it (pytest.mark.integration)"
        )
