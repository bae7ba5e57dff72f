"""The argument checks both entry points make before any job starts: not inside an
operator (no nested iterations), a real ``IterationBody``, a non-empty
``ReplayableDataStreamList`` (not a bare DataFrame) of DataFrames whose SparkSession is
not stopped (``refuse_stopped_session``, which ``hybrid_iter.ml`` and ``ps.train`` call
on their DataFrames too), and initial variables that are numeric and finite. Once its checks pass, ``check_entry`` also tells the session's
background warm-up that Spark tasks of a run are coming (``Session._runs_coming``). It is
the shared part; the bounded entry
(``iterate._validate``) adds its own checks after it, ``check_online_entry`` adds the
online ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator import normalize_variables
from coordinator._finite import check_finite_variables

from .._body import IterationBody
from .._errors import IterationConfigError, SessionStoppedError
from .._streams import DataStream, ReplayableDataStreamList, _is_dataframe

__all__ = [
    "check_entry",
    "check_online_entry",
    "refuse_nested",
    "refuse_stopped_session",
    "runs_coming",
]


def refuse_nested() -> None:
    """A nested iteration started from inside an operator cannot run: say why."""
    from pyspark import TaskContext

    where = None
    if TaskContext.get() is not None:
        where = "a Spark task (a partition operator)"
    else:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            where = "a Ray actor (the coordinator operator)"
    if where is not None:
        raise IterationConfigError(
            f"nested iterations are not supported: an iteration was started inside {where}. "
            f"Operators run in Spark tasks and in the coordinator actor, which cannot launch "
            f"Spark jobs, and a running iteration's barrier stage holds every task slot. Run "
            f"the outer loop on the driver: one iteration per outer round over persisted "
            f"data (docs/semantics.md, 'Nested iterations')"
        )


def check_entry(
    init_variables: Any, data_streams: Any, body: Any, *, streaming: bool = False
) -> tuple[dict[str, Any], ReplayableDataStreamList]:
    """The checks every entry point makes, in this order; the normalized variables and
    the streams. ``streaming``: the online entry (its messages name streaming
    DataFrames)."""
    refuse_nested()
    if not isinstance(body, IterationBody):
        raise IterationConfigError(
            f"body must be a hybrid_iter.IterationBody(partition=..., coordinator=...), "
            f"got {type(body).__name__}"
        )
    df = "stream_df" if streaming else "df"
    if _is_dataframe(data_streams):
        raise IterationConfigError(
            f"data_streams must be a ReplayableDataStreamList; wrap the "
            f"{'streaming ' if streaming else ''}DataFrame: "
            f"hi.ReplayableDataStreamList.not_replay({df})"
        )
    if not isinstance(data_streams, ReplayableDataStreamList):
        raise IterationConfigError(
            f"data_streams must be a hybrid_iter.ReplayableDataStreamList, got "
            f"{type(data_streams).__name__}"
        )
    if len(data_streams) == 0:
        raise IterationConfigError(
            f"data_streams is empty; pass at least one "
            f"{'streaming ' if streaming else ''}DataFrame: "
            f"ReplayableDataStreamList.not_replay({df})"
        )
    for i, frame in enumerate(data_streams.dataframes):
        refuse_stopped_session(frame, f"data stream {i}")
    variables = check_init_variables(init_variables)
    runs_coming(data_streams.dataframes[0].sparkSession)
    return variables, data_streams


def refuse_stopped_session(df: Any, what: str) -> None:
    """``SessionStoppedError`` when DataFrame ``df`` (``what`` names it) belongs to a
    SparkSession that was stopped: no job can read it, and PySpark would fail deep in
    its own code (``'NoneType' object has no attribute 'sc'``)."""
    from spark_ops._spark_compat import session_stopped

    if session_stopped(df.sparkSession):
        raise SessionStoppedError(
            f"{what} is a DataFrame of a SparkSession that was stopped (its "
            f"hybrid_iter.Session was closed, or spark.stop() was called), so no Spark job "
            f"can read it: start a new session (hybrid_iter.Session.local(), or a new "
            f"SparkSession) and read the data again with it; a DataFrame cannot move to "
            f"another session"
        )


def runs_coming(spark: Any = None) -> None:
    """Tell the cluster a run is starting (``ClusterContext.run_coming``: the session's
    background warm-up waits for it): an entry point calls it once its arguments are
    checked, before it starts actors of its own, so that the warm-up does not start
    beside them."""
    from .._cluster.context import announce_run

    announce_run(spark)


def check_init_variables(init_variables: Any) -> dict[str, Any]:
    """``init_variables`` as the coordinator keeps them: numeric, by name, finite."""
    try:
        variables = normalize_variables(init_variables, what="init_variables")
    except TypeError as ex:
        raise IterationConfigError(str(ex)) from ex
    check_finite_variables(variables)
    return variables


def check_online_entry(
    init_variables: Mapping[str, Any], data_streams: Any, body: Any
) -> tuple[dict[str, Any], DataStream]:
    """``iterate_unbounded_streams``'s arguments: the shared checks, then what an
    unbounded iteration refuses; the normalized variables and the one stream."""
    variables, streams = check_entry(init_variables, data_streams, body, streaming=True)
    if body.has_criteria:
        raise IterationConfigError(
            "an unbounded iteration has no termination criteria (it runs until stopped); "
            "remove IterationBody(criteria=...)"
        )
    if body.per_round_partition is not None:
        raise IterationConfigError(
            "for_each_round does not apply online: every partition operator already lives for "
            "one micro-batch"
        )
    if getattr(body, "feedback_combine", None) is not None:
        raise IterationConfigError(
            "IterationBody(feedback_combine=...) is for bounded sync iterations; an online "
            "iteration applies each batch's feedback as it arrives: remove feedback_combine"
        )
    if streams.any_replayed:
        raise IterationConfigError(
            "an unbounded stream cannot be replayed (every record is seen once); use not_replay"
        )
    if len(streams) != 1:
        raise IterationConfigError(
            f"an online iteration takes one streaming DataFrame, got {len(streams)}; "
            f"union them first (same schema) or add a stream column"
        )
    stream = streams.streams[0]
    if not stream.df.isStreaming:
        raise IterationConfigError(
            "iterate_unbounded_streams needs a streaming DataFrame (spark.readStream...); for "
            "bounded data use iterate_bounded_streams_until_termination"
        )
    stream.validate(0, streaming=True)
    return variables, stream
