"""The fresh-process runner: a job started early is the one its test is handed, and a job
no test took is ended with its process group when the run ends."""

from __future__ import annotations

import os

import fresh_process
import pytest


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.integration  # run_job starts jobs only for these (its jobs start JVMs)
def test_a_job_started_early_is_the_one_run_job_returns():
    fresh_process.start_early("pid_job", "pid")
    early = fresh_process._early[("pid_job", "pid")]
    got = fresh_process.run_job("pid_job", "pid", timeout=120)
    assert got == {"pid": early.proc.pid, "case": "pid"}
    assert ("pid_job", "pid") not in fresh_process._early  # taken once
    again = fresh_process.run_job("pid_job", "pid", timeout=120)
    assert again["pid"] != early.proc.pid  # a later call starts its own


def test_a_job_no_test_took_is_ended_with_the_run():
    fresh_process.start_early("pid_job", "wait")
    job = fresh_process._early[("pid_job", "wait")]
    assert _alive(job.proc.pid)
    fresh_process.stop_early()
    assert not fresh_process._early
    assert job.proc.returncode == -9 and not _alive(job.proc.pid)


def test_a_job_that_does_not_end_in_time_fails_its_test_and_is_killed():
    job = fresh_process.Job("pid_job", "wait")
    with pytest.raises(pytest.fail.Exception, match=r"did not end in 0\.5 s"):
        job.result(timeout=0.5)
    assert job.proc.returncode == -9 and not os.path.exists(f"/proc/{job.proc.pid}/stat")
