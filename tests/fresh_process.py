"""Run ``<module>.main(case)`` of a job file in ``tests/`` in a fresh Python process (its
own session: a JVM and a Ray of its own) and return the JSON it printed after
``RESULT ``. The process gets its own process group, so a timeout kills whatever it
started too.

A test module may name jobs to start early (``EARLY_JOBS``, a list of ``(module,
case)``): when it is among the selected tests, ``conftest.py`` starts those jobs as soon
as collection ends, and ``run_job`` hands the test the one already running. A job spends
most of its first minute starting a JVM and a Ray, much of it waiting on their
start-ups, which then overlaps the tests before it instead of adding to the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from paths import ROOT, TESTS


class Job:
    """A job running in its own process group. Its output goes to files, not pipes: a job
    nobody reads yet must never block on a full pipe."""

    def __init__(
        self,
        module: str,
        case: str,
        *,
        extra_env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.module = module
        self.case = case
        self.started = time.monotonic()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "RAY_USAGE_STATS_ENABLED": "0",
            **(extra_env or {}),
        }
        env.pop("RAY_ADDRESS", None)
        self._stdout = tempfile.TemporaryFile(mode="w+")
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                # the compat functions it runs count for test_spark_lines.py (compat_trace)
                f"import sys, compat_trace; compat_trace.install(); import {module} as j; "
                f"sys.exit(j.main({case!r}))",
            ],
            cwd=str(cwd or TESTS),
            env=env,
            stdin=subprocess.DEVNULL,  # never the runner's (a job reads nothing from it)
            stdout=self._stdout,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )

    def _output(self) -> tuple[str, str]:
        out = []
        for f in (self._stdout, self._stderr):
            f.seek(0)
            out.append(f.read())
            f.close()
        return out[0], out[1]

    def result(self, *, timeout: float) -> Any:
        """The job's JSON once it has ended; ``timeout`` counts from its start."""
        try:
            self.proc.wait(timeout=max(0.0, self.started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            _, stderr = self._output()
            pytest.fail(
                f"{self.module} {self.case!r} did not end in {timeout:g} s\n{stderr[-6000:]}"
            )
        stdout, stderr = self._output()
        assert self.proc.returncode == 0, stderr[-6000:]
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, stdout[-3000:] + stderr[-3000:]
        return json.loads(lines[0][len("RESULT ") :])

    def kill(self) -> None:
        """The job and everything it started (its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


#: jobs started early (``start_early``), each until a test takes it
_early: dict[tuple[str, str], Job] = {}


def start_early(module: str, case: str) -> None:
    """Start the job now, for a later ``run_job(module, case)`` to take."""
    if (module, case) not in _early:
        _early[(module, case)] = Job(module, case)


def stop_early() -> None:
    """End the early jobs no test took (the run stopped before their tests)."""
    while _early:
        _, job = _early.popitem()
        job.kill()
        job._output()


def run_job(
    module: str,
    case: str,
    *,
    timeout: float,
    extra_env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Any:
    _refuse_outside_integration(module)
    early = _early.pop((module, case), None) if extra_env is None and cwd is None else None
    job = early or Job(module, case, extra_env=extra_env, cwd=cwd)
    return job.result(timeout=timeout)


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
