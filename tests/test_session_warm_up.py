"""A session warms in the background what every run needs (DESIGN.md section 8): a spare
coordinator, the array store, Spark's Python workers with our modules imported and Ray
joined. The first runs take what it made; it never changes a result; a session stopped
while it runs stops cleanly. Each case in a process of its own (``warm_up_job.py``):
the suite's shared session has warmed and used its spares long before."""

from __future__ import annotations

import pytest
from fresh_process import run_job


def _job(case: str, extra_env: dict[str, str] | None = None) -> dict:
    return run_job("warm_up_job", case, timeout=900, extra_env=extra_env)


@pytest.fixture(scope="module")
def same():
    return _job("same")


def test_fits_before_during_and_after_the_warm_up_give_the_same_models_bit_for_bit(same):
    assert same["warm"]["errors"] == {}, same["warm"]
    assert same["first"] == same["during"] == same["after"]


def test_the_first_runs_take_the_spare_coordinator_store_and_workers_the_warm_up_made():
    got = _job("taken")
    warm = got["warm"]
    assert warm["errors"] == {}, warm
    assert warm["spare"] is not None and warm["store"] is not None
    assert len(warm["python_workers"]) == 2  # one per task slot
    # ready before any run: the spare waits in the pool, the store is the driver's store
    assert got["spares_before"] == [warm["spare"]]
    assert got["store_before"] == warm["store"]
    # the iteration ran on the spare (retired to the pool again afterwards, alone: a run
    # that launched its own coordinator would have left two spares) and on the warmed
    # Python workers
    assert got["spares_after_iterate"] == [warm["spare"]]
    assert set(got["iterate_pids"]) <= set(warm["python_workers"])
    # the fit too, and it used the store the warm-up started (no second one)
    assert got["spares_after_fit"] == [warm["spare"]]
    assert got["store_after"] == warm["store"]
    assert got["store_stats"]["writes"] == 1


def test_the_warm_up_waits_for_a_quiet_spark_even_when_a_run_is_coming(same):
    # its tasks hold every slot while they import and its actors' starts take the CPU: a
    # user's first jobs and a run of ours (which starts what it needs itself) go first
    assert same["started_before_quiet"] is False
    assert len(same["warm"]["python_workers"]) == 2


def test_a_session_stopped_while_the_warm_up_runs_stops_cleanly(tmp_path):
    got = _job("closed", {"HYBRID_ITER_TEST_BLOCK_DIR": str(tmp_path)})
    assert got["task_started"] and got["warm_up_running"]  # stopped mid-warm-up
    assert got["error"] is None  # stop raised nothing
    assert got["threads"] == []  # the warm-up thread ended
    assert got["ray_initialized"] is False
    # the Spark job was cancelled (its step reports why), nothing else failed
    assert set(got["warm_up_report"]["errors"]) == {"python_workers"}, got["warm_up_report"]
    assert got["children"] == {}, got["children"]  # no Ray process or Python worker left
