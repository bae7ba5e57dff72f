"""Shards that survive, on real Spark + Ray: a parameter shard SIGKILLed from outside in
the middle of a run (its pid from the actor itself, the signal from this process) is
restarted by Ray, every shard is restored from the newest checkpoint's cut, and the run
goes on: a sync run ends bit for bit equal to the run without the fault; an async run
keeps every update applied before the cut, applies each step once in the end, and says
what it replayed.

The kill happens at a known point: partition 0's grad_fn, at its first call from a given
one on at which a checkpoint is committed (so that there is a cut to go back to, however
slow the other partition is), writes a ``ready`` file and waits (bounded) for the
``killed`` file that the test's thread writes once the shard's process is gone; the
relaunched tasks see ``killed`` and go on."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hybrid_iter as hi
from hybrid_iter import ps

N, PARTS = 240, 2


@pytest.fixture(scope="module")
def data(spark):
    rng = np.random.default_rng(17)
    rows = []
    for i in range(N):
        bag = rng.integers(-(2**62), 2**62, int(rng.integers(1, 6)))
        bag = np.concatenate([bag % 97, bag])  # frequent small ids and rare hashed ones
        rows.append(
            (
                [int(b) for b in bag],
                float(rng.random() < 0.4),
                float(rng.normal()),
                i // (N // PARTS),
            )
        )
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS),
        "ids array<long>, label double, x double, part long",
    ).cache()
    df.count()
    keys = np.unique(np.concatenate([r[0] for r in rows]))
    yield df, keys
    df.unpersist()


def fm_grad(params, batch):
    """A logistic factorization machine with a dense feature."""
    x, y = batch["ids"], batch["label"]
    v = params["v"]
    s = x.dot(v)
    s2 = x.dot(ps.Rows("v", v.ids, v.values * v.values))
    z = x.dot(params["w"])[:, 0] + 0.5 * (s * s - s2).sum(axis=1)
    z = z + params["a"][0] * batch["x"] + params["b"][0]
    p = 1 / (1 + np.exp(-z))
    r = (p - y) / len(y)
    gv = x.t_dot(r[:, None] * s) - v.values * x.t_dot(r)
    loss = float(np.mean(np.logaddexp(0, z) - y * z))
    grads = {"w": x.t_dot(r), "v": gv, "a": np.array([r @ batch["x"]]), "b": np.array([r.sum()])}
    return loss, grads


def _init():
    return {
        "w": ps.Table(),
        "v": ps.Table(dim=3, init=ps.Normal(0.05, seed=4)),
        "a": np.zeros(1),
        "b": np.zeros(1),
    }


class PauseOnce:
    """``fn``, except that partition 0, from its ``call``-th call on, once a checkpoint is
    committed under ``checkpoints``, waits (bounded) for the test to kill a shard, once: a
    relaunched task finds ``killed`` and does not wait. (Partition 0 goes on stepping until
    then: taking a cut needs every partition between two steps, not blocked in one.)"""

    def __init__(self, fn, flags: str, call: int, checkpoints: str) -> None:
        self.fn, self.flags, self.call, self.checkpoints = fn, flags, call, checkpoints
        self.calls = 0

    def __call__(self, params, batch):
        if batch["part"][0] == 0:
            self.calls += 1
            flags = Path(self.flags)
            if (
                self.calls >= self.call
                and not (flags / "killed").exists()
                and not (flags / "ready").exists()
                and any(Path(self.checkpoints).rglob("chk-*.ckpt"))
            ):
                (flags / "ready").write_text("")
                deadline = time.monotonic() + 300
                while not (flags / "killed").exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError("the test never killed the shard")
                    time.sleep(0.05)  # waiting for a file written by another process
        return self.fn(params, batch)


def _killer(flags: Path, run_name: str, shard: int, got: dict) -> threading.Thread:
    """Once ``ready`` appears: find the shard of run ``run_name`` by name, ask it its pid,
    SIGKILL it, wait until its process is gone, write ``killed``."""
    import ray

    def run() -> None:
        try:
            deadline = time.monotonic() + 300
            while not (flags / "ready").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the run never reached the kill point")
                time.sleep(0.05)
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"hybrid_iter.ps.{run_name}.")
                and a["name"].endswith(f".shard{shard}")
            ]
            assert len(names) == 1, names
            handle = ray.get_actor(names[0], namespace="hybrid_iter")
            pid = ray.get(handle.info.remote())["pid"]
            os.kill(pid, signal.SIGKILL)
            while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard process {pid} did not end")
                time.sleep(0.05)
            got["pid"] = pid
        except BaseException as ex:  # reported by the test
            got["error"] = ex
        finally:
            (flags / "killed").write_text("")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2]
    except OSError:
        return "gone"


def _train(df, grad_fn, path, *, name, mode="sync", epochs=5):
    return ps.train(
        df,
        grad_fn,
        _init(),
        keys={"w": "ids", "v": "ids"},
        optimizer=ps.Adagrad(0.1),
        mode=mode,
        epochs=epochs,
        batch_size=30,
        num_shards=3,
        parallelism=PARTS,
        checkpoint=hi.CheckpointConfig(str(path), every_epochs=1),
        name=name,
    )


def test_a_shard_sigkilled_mid_run_is_restored_and_a_sync_run_ends_bit_for_bit(data, tmp_path):
    df, keys = data
    clean = _train(df, fm_grad, tmp_path / "clean", name="ps-clean")
    try:
        want_w, want_v = clean.lookup("w", keys), clean.lookup("v", keys)
        want = (clean.params["a"], clean.params["b"], clean.loss)
    finally:
        clean.close()
    flags = tmp_path / "flags"
    flags.mkdir()
    got: dict = {}
    # partition 0 has 4 steps per epoch: call 11 is epoch 2, step 2 (checkpoints of 0, 1)
    thread = _killer(flags, "ps-killed", 1, got)
    pause = PauseOnce(fm_grad, str(flags), 11, str(tmp_path / "killed"))
    out = _train(df, pause, tmp_path / "killed", name="ps-killed")
    thread.join(timeout=60)
    try:
        assert "error" not in got, got.get("error")
        assert got["pid"] > 0
        [restore] = out.restores
        assert restore["discarded_updates"][1] is None  # lost with its process
        assert all(restore["discarded_updates"][s] >= 0 for s in (0, 2))
        assert out.result.attempts, "the stage was relaunched"
        np.testing.assert_array_equal(out.lookup("w", keys), want_w)
        np.testing.assert_array_equal(out.lookup("v", keys), want_v)
        np.testing.assert_array_equal(out.params["a"], want[0])
        np.testing.assert_array_equal(out.params["b"], want[1])
        assert out.loss == want[2]
        assert out.params["v"].num_keys == len(keys)
    finally:
        out.close()


def test_an_async_run_keeps_every_update_before_the_cut_and_says_what_it_replayed(data, tmp_path):
    """Async: updates applied after the cut are discarded from the shards that survived
    (and lost with the killed one) and the workers run those steps again, so in the end
    every shard applied each step of each worker exactly once."""
    df, keys = data
    flags = tmp_path / "flags"
    flags.mkdir()
    got: dict = {}
    thread = _killer(flags, "ps-async", 2, got)
    epochs = 4
    out = _train(
        df,
        PauseOnce(fm_grad, str(flags), 7, str(tmp_path / "ckpt")),
        tmp_path / "ckpt",
        name="ps-async",
        mode="async",
        epochs=epochs,
    )
    thread.join(timeout=60)
    try:
        assert "error" not in got, got.get("error")
        [restore] = out.restores
        assert restore["discarded_updates"][2] is None
        at_cut, at_failure = restore["positions_at_cut"], restore["positions_at_failure"]
        assert set(at_cut) == {0, 1}
        # the workers were past the cut when the shard died: those steps ran again
        assert any(at_failure[p] > at_cut[p] for p in at_failure)
        steps = 2 * 4  # 2 workers x 4 steps per epoch
        assert all(s["updates"] == steps * epochs for s in out.shards)
        assert out.params["v"].num_keys == len(keys)
        assert out.loss[-1] < out.loss[0]
    finally:
        out.close()
