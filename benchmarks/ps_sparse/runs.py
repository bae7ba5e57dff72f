"""The contenders that train in the driver (the numpy floor, scikit-learn's SGD) and
``ps.train``'s runs (``run_ps``; ``sweep``: ms per step by D, interleaved), each through
the harness: the same warm-up and repeats, the same process watch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from _harness import Watch, measure

from hybrid_iter import ps
from hybrid_iter.ps._epochs import auc, log_loss

from .config import PARTS
from .data import Data, Frames, csr_matrix
from .floor import NumpyFloor
from .models import PsSpec, lr_spec
from .record import Run, dim_label, median_lists, steady_seconds, steps_per_epoch

# -- numpy and scikit-learn (in the driver) ---------------------------------------------------


def run_numpy(data: Data, dim: int, epochs: int, repeats: int) -> tuple[Run, NumpyFloor]:
    ids_tr, ids_te, parts = data.ids(dim), data.ids(dim, "te"), data.parts()
    NumpyFloor(dim).epoch(ids_tr, data.y_tr, parts)  # warm-up: one epoch
    kept: dict[str, Any] = {}

    def once() -> dict[str, Any]:
        first = "model" not in kept
        seconds, metrics = [], []
        with Watch() as watch:
            t = time.perf_counter()
            floor = NumpyFloor(dim)  # its start-up: the model's arrays, inside epoch 1
            for _ in range(epochs):
                floor.epoch(ids_tr, data.y_tr, parts)
                seconds.append(time.perf_counter() - t)
                t = time.perf_counter()
                if first:
                    watch.pause()
                    p = floor.predict(ids_te)
                    metrics.append((log_loss(p, data.y_te), auc(p, data.y_te)))
                    watch.resume()
        if first:
            kept.update(model=floor, metrics=metrics)
        return {"seconds": seconds, "procs": watch.report()}

    got = measure(once, repeats, warmup=0).values
    return _one_process_run("numpy", dim, data, got, kept["metrics"]), kept["model"]


def _one_process_run(
    name: str, dim: int, data: Data, got: list[dict[str, Any]], metrics: list[Any]
) -> Run:
    """A contender that trains in one process: its epochs (medians of the repeats, with
    the held-out metrics of the first), steady step and pass times; nothing moves."""
    run = Run(name, dim)
    per_epoch = median_lists([v["seconds"] for v in got])
    cum = np.cumsum(per_epoch)
    run.epochs = [
        {"epoch": e + 1, "train_s": float(cum[e]), "log_loss": ll, "auc": a}
        for e, (ll, a) in enumerate(metrics)
    ]
    steady = steady_seconds(per_epoch)
    run.ms_per_step = steady / steps_per_epoch(data) * 1e3
    run.ms_per_pass = steady * 1e3
    run.bytes_per_step = 0.0
    run.bytes_how = "one process: nothing moves"
    run.procs = got[0]["procs"]
    return run


def run_sgd(data: Data, dim: int, epochs: int, repeats: int) -> Run:
    from sklearn.linear_model import SGDClassifier

    x_tr, x_te = csr_matrix(data.ids(dim), dim), csr_matrix(data.ids(dim, "te"), dim)

    def model() -> Any:
        return SGDClassifier(
            loss="log_loss",
            alpha=1e-6,
            learning_rate="constant",
            eta0=0.01,
            average=True,
            random_state=0,
        )

    model().partial_fit(x_tr, data.y_tr, classes=[0.0, 1.0])  # warm-up: one epoch
    kept: dict[str, Any] = {}

    def once() -> dict[str, Any]:
        first = "metrics" not in kept
        m = model()
        seconds, metrics = [], []
        with Watch() as watch:
            for _ in range(epochs):
                t = time.perf_counter()
                m.partial_fit(x_tr, data.y_tr, classes=[0.0, 1.0])
                seconds.append(time.perf_counter() - t)
                if first:
                    watch.pause()
                    p = m.predict_proba(x_te)[:, 1]
                    metrics.append((log_loss(p, data.y_te), auc(p, data.y_te)))
                    watch.resume()
        if first:
            kept["metrics"] = metrics
        return {"seconds": seconds, "procs": watch.report()}

    got = measure(once, repeats, warmup=0).values
    run = _one_process_run("sklearn_sgd", dim, data, got, kept["metrics"])
    run.notes.append("per-example SGD: ms_per_step is its epoch time per 2 x 1,024 rows")
    return run


# -- ps.train -----------------------------------------------------------------------------------


def run_ps(
    spec: PsSpec,
    dim: Any,
    train: Any,
    test: Any,
    data: Data,
    epochs: int,
    repeats: int,
    inspect: Callable[[Any], dict[str, Any]] | None = None,
) -> Run:
    """``repeats`` timed runs without evaluation (``inspect(result)`` on the first, before
    its shards stop), then one run with ``eval_df`` for the metrics per epoch."""
    run = Run(spec.name, dim if dim is not None else "raw")
    steps = steps_per_epoch(data)
    checked: dict[str, Any] = {}
    ps.train(train, spec.grad_fn, epochs=1, **spec.kwargs()).close()  # warm-up: one epoch

    def once() -> dict[str, Any]:
        with Watch() as watch, _iteration_start() as began:
            t = time.perf_counter()
            out = ps.train(train, spec.grad_fn, epochs=epochs, **spec.kwargs())
            wall = time.perf_counter() - t
        # the end of each epoch, from the call: the shards' start, the Spark stage, the
        # data read (load), then the epochs (the iteration's alignments)
        first = began[0] - t + out.result.load_seconds
        ends = [first + float(x) for x in np.cumsum(out.result.epoch_seconds)]
        try:
            if inspect is not None and not checked:
                checked.update(inspect(out))
            shards = out.shards
            moved = sum(s["bytes_in"] + s["bytes_out"] for s in shards)
            return {
                "wall": wall,
                "ends": ends,
                "epoch_seconds": list(out.result.epoch_seconds),
                "load_seconds": out.result.load_seconds,
                "loss": out.loss,
                "moved": moved,
                "calls": sum(s["calls"] for s in shards),
                "keys": {
                    t: sum(s["tables"][t]["keys"] for s in shards) for t in shards[0]["tables"]
                },
                "procs": watch.report(
                    {"ps_shards": [s["cpu_seconds"] for s in shards]}, "the shards' own counters"
                ),
            }
        finally:
            out.close()

    got = measure(once, repeats, warmup=0).values
    wall = statistics.median(v["wall"] for v in got)
    per_epoch = median_lists([v["epoch_seconds"] for v in got])
    to_epoch = median_lists([v["ends"] for v in got])
    out = ps.train(
        train,
        spec.grad_fn,
        epochs=epochs,
        eval_df=test,
        predict_fn=spec.predict_fn,
        **spec.kwargs(),
    )
    try:
        ev = out.eval
        eval_loss = out.loss
    finally:
        out.close()
    run.epochs = [
        {
            "epoch": e + 1,
            "train_s": to_epoch[e],
            "epoch_s": per_epoch[e],
            "log_loss": ev[e]["log_loss"] if e < len(ev) else None,
            "auc": ev[e]["auc"] if e < len(ev) else None,
            "train_loss": got[0]["loss"][e] if e < len(got[0]["loss"]) else None,
        }
        for e in range(len(per_epoch))
    ]
    steady = steady_seconds(per_epoch)
    run.ms_per_step = steady / steps * 1e3
    run.ms_per_pass = steady * 1e3
    worker_steps = steps * PARTS * len(per_epoch)
    moved = statistics.median(v["moved"] for v in got) / worker_steps
    run.bytes_how = (
        "the shards' bytes in + out per worker step (keys, rows, gradients; the dense "
        "values each reply hands out)"
    )
    run.bytes_per_step = moved
    run.procs = got[0]["procs"]
    run.extra = {
        "wall_s": wall,
        "start_up_s": to_epoch[0] - per_epoch[0],
        "teardown_s": wall - to_epoch[-1],
        "load_s": statistics.median(v["load_seconds"] for v in got),
        "shard_calls_per_worker_step": statistics.median(v["calls"] for v in got) / worker_steps,
        "keys_held": got[0]["keys"],
        "eval_run_training_loss_equal": eval_loss == got[0]["loss"],
        **checked,
    }
    if spec.mode == "async":
        run.notes.append("async: times from the runs without evaluation, metrics from the run with")
    return run


@contextmanager
def _iteration_start() -> Iterator[list[float]]:
    """When ``ps.train`` starts its iteration (after starting the shards): the
    iteration's ``load_seconds`` and epoch times count from there."""
    from hybrid_iter.ps import _train

    began: list[float] = []
    inner = _train.iterate_bounded_streams_until_termination

    def stamped(*args: Any, **kwargs: Any) -> Any:
        began.append(time.perf_counter())
        return inner(*args, **kwargs)

    _train.iterate_bounded_streams_until_termination = stamped
    try:
        yield began
    finally:
        _train.iterate_bounded_streams_until_termination = inner


