"""What the estimators of ``hybrid_iter.ml`` share: parameter checks and the iteration
run (the model base class is ``_stages.StageModel``). Runs on the driver.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from coordinator import RuntimeHooks
from spark_ops import CachedSource, available_task_slots, read_columns
from spark_ops._spark_compat import is_connect

from .._body import IterationBody
from .._config import IterationConfig
from .._errors import (
    IterationConfigError,
    IterationFailedError,
    StoredArraysLost,
)
from .._result import IterationResult
from .._runtime.array_store import forget, plan_reuse
from .._runtime.controller import relaunch_if_worker_died
from .._runtime.endpoint import refuse_on_connect
from .._runtime.entry import refuse_stopped_session, runs_coming
from .._runtime.iterate import iterate_bounded_streams_until_termination
from .._streams import DataStream, ReplayableDataStreamList, _is_dataframe
from ._features import FeaturePlan

__all__ = [
    "MODES",
    "check_bool",
    "check_column",
    "check_features_col",
    "check_int",
    "check_mode",
    "check_number",
    "check_optional_column",
    "run_iteration",
    "run_with_array_cache",
    "with_array_cache",
]

MODES = ("sync", "async", "ssp")

T = TypeVar("T")


def _where(owner: str, name: str) -> str:
    return f"{owner}({name}=...)"


def check_int(owner: str, name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        extra = " or None" if optional else ""
        raise IterationConfigError(
            f"{_where(owner, name)} must be an int >= {minimum}{extra}, got {value!r}"
        )


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    optional: bool = False,
) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = not math.isnan(v) and (v > low if low_open else v >= low) and v <= high
    if not ok:
        lo = f"> {low:g}" if low_open else f">= {low:g}"
        hi = f" and <= {high:g}" if math.isfinite(high) else ""
        raise IterationConfigError(
            f"{_where(owner, name)} must be a number {lo}{hi}"
            + (" or None" if optional else "")
            + f", got {value!r}"
        )


def check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise IterationConfigError(f"{_where(owner, name)} must be True or False, got {value!r}")


def check_column(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise IterationConfigError(
            f"{_where(owner, name)} must be a column name (a non-empty string), got {value!r}"
        )


def check_optional_column(owner: str, name: str, value: Any) -> None:
    if value is not None:
        check_column(owner, name, value)


def check_features_col(owner: str, value: Any) -> str | tuple[str, ...]:
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and value
        and all(isinstance(c, str) and c for c in value)
    ):
        return tuple(value)
    raise IterationConfigError(
        f"{owner}(features_col=...) must be a vector column's name or a non-empty list of "
        f"numeric column names, got {value!r}"
    )


def check_mode(owner: str, mode: Any, staleness: Any) -> int | None:
    """``mode`` and ``staleness`` as the core's ``IterationConfig.staleness``."""
    if mode not in MODES:
        raise IterationConfigError(
            f"{_where(owner, 'mode')} must be 'sync' (lock step, deterministic), 'async' "
            f"(no subtask waits) or 'ssp' (bounded staleness), got {mode!r}"
        )
    if mode == "ssp":
        check_int(owner, "staleness", staleness, minimum=1)
        return int(staleness)
    if staleness is not None:
        raise IterationConfigError(
            f"{_where(owner, 'staleness')} applies to mode='ssp' only (got mode={mode!r}); "
            f"drop it, or use mode='ssp'"
        )
    return 0 if mode == "sync" else None


