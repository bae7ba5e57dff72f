"""A session warms in the background what every run needs (docs/design.md, "Performance"): a spare
coordinator, the array store, Spark's Python workers with our modules imported and Ray
joined. The first runs take what it made; it never changes a result; a session stopped
while it runs stops cleanly. Each case in a process of its own (``warm_up_job.py``):
the suite's shared session has warmed and used its spares long before; only the order
of an entry point's steps is read on the shared session."""

from __future__ import annotations

import pytest
from fresh_process import run_job

pytestmark = pytest.mark.integration  # each test starts its own Spark or Ray


def _job(case: str, extra_env: dict[str, str] | None = None) -> dict:
    return run_job("warm_up_job", case, timeout=480, extra_env=extra_env)  # under pytest-timeout


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


def test_an_entry_point_says_a_run_is_coming_before_it_starts_an_actor(session, spark, monkeypatch):
    """The warm-up must not start beside a run's own actor starts: ``ps.train`` starts
    its shards and a fit its array store before the iteration's entry checks run, so
    each says a run is coming before that (the suite's session: its warm-up is over,
    which only the times below are read from)."""
    import time

    import numpy as np

    from hybrid_iter import ml, ps
    from hybrid_iter._runtime import array_store
    from hybrid_iter.ps import _shards, _train

    warm = session._warm
    assert warm is not None
    seen: dict[str, float] = {}

    def watch(name, fn):
        def called(*args, **kwargs):
            seen.setdefault(name, warm._run_coming_at)
            return fn(*args, **kwargs)

        return called

    monkeypatch.setattr(_train, "start_shards", watch("shards", _shards.start_shards))
    monkeypatch.setattr(array_store, "_store", watch("store", array_store._store))
    df = spark.createDataFrame(
        [([float(i), 1.0], float(i % 3)) for i in range(40)], "x array<double>, y double"
    ).repartition(2)
    started = time.monotonic()

    def grad(params, batch):
        r = batch["x"] @ params["w"] - batch["y"]
        return float(r @ r), {"w": batch["x"].T @ r / len(r)}

    ps.train(df, grad, {"w": np.zeros(2)}, epochs=1, columns=["x", "y"], progress=False)
    fit_started = time.monotonic()
    ml.LinearRegression(features_col="x", label_col="y", progress=False).fit(df.cache())
    assert set(seen) == {"shards", "store"}
    assert seen["shards"] >= started and seen["store"] >= fit_started, (started, seen)