# -- ps.train's checks against the other contenders, and the D sweep -------------------------


def compare_with_floor(floor: NumpyFloor, keys: np.ndarray, kept: dict[str, Any]) -> Callable:
    """``inspect`` of the sync run: its table and bias against the numpy loop's."""

    def inspect(out: Any) -> dict[str, Any]:
        w = out.lookup("w", keys)[:, 0]
        bias = np.asarray(out.params["bias"], dtype=np.float64)
        kept.update(keys=keys, w=w, bias=bias)
        diff = max(float(np.max(np.abs(w - floor.w[keys]))), float(abs(bias[0] - floor.bias[0][0])))
        return {
            "max_abs_diff_vs_numpy": diff,
            "keys_held_equal_keys_trained": int(out.params["w"].num_keys) == len(keys),
        }

    return inspect


def compare_with_sparse(kept: dict[str, Any]) -> Callable:
    """``inspect`` of the dense run: its vector at the trained ids against the table."""

    def inspect(out: Any) -> dict[str, Any]:
        if not kept:
            return {}
        w = np.asarray(out.params["w"])[kept["keys"]]
        diff = max(
            float(np.max(np.abs(w - kept["w"]))),
            float(abs(np.asarray(out.params["bias"])[0] - kept["bias"][0])),
        )
        return {"max_abs_diff_vs_ps_sync": diff}

    return inspect


