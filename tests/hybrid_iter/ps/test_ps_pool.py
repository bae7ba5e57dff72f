"""Spare parameter shards, in the suite's shared session (its warm-up is on; other tests'
``ps.train`` runs take and refill the pool of the default kind): the session's warm-up
starts idle shard processes of ``ps.train``'s default kind, a run configures spares as
its own shards (found by their actor names and pids) and the pool is refilled with new
processes, a run with no spare (the pool drained by hand) starts its own shards and
trains the bit-for-bit same model, and a pooled shard SIGKILLed mid-run fails that run
naming the lost shard (as an unpooled shard Ray never restarts does) while the next run
takes fresh spares and gives the same model again."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from test_ps_sparse_recovery import _state

N, PARTS = 400, 2


def _data(spark: Any) -> Any:
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(N):
        ids = [int(k) for k in rng.integers(0, 50, int(rng.integers(1, 5)))]
        rows.append((ids, float(rng.random() < 0.2 + 0.01 * (sum(ids) % 50))))
    return spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS), "ids array<long>, label double"
    )


def grad(params: Any, batch: Any) -> Any:
    ids, y = batch["ids"], batch["label"]
    z = ids.dot(params["w"])[:, 0] + params["b"][0]
    p = 1.0 / (1.0 + np.exp(-z))
    r = (p - y) / len(y)
    return float(np.mean(np.logaddexp(0.0, z) - y * z)), {
        "w": ids.t_dot(r),
        "b": np.array([r.sum()]),
    }


class KillOnce:
    """``grad``, but each task's call ``call`` waits until the test's flag file says the
    shard was killed (bounded); a relaunched task finds the flag and goes on."""

    def __init__(self, flags: str, call: int) -> None:
        self.flags, self.call, self.calls = flags, call, 0

    def __call__(self, params: Any, batch: Any) -> Any:
        self.calls += 1
        flags = Path(self.flags)
        if self.calls == self.call and not (flags / "killed").exists():
            (flags / f"reached.{os.getpid()}").write_text("")
            deadline = time.monotonic() + 300
            while not (flags / "killed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the test's flag file, bounded
        return grad(params, batch)


def _train(df: Any, fn: Any = grad) -> Any:
    from hybrid_iter import ps

    return ps.train(
        df,
        fn,
        {"w": ps.Table(1), "b": np.zeros(1)},
        keys={"w": "ids"},
        columns=["label"],
        optimizer=ps.FTRL(alpha=0.5),
        epochs=3,
        batch_size=40,
        progress=False,
    )


def _run(df: Any) -> dict[str, Any]:
    """A run with the default shard count: its shards (actor names, pids) and its model
    (the bytes of every row it trained and of the dense part)."""
    out = _train(df)
    try:
        rows = out.model.lookup("w", np.arange(0, 50))
        return {
            "pids": [int(i["pid"]) for i in out.shards],
            "names": list(out.model.shard_names),
            "model": np.concatenate([rows.ravel(), out.params["b"]]).tobytes(),
        }
    finally:
        out.model.close()


def _killed_run(df: Any, victim: str, flags: Path) -> dict[str, Any]:
    """A run whose shard ``victim`` (a spare's name) is SIGKILLed from outside mid-run,
    found by the pid it reports; what the run failed with."""
    import ray

    got: dict[str, Any] = {}

    def kill() -> None:
        deadline = time.monotonic() + 300
        while not any(flags.glob("reached.*")) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the task's flag file, bounded
        pid = ray.get(ray.get_actor(victim, namespace="hybrid_iter").hello.remote())[2]
        got["pid"] = pid
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            time.sleep(0.05)  # polling the process's exit, bounded by the kill
        (flags / "killed").write_text("")

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    try:
        _train(df, KillOnce(str(flags), 3))
        got["error"] = None
    except Exception as ex:
        got["error"] = ex
    thread.join(300)
    return got


def _wait_up(names: list[str]) -> None:
    """Until the spares ``names`` are up: a run takes the spares that are (one still
    starting stays in the pool), and these were started as the run before ended."""
    import ray

    for name in names:
        ray.get(ray.get_actor(name, namespace="hybrid_iter").__ray_ready__.remote(), timeout=300)


def _drain(kind: Any) -> list[str]:
    """Take every spare of ``kind`` out of the pool and kill it: the next run has none."""
    from hybrid_iter._cluster import placement, spares

    drained = []
    while spares.spares(kind):
        got = spares.take_spare(kind, "__ray_ready__")  # taken as it is: not configured
        if got is not None:
            handle, name = got
            placement.kill(handle, f"the drained spare {name}")
            drained.append(name)
    return drained


def test_runs_take_the_spare_shards_and_train_the_same_model_as_fresh_ones(session, tmp_path):
    import ray

    from hybrid_iter._cluster import spares
    from hybrid_iter.ps import TrainFailedError
    from hybrid_iter.ps._shards import keep_shard_spares, shard_kind, table_shards
    from spark_ops import available_task_slots

    slots = available_task_slots(session.spark)
    cpus = float(ray.cluster_resources().get("CPU", 0.0))
    kind = shard_kind(True, None, False, slots)
    # the default shard count of a model with tables on this cluster: the warm-up
    # started that many spares of the default kind
    need = table_shards(slots, cpus)
    warm = session.warmed(600)
    assert warm is not None and not warm["errors"], warm
    assert len(warm["shard_spares"]) == need >= 1
    assert all(n.startswith("hybrid_iter.ps.spare.") for n in warm["shard_spares"])

    df = _data(session.spark).cache()
    df.count()
    try:
        # other tests' runs in the shared session took and refilled the pool (a run with
        # fewer shards refills fewer): it holds at least this run's count, all up
        keep_shard_spares(kind, need)
        before = spares.spares(kind)
        _wait_up(before)
        first = _run(df)
        # the run's shards are the pool's processes (the oldest), configured by the run
        assert len(first["names"]) == need
        assert first["names"] == before[:need]
        # ... and they never go back to the pool: the run's end starts new spares
        after_first = spares.spares(kind)
        assert len(after_first) >= need
        assert not set(after_first) & set(first["names"])

        # no spare: the run starts its own shards, and trains the same model
        assert _drain(kind) == after_first
        assert spares.spares(kind) == []
        cold = _run(df)
        assert all(".shard" in n and "spare" not in n for n in cold["names"])
        assert len(cold["names"]) == need
        assert not set(cold["pids"]) & set(first["pids"])
        assert cold["model"] == first["model"]

        # a pooled shard killed from outside mid-run fails the run, naming the lost shard
        after_cold = spares.spares(kind)
        assert len(after_cold) >= need and not set(after_cold) & set(after_first)
        _wait_up(after_cold)
        killed = _killed_run(df, after_cold[0], tmp_path)
        assert killed["pid"] is not None
        assert isinstance(killed["error"], TrainFailedError), killed["error"]
        assert "parameter shard died" in str(killed["error"])
        assert after_cold[0] in str(killed["error"])  # the failure's detail names the actor
        # the dead spare is not taken again: the next run runs on the pool's fresh spares
        after_killed = spares.spares(kind)
        assert after_cold[0] not in after_killed
        _wait_up(after_killed)
        again = _run(df)
        assert again["names"] == after_killed[:need]
        assert killed["pid"] not in again["pids"]
        assert not set(again["names"]) & set(after_cold)
        assert again["model"] == first["model"]
        # later tests find the pool refilled and up
        assert len(spares.spares(kind)) >= need
        _wait_up(spares.spares(kind))
    finally:
        df.unpersist()


def _dense_run(df: Any) -> tuple[list[int], bytes]:
    from hybrid_iter import ps

    def linear(params: Any, batch: Any) -> Any:
        r = batch["x"] @ params["w"] - batch["y"]
        return float(r @ r) / len(r), {"w": batch["x"].T @ r / len(r)}

    out = ps.train(
        df, linear, {"w": np.zeros(3)}, columns=["x", "y"], epochs=3, batch_size=20, progress=False
    )
    return sorted(int(i["pid"]) for i in out.shards), out.params["w"].tobytes()


def test_a_dense_runs_shards_serve_the_next_run_emptied_and_it_trains_the_same_model(session):
    """A dense model is all on the driver once its run ends: its shards go back to the
    pool emptied (their processes are up, so the next run skips their start) instead of
    ending, and a run on them trains the bit-for-bit same model as on new shards."""
    from hybrid_iter.ps._shards import shard_kind

    rng = np.random.default_rng(2)
    rows = [([float(v) for v in rng.normal(size=3)], float(rng.normal())) for _ in range(120)]
    df = session.spark.createDataFrame(
        session.spark.sparkContext.parallelize(rows, PARTS), "x array<double>, y double"
    )
    kind = shard_kind(True, None, False, PARTS)
    _drain(kind)  # only this test's shards in the pool
    first_pids, first = _dense_run(df)
    from hybrid_iter._cluster import spares

    assert len(spares.spares(kind)) == len(first_pids)  # kept, not ended
    second_pids, second = _dense_run(df)
    assert second_pids == first_pids  # the same processes served the next run
    assert second == first
    assert _drain(kind)  # the second run's shards went back too
    fresh_pids, fresh = _dense_run(df)
    assert not set(fresh_pids) & set(first_pids)
    assert fresh == first
