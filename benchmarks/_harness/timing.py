"""Timers: one accounting for every contender.

* ``measure(run, repeats, warmup)``: the same warm-up and repeats for each contender,
  wall seconds of each repeat (``run`` may return extra data: kept per repeat);
* ``slope(xs, ys)``: the least-squares slope (marginal cost per unit: per iteration,
  per subtask, bytes per second of a process's memory, ...);
* ``ratio(a, b)``: ``a / b`` or None where either is missing or ``b`` is 0.
"""

from __future__ import annotations

import numbers
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Measured", "measure", "ratio", "slope"]


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


def ratio(a: Any, b: Any) -> float | None:
    """``a / b``; None where either is missing (None) or ``b`` is 0."""
    if a is None or b is None:
        return None
    for v in (a, b):
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise TypeError(f"ratio: numbers or None, got {v!r}")
    return None if b == 0 else float(a) / float(b)