def sweep(
    frames: Frames, data: Data, dims: list[int], rounds: int, epochs: int = 2
) -> dict[str, Any]:
    """ms and bytes per step of ``ps_sync`` at every D, measured interleaved (each round
    runs every D once, in a rotated order), so the machine's drift falls on all D alike:
    each run's epochs after the first, per step; medians over the rounds."""
    frames_by = {d: frames.ids(d)[0] for d in dims}
    spec = lr_spec("sync")
    ms: dict[int, list[float]] = {d: [] for d in dims}
    moved: dict[int, list[float]] = {d: [] for d in dims}
    steps = steps_per_epoch(data)
    ps.train(frames_by[dims[0]], spec.grad_fn, epochs=1, **spec.kwargs()).close()  # warm-up
    for r in range(rounds):
        for d in dims[r % len(dims) :] + dims[: r % len(dims)]:
            out = ps.train(frames_by[d], spec.grad_fn, epochs=epochs, **spec.kwargs())
            try:
                secs = out.result.epoch_seconds
                ms[d].append(steady_seconds(list(secs)) / steps * 1e3)
                total = sum(s["bytes_in"] + s["bytes_out"] for s in out.shards)
                moved[d].append(total / (steps * PARTS * len(secs)))
            finally:
                out.close()
    frames.release()
    med = {dim_label(d): statistics.median(v) for d, v in ms.items()}
    mid = statistics.median(med.values())
    return {
        "rounds": rounds,
        "epochs_per_run": epochs,
        "ms_per_step": med,
        "ms_per_step_all": {dim_label(d): v for d, v in ms.items()},
        "bytes_per_step": {dim_label(d): statistics.median(v) for d, v in moved.items()},
        "max_over_median": max(med.values()) / mid,
        "min_over_median": min(med.values()) / mid,
    }
