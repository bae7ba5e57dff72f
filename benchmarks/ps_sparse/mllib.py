"""Spark MLlib's contenders: fits with maxIter 1, 2, 4, ... from scratch until one
reaches the target (``run_mllib``), each under a budget that cancels the fit running
when it runs out; a JVM that exits in a fit (an OutOfMemoryError in a task) is said."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from _harness import Watch, measure

from hybrid_iter.ps._epochs import auc, log_loss

from .record import Run


@contextmanager
def _deadline(sc: Any, group: str, seconds: float) -> Iterator[dict[str, bool]]:
    """Cancel the Spark jobs of ``group`` (this thread's) once ``seconds`` have passed,
    again every second until the block ends (an MLlib fit runs many jobs)."""
    state = {"cancelled": False}
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        state["cancelled"] = True
        while not done.is_set():
            try:
                sc.cancelJobGroup(group)
            except Exception:  # the JVM is gone: the fit fails by itself
                return
            done.wait(1.0)

    sc.setJobGroup(group, group, interruptOnCancel=True)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        done.set()
        thread.join()
        try:
            sc.setJobGroup("bench", "bench", interruptOnCancel=True)
        except Exception:  # the JVM exited in the fit: said by run_mllib
            pass


def _probabilities(model: Any, test: Any) -> np.ndarray:
    from pyspark.ml.functions import vector_to_array

    pdf = model.transform(test).select(vector_to_array("probability")[1].alias("p")).toPandas()
    return pdf["p"].to_numpy()


def run_mllib(
    name: str,
    make: Callable[[int], Any],
    *,
    dim: int,
    train: Any,
    test: Any,
    y_te: np.ndarray,
    target: float,
    budget: float,
    repeats: int,
    bytes_per_pass: float,
    bytes_how: str,
    max_iter: int = 256,
) -> Run:
    """Fits with maxIter 1, 2, 4, ... (each from scratch, ``repeats`` times: the median)
    until one reaches ``target``, the model converged, or ``budget`` seconds of fitting
    (the medians' sum) ran out (the fit running then is cancelled)."""
    sc = train.sparkSession.sparkContext
    run = Run(name, dim)
    with _deadline(sc, f"{name}-{dim}-warm-up", budget) as state:
        try:
            make(1).fit(train)  # warm-up: a maxIter 1 fit
        except Exception as ex:
            why = "cancelled: the budget ran out" if state["cancelled"] else _error(ex)
            run.error = None if state["cancelled"] else _with_jvm_state(why, train)
            run.notes.append(f"warm-up (maxIter 1): {why}")
            run.bytes_per_step, run.bytes_how = bytes_per_pass, bytes_how
            return run
    fits: list[dict[str, Any]] = []
    spent = 0.0
    k = 1
    with Watch() as watch:
        while k <= max_iter and spent < budget:
            left = (budget - spent) * repeats
            with _deadline(sc, f"{name}-{dim}-{k}", left) as state:
                t = time.perf_counter()
                try:
                    fitted = measure(lambda k=k: make(k).fit(train), repeats, warmup=0)
                    model, seconds, error = fitted.values[-1], fitted.median, None
                except Exception as ex:  # a cancelled or failed fit: said, not hidden
                    model, seconds, error = None, time.perf_counter() - t, _error(ex)
            spent += seconds
            if model is None:
                why = "cancelled: the budget ran out" if state["cancelled"] else error
                run.notes.append(f"maxIter {k}: {why} after {seconds:.0f} s")
                if not state["cancelled"]:
                    run.error = _with_jvm_state(error, train)
                break
            watch.pause()
            p = _probabilities(model, test)
            iters = _iterations(model, k)
            fits.append(
                {
                    "epoch": k,
                    "max_iter": k,
                    "iterations": iters,
                    "train_s": seconds,
                    "log_loss": log_loss(p, y_te),
                    "auc": auc(p, y_te),
                }
            )
            watch.resume()
            if iters < k:
                run.notes.append(f"converged after {iters} iterations")
                break
            if fits[-1]["log_loss"] <= target:
                break
            k *= 2
    run.epochs = fits
    run.procs = watch.report()
    if fits:
        run.ms_per_pass = fits[-1]["train_s"] / max(1, fits[-1]["iterations"]) * 1e3
        run.notes.append("ms_per_pass: the largest fit's seconds per iteration")
    run.bytes_per_step = bytes_per_pass
    run.bytes_how = bytes_how
    run.notes.append(
        "full-batch: one step is a pass over the data; time to target is the wall time of "
        "the first fit (maxIter 1, 2, 4, ...) that reaches it, fitted from scratch"
    )
    return run


def _error(ex: BaseException) -> str:
    """The exception, and for a Java one the Java exception's own first line."""
    try:
        text = str(ex)
    except Exception:  # a Py4JJavaError asks the JVM for its text: it may be gone
        text = f"(no message: the JVM did not answer) {ex.args[:1]!r}"
    lines = [x.strip() for x in text.strip().splitlines()]
    java = next((x for x in lines if re.match(r"^([\w$]+\.)+[\w$]*(Exception|Error)\b", x)), None)
    first = lines[0] if lines else ""
    return f"{type(ex).__name__}: {first[:200]}" + (f" ({java[:300]})" if java else "")


def jvm_alive(sc: Any) -> bool:
    """Whether the Spark JVM still answers (an OutOfMemoryError in a task exits it)."""
    try:
        sc._jsc.sc().isStopped()
        return True
    except Exception:
        return False


def _jvm_exited(sc: Any, within: float = 5.0) -> bool:
    """After a failed fit: whether the JVM exits (it takes a moment to)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not jvm_alive(sc):
            return True
        time.sleep(0.5)
    return False


def _with_jvm_state(error: str | None, df: Any) -> str | None:
    if error is None or not _jvm_exited(df.sparkSession.sparkContext):
        return error
    return (
        f"{error}; the Spark JVM exited during the fit (likely a java.lang.OutOfMemoryError "
        f"in a task, on which Spark's uncaught-exception handler exits the JVM: its heap, "
        f"--driver-memory, too small for MLlib at this D)"
    )


def _iterations(model: Any, k: int) -> int:
    try:
        return int(model.summary.totalIterations)
    except Exception:
        return k
