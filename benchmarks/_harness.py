"""What every benchmark here shares: one accounting for every contender, one report.

* ``measure(run, repeats, warmup)``: the same warm-up and repeats for each contender,
  wall seconds of each repeat (``run`` may return extra data: kept per repeat);
* ``slope(xs, ys)``: the least-squares slope (marginal cost per unit: per iteration,
  per subtask, ...);
* ``ratio(a, b)``: ``a / b`` or None where either is missing or ``b`` is 0;
* ``machine()``: what the figures were measured on;
* ``write_report(report, path)``: the JSON file (with ``machine`` filled in), parents
  created; returns the path.

A headline ratio compares like with like: steady state with steady state (an epoch after
the first against a marginal iteration), end to end with end to end (a whole fit
against a whole fit), equal quality with equal quality.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Measured", "machine", "measure", "ratio", "slope", "write_report"]


class Measured:
    """Seconds of each repeat (after the warm-up) and what each repeat returned."""

    def __init__(self, seconds: list[float], values: list[Any], warmup: int) -> None:
        self.seconds, self.values, self.warmup = seconds, values, warmup

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def measure(run: Callable[[], Any], repeats: int, warmup: int = 1) -> Measured:
    """Call ``run`` ``warmup`` times untimed, then ``repeats`` times timed."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"measure: repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        run()
    seconds, values = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        values.append(run())
        seconds.append(time.perf_counter() - t)
    return Measured(seconds, values, warmup)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (at least two distinct ``xs``)."""
    if len(set(xs)) < 2:
        raise ValueError("slope: needs at least two distinct x values")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    den = sum((x - mx) ** 2 for x in xs)
    return num / den


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        load = None
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_1min_at_end": load,
    }


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {**report, "machine": {**machine(), **report.get("machine", {})}}
    out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    return out
