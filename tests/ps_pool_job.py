"""``ps.train`` in a ``Session.local`` of its own (the suite's shared session already
runs Spark and Ray in the test process), with or without the session's warm-up::

    PYTHONPATH=tests:. python -c "import ps_pool_job, sys; sys.exit(ps_pool_job.main('warm'))"

``main(case)`` reports as one JSON line (prefixed with ``RESULT ``):

* ``warm``: the spare shards the warm-up started; a sync run (``first``): the shards it
  ran on (actor names, pids; ``num_shards`` left to its default) and its model (hex of the float64 bytes); the pool after it;
  a run whose first shard (a spare from the pool) is SIGKILLed from outside mid-run: what it
  failed with; the pool after it; the same run once more (``after_kill``);
* ``cold``: the sync run in a session without the warm-up (no spare: its own shards).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

RESULT_PREFIX = "RESULT "
N, PARTS = 400, 2


def _data(spark: Any) -> Any:
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(N):
        ids = [int(k) for k in rng.integers(0, 50, int(rng.integers(1, 5)))]
        rows.append((ids, float(rng.random() < 0.2 + 0.01 * (sum(ids) % 50))))
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS), "ids array<long>, label double"
    ).cache()
    df.count()
    return df


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
    """``grad``, but partition 0's call ``call`` waits until the test's flag file says
    the shard was killed (bounded); a relaunched task finds the flag and goes on."""

    def __init__(self, flags: str, call: int) -> None:
        self.flags, self.call, self.calls = flags, call, 0

    def __call__(self, params: Any, batch: Any) -> Any:
        import time

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


def _model(out: Any) -> str:
    keys = np.arange(0, 50)
    rows = out.model.lookup("w", keys)
    return np.concatenate([rows.ravel(), out.params["b"]]).tobytes().hex()


def _run(df: Any, report: dict[str, Any], tag: str) -> None:
    out = _train(df)
    report[tag] = {
        "pids": [int(i["pid"]) for i in out.shards],
        "names": list(out.model.shard_names),
        "model": _model(out),
    }
    out.model.close()


def _killed_run(df: Any, victim: str, flags: Path) -> dict[str, Any]:
    """A run whose shard ``victim`` (a spare's name) is SIGKILLed mid-run, found by the
    pid it reports; what it failed with."""
    import threading
    import time

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
        got["error"] = [type(ex).__name__, str(ex)[:600]]
    thread.join(300)
    return got


def _wait_up(names: list[str]) -> None:
    """Until the spares ``names`` are up: a run takes the spares that are (one still
    starting stays in the pool), and these were started as the run before ended."""
    import ray

    for name in names:
        ray.get(ray.get_actor(name, namespace="hybrid_iter").__ray_ready__.remote(), timeout=300)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def main(case: str) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import hybrid_iter as hi
    from hybrid_iter._runtime import placement
    from hybrid_iter.ps._train import shard_kind

    report: dict[str, Any] = {}
    with hi.Session.local(2, warm_up=case == "warm") as session:
        df = _data(session.spark)
        kind = shard_kind(True, None, False, 2)
        if case == "warm":
            report["warm"] = session.warmed(600)
        import ray

        report["cluster_cpus"] = float(ray.cluster_resources().get("CPU", 0.0))
        report["spares_before"] = placement.spares(kind)
        _run(df, report, "first")
        report["spares_after_first"] = placement.spares(kind)
        if case == "warm":
            _wait_up(report["spares_after_first"])
            flags = Path(os.environ["HYBRID_ITER_TEST_FLAGS"])
            report["killed"] = _killed_run(df, report["spares_after_first"][0], flags)
            report["spares_after_killed"] = placement.spares(kind)
            _wait_up(report["spares_after_killed"])
            _run(df, report, "after_kill")
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