def check_progress(owner: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise IterationConfigError(
            f"{_where(owner, 'progress')} must be True, False or None (only on a terminal), "
            f"got {value!r}"
        )


def check_dataframe(owner: str, df: Any, *, call: str | None = None) -> None:
    call = call or f"{owner}.fit(df)"
    if not _is_dataframe(df):
        raise IterationConfigError(f"{call} needs a pyspark.sql.DataFrame, got {type(df).__name__}")
    refuse_stopped_session(df, f"the DataFrame given to {call}")
    refuse_on_connect(owner, df.sparkSession)  # what cannot run on Spark Connect yet
    if df.isStreaming:
        raise IterationConfigError(
            f"{call} needs bounded data, got a streaming DataFrame; for online "
            f"training see hybrid_iter.iterate_unbounded_streams"
        )


def run_iteration(
    df: Any,
    plan: FeaturePlan,
    init: Mapping[str, Any],
    body: IterationBody,
    *,
    staleness: int | None,
    parallelism: int | None,
    progress: bool | None,
    name: str,
    progress_tag: str = "loss",
    max_epochs: int | None = None,
    hooks: RuntimeHooks | None = None,
    data: Any = None,
) -> IterationResult:
    """One iteration over the plan's columns of ``df`` (read once into each subtask);
    with ``plan.stored`` reading, over a stand-in of one row per partition (the tasks
    read their arrays from the array cache, ``with_array_cache``). ``data``: the
    DataFrame of exactly those columns of ``df`` to read; by default ``read_columns``'
    (a caller that asked it already passes its answer).
    ``hooks``: test hooks (``hybrid_iter.testing``) at the runtime's hook points."""
    if plan.stored is not None and plan.stored.read:
        n = plan.stored.num_partitions
        stream = DataStream(_stand_in(df.sparkSession, n))
    else:
        if data is None:
            _, data = read_columns(df, plan.input_columns)
        stream = DataStream(data, numeric_columns=plan.scalar_columns or None)
    config = IterationConfig(
        staleness=staleness,
        parallelism=parallelism,
        progress=progress,
        name=name,
        progress_tag=progress_tag,
        max_epochs=max_epochs,
        hooks=hooks,
    )
    if body.feedback_combine is not None and is_connect(df.sparkSession):
        # its group actors are Ray actors, which a Connect server's tasks cannot reach:
        # every partition's feedback goes to the coordinator by the endpoint instead
        # (the same sums, merged in the coordinator)
        body = replace(body, feedback_combine=None)
    return iterate_bounded_streams_until_termination(
        init, ReplayableDataStreamList.not_replay(stream), config, body
    )


_STAND_IN: list[Any] = []  # [(session, n, DataFrame)]: the latest only


def _stand_in(spark: Any, n: int) -> Any:
    """``spark.range(0, n, 1, n)``: one row (its partition id) per partition, built once
    per session and count."""
    if not _STAND_IN or _STAND_IN[0][0] is not spark or _STAND_IN[0][1] != n:
        _STAND_IN[:] = [(spark, n, spark.range(0, n, 1, n))]
    return _STAND_IN[0][2]


def with_array_cache(
    df: Any,
    plan: FeaturePlan,
    parallelism: int | None,
    hooks: RuntimeHooks | None = None,
    source: CachedSource | None = None,
) -> FeaturePlan:
    """``plan`` with the array cache's decision for a fit of ``df`` (driver, no Spark
    job): read the arrays an earlier fit of the same cached data kept, keep the ones
    this fit reads, or neither (``_runtime.array_store``). ``source``: the cached data
    ``df.select(*plan.input_columns)`` reads (``cached_view``), asked now; None: not
    cached data read whole."""
    n = parallelism or available_task_slots(df.sparkSession)
    stored = plan_reuse(df.sparkSession, source, plan.decoding, n, hooks)
    return replace(plan, stored=stored)


def _stored_arrays_lost(ex: BaseException) -> BaseException | None:
    """The failure saying arrays a fit was to read from the cache are gone, if any."""
    failures = getattr(ex, "failures", None) or {}
    for f in failures.values():
        if isinstance(getattr(f, "cause", None), StoredArraysLost):
            return f
    return None


def run_with_array_cache(
    owner: str,
    df: Any,
    plan: FeaturePlan,
    build: Callable[[FeaturePlan], tuple[Mapping[str, Any], IterationBody]],
    *,
    parallelism: int | None,
    **kwargs: Any,
) -> tuple[IterationResult, str]:
    """``run_iteration`` of the body ``build(plan)`` gives for the array cache's plan
    (``with_array_cache``), and where the data came from: ``"array cache"`` or
    ``"spark"``. Arrays found gone mid-fit (``StoredArraysLost``: the store actor or a
    node lost) cost one warning and a rerun from Spark, never the fit; a Python worker
    that died costs one relaunch (``relaunch_if_worker_died``)."""
    # the array cache is a Ray actor the subtasks write to and read from; a Spark
    # Connect server's tasks have no Ray (they reach the coordinator by its endpoint
    # only), so a fit there decodes from Spark every time and keeps nothing
    runs_coming(df.sparkSession)  # the array store may start before the iteration's entry says so
    reuse = not is_connect(df.sparkSession)
    while True:
        # asked anew each time: a DataFrame's plan is fixed when first used. The view
        # also saves the Spark job over the cached data from planning its source again
        source, data = read_columns(df, plan.input_columns)
        run_plan = (
            with_array_cache(df, plan, parallelism, kwargs.get("hooks"), source) if reuse else plan
        )
        init, body = build(run_plan)
        stored = run_plan.stored
        try:
            result = relaunch_if_worker_died(
                owner,
                functools.partial(
                    run_iteration,
                    df,
                    run_plan,
                    init,
                    body,
                    # the subtasks the cache was planned for, whatever the slots are now
                    parallelism=stored.num_partitions if stored is not None else parallelism,
                    data=data,
                    **kwargs,
                ),
            )
        except IterationFailedError as ex:
            lost = _stored_arrays_lost(ex) if stored is not None else None
            if stored is None or lost is None:
                raise
            forget(stored)
            warnings.warn(
                f"{owner}: arrays the array cache kept from an earlier fit are gone "
                f"({lost}); reading the DataFrame from Spark",
                UserWarning,
                stacklevel=5,
            )
            reuse = False
            continue
        if stored is not None and not stored.read and result.repartitioned:
            forget(stored)  # subtask p did not read cached partition p: keep nothing
        if stored is not None and stored.read:  # the rows read, not the stand-in's
            return replace(result, rows=list(stored.rows)), "array cache"
        return result, "spark"
