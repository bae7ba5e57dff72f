"""Spare parameter shards, each run in a fresh process (its own session: the suite's
shared one has Spark and Ray running already): the session's warm-up starts idle shard
processes of ``ps.train``'s default kind, a run configures them as its own shards (found
by their actor names and pids), the model is bit for bit the one of a session without
the warm-up, and a pooled shard SIGKILLed mid-run fails that run naming the lost shard
(as an unpooled shard Ray never restarts does) while the next run takes fresh spares and
gives the same model again."""

from __future__ import annotations

import threading

from fresh_process import run_job


def test_runs_take_the_spare_shards_and_train_the_same_model_as_fresh_ones(tmp_path):
    got: dict[str, object] = {}

    def cold() -> None:
        got["cold"] = run_job("ps_pool_job", "cold", timeout=900)

    thread = threading.Thread(target=cold)
    thread.start()
    warm = run_job(
        "ps_pool_job", "warm", timeout=900, extra_env={"HYBRID_ITER_TEST_FLAGS": str(tmp_path)}
    )
    thread.join(900)
    cold_report = got["cold"]
    assert isinstance(cold_report, dict)

    from hybrid_iter.ps._train import table_shards

    started = warm["warm"]["shard_spares"]
    assert not warm["warm"]["errors"], warm["warm"]
    # the default shard count of a model with tables on this cluster: the warm-up
    # started that many spares of the default kind
    assert len(started) == table_shards(2, warm["cluster_cpus"]) >= 1
    # the first run's shards are the warm-up's processes, configured by the run
    assert warm["spares_before"] == started
    assert warm["first"]["names"] == started
    # and they never go back to the pool: the run's end starts new spares
    assert len(warm["spares_after_first"]) == len(started)
    assert not set(warm["spares_after_first"]) & set(started)
    # a session without the warm-up has no spare: the run starts its own shards
    assert cold_report["spares_before"] == []
    assert all(".shard" in n and "spare" not in n for n in cold_report["first"]["names"])
    assert len(cold_report["first"]["names"]) == len(started)
    assert warm["first"]["model"] == cold_report["first"]["model"]

    killed = warm["killed"]
    assert killed["pid"] is not None
    assert killed["error"] is not None and killed["error"][0] == "TrainFailedError"
    assert "parameter shard died" in killed["error"][1]
    # the dead spare is not taken again: the next run runs on the pool's fresh spares
    assert warm["after_kill"]["names"] == warm["spares_after_killed"]
    assert killed["pid"] not in warm["after_kill"]["pids"]
    assert not set(warm["after_kill"]["names"]) & set(warm["spares_after_first"])
    assert warm["after_kill"]["model"] == cold_report["first"]["model"]
