"""Waiting for what a cluster manager registers: executors, task slots. One bounded poll
(``wait_for``); each caller says what it waits for and what failing to get it means.
Runs on the driver."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["task_slots", "wait_for", "wait_for_task_slots"]

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T], enough: Callable[[T], bool], seconds: float, interval: float = 0.5
) -> T:
    """``probe()`` until ``enough`` of its answer or ``seconds`` have passed; the last
    answer (which the caller checks: not ``enough`` means the wait ran out)."""
    deadline = time.monotonic() + seconds
    got = probe()
    while not enough(got) and time.monotonic() < deadline:
        time.sleep(interval)  # polling an external registration (executors), bounded
        got = probe()
    return got


def task_slots(spark: Any, parallelism: int | None = None) -> int:
    """The task slots a barrier stage may use now. A Spark Connect client knows them only
    from the server's configuration; when that says nothing, a given ``parallelism`` is
    taken as the caller's word (Spark itself refuses a barrier stage larger than the
    cluster), and without one ``available_task_slots`` asks for it."""
    from spark_ops import available_task_slots
    from spark_ops._spark_compat import connect_task_slots, is_connect

    if parallelism is not None and is_connect(spark):
        known = connect_task_slots(spark)
        return parallelism if known is None else known
    return available_task_slots(spark)


def wait_for_task_slots(
    spark: Any, wanted: int, seconds: float, parallelism: int | None = None
) -> int:
    """The task slots (``task_slots``) once there are ``wanted``, or when ``seconds`` ran
    out (fewer: the caller's error says why it needed them)."""
    return wait_for(lambda: task_slots(spark, parallelism), lambda n: n >= wanted, seconds)
