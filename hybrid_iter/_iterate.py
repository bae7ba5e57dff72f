"""``iterate_bounded_streams_until_termination``: validation, launch, progress, result.

Runs on the driver. Everything that can be checked without a Spark job is checked
first; then the coordinator actor is started and one barrier stage runs all subtasks.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from coordinator import CoordinatorSpec, IterationCoordinator, RemoteFailure, normalize_variables
from spark_ops import BarrierStage, available_task_slots, num_partitions

from ._body import IterationBody
from ._config import IterationConfig, OperatorLifecycle
from ._errors import (
    DataValidationError,
    HybridIterError,
    IterationConfigError,
    IterationFailedError,
    SessionError,
)
from ._progress import ProgressPrinter
from ._ray_util import NAMESPACE
from ._result import IterationResult
from ._session import Session
from ._shipping import dumps
from ._streams import ReplayableDataStreamList, _is_dataframe
from ._task import TaskPlan, run_subtask

__all__ = ["iterate_bounded_streams_until_termination"]

log = logging.getLogger("hybrid_iter")


def _ray_address(spark: Any) -> str:
    session = Session.current()
    if session is not None and session.spark is spark:
        return session.ray_address
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    raise SessionError(
        "no Ray instance: run inside `with hybrid_iter.Session.local():` (or Session.raydp / "
        "Session.attach), or call ray.init() before iterating"
    )


def _validate(
    init_variables: Any, data_streams: Any, config: Any, body: Any
) -> tuple[dict[str, Any], ReplayableDataStreamList]:
    if not isinstance(config, IterationConfig):
        raise IterationConfigError(
            f"config must be a hybrid_iter.IterationConfig, got {type(config).__name__}"
        )
    if not isinstance(body, IterationBody):
        raise IterationConfigError(
            f"body must be a hybrid_iter.IterationBody(partition=..., coordinator=...), "
            f"got {type(body).__name__}"
        )
    if _is_dataframe(data_streams):
        raise IterationConfigError(
            "data_streams must be a ReplayableDataStreamList; wrap the DataFrame: "
            "hi.ReplayableDataStreamList.not_replay(df)"
        )
    if not isinstance(data_streams, ReplayableDataStreamList):
        raise IterationConfigError(
            f"data_streams must be a hybrid_iter.ReplayableDataStreamList, got "
            f"{type(data_streams).__name__}"
        )
    if len(data_streams) == 0:
        raise IterationConfigError(
            "data_streams is empty; pass at least one DataFrame: "
            "ReplayableDataStreamList.not_replay(df)"
        )
    try:
        variables = normalize_variables(init_variables, what="init_variables")
    except TypeError as ex:
        raise IterationConfigError(str(ex)) from ex
    for i, stream in enumerate(data_streams.streams):
        stream.validate(i)
        if num_partitions(stream.df) == 0:
            raise DataValidationError(
                f"data stream {i} has no partitions, so no rows; an iteration needs data"
            )
    if config.operator_lifecycle is OperatorLifecycle.PER_ROUND:
        not_replayed = [i for i, r in enumerate(data_streams.replayed) if not r]
        if not_replayed:
            raise IterationConfigError(
                f"operator_lifecycle=PER_ROUND creates a new operator every epoch, so it "
                f"needs every data stream replayed, but data stream(s) {not_replayed} are "
                f"not replayed; use OperatorLifecycle.ALL_ROUND to read them once"
            )
    sessions = {id(df.sparkSession) for df in data_streams.dataframes}
    if len(sessions) != 1:
        raise IterationConfigError("all data streams must come from the same SparkSession")
    return variables, data_streams


def _raise_failures(failures: list[RemoteFailure], spark_error: BaseException | None) -> None:
    primary = failures[0]
    if primary.source == "data" or isinstance(primary.cause, DataValidationError):
        raise DataValidationError(f"{primary}") from primary
    if isinstance(primary.cause, HybridIterError) and not isinstance(
        primary.cause, IterationFailedError
    ):
        raise type(primary.cause)(str(primary)) from primary
    by_source: dict[int | str, BaseException] = {}
    for f in failures:
        by_source.setdefault(f.source, f)
    raise IterationFailedError(f"the iteration failed: {primary}", by_source) from (
        spark_error or primary
    )


def iterate_bounded_streams_until_termination(
    init_variables: Mapping[str, Any],
    data_streams: ReplayableDataStreamList,
    config: IterationConfig,
    body: IterationBody,
) -> IterationResult:
    """Run ``body`` over bounded DataFrames until it terminates; see DESIGN.md section 3.

    ``init_variables`` are the variables at epoch 0 (numpy arrays or numbers, by name);
    the coordinator tier publishes new versions with ``out.publish_variables``.
    """
    started = time.perf_counter()
    started_wall = time.time()
    variables, streams = _validate(init_variables, data_streams, config, body)
    spark = streams.dataframes[0].sparkSession
    slots = available_task_slots(spark)
    if slots < 1:
        raise IterationConfigError(
            "Spark has no task slots (no executor is registered); start executors or use "
            "Session.local()"
        )
    n = config.parallelism or slots
    if n > slots:
        raise IterationConfigError(
            f"IterationConfig(parallelism={n}) needs {n} Spark task slots at once (one "
            f"barrier stage), but only {slots} exist; lower parallelism to <= {slots}, or "
            f"give Spark more cores (local[{n}], or more executors/cores)"
        )
    op_bytes = dumps(body.partition, f"the partition operator {type(body.partition).__name__}")
    coord_bytes = dumps(
        (body.coordinator, list(body.coordinator_listeners)),
        f"the coordinator operator {type(body.coordinator).__name__} or a listener",
    )
    address = _ray_address(spark)

    import ray

    from ._ray_util import connect

    connect(address, namespace=NAMESPACE)
    name = f"hybrid_iter.{config.name or 'iteration'}.{uuid.uuid4().hex[:12]}"
    spec = CoordinatorSpec(
        num_subtasks=n,
        num_streams=len(streams),
        staleness=config.staleness,
        max_epochs=config.max_epochs,
        has_criteria=body.has_criteria,
        init_variables=variables,
        operators=coord_bytes,
        inline_limit=config.inline_variables_bytes,
        progress_tag=config.progress_tag,
    )
    # Every subtask waits in one call at a time, plus the driver's progress poll: an
    # async actor answering more calls than max_concurrency at once would deadlock.
    actor_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=max(1000, n + 16))(
        IterationCoordinator
    )
    actor = actor_cls.options(name=name, namespace=NAMESPACE).remote(spec)
    plan = TaskPlan(
        ray_address=address,
        namespace=NAMESPACE,
        actor_name=name,
        operator=op_bytes,
        num_subtasks=n,
        numeric_columns=tuple(s.numeric_columns for s in streams.streams),
        staleness=config.staleness,
        has_criteria=body.has_criteria,
    )
    stage = BarrierStage(streams.dataframes, n, functools.partial(run_subtask, plan))
    outcome: dict[str, Any] = {}
    sc = spark.sparkContext

    def run_stage() -> None:
        try:
            sc.setJobGroup(name, f"hybrid_iter {config.mode} iteration", interruptOnCancel=True)
            outcome["results"] = stage.run()
        except BaseException as ex:  # surfaced on the driver thread below
            outcome["error"] = ex

    printer = ProgressPrinter(config.progress, label=config.name or config.mode)
    thread = threading.Thread(target=run_stage, name=f"{name}-stage", daemon=True)
    try:
        if not ray.get(actor.progress.remote()).failed:  # the coordinator operator is open
            thread.start()
        seen = -1
        while thread.is_alive():
            p = ray.get(actor.wait_progress.remote(seen, 0.5))
            printer.update(p)
            seen = p.aligned
            if p.failed:
                sc.cancelJobGroup(name)  # tasks stuck in user code must not hang us
            if p.done:
                thread.join()
        if thread.ident is not None:
            thread.join()
        data = ray.get(actor.result.remote())
        printer.update(ray.get(actor.progress.remote()), final=True)
    except BaseException:
        if thread.is_alive():
            sc.cancelJobGroup(name)
            thread.join(timeout=30)
        raise
    finally:
        try:
            ray.kill(actor)
        except Exception as ex:  # never hide the error being raised
            log.warning("could not kill the coordinator actor %s: %s", name, ex)
    if data.failures:
        _raise_failures(data.failures, outcome.get("error"))
    if "error" in outcome:
        raise IterationFailedError(
            f"the Spark stage of the iteration failed: {outcome['error']}", {}
        ) from outcome["error"]
    ran = len(outcome.get("results", []))
    if ran == 0 and data.terminated_by is None:
        # Spark planned no task at all: its optimizer found every input empty
        raise DataValidationError(
            "the data streams have no rows (Spark ran no task over them); an iteration "
            "needs data: check the DataFrames' filters or sources"
        )
    if ran != n or data.terminated_by is None:
        raise IterationFailedError(
            f"the iteration's Spark stage ended with {ran} of {n} subtasks and the "
            f"coordinator {'terminated' if data.terminated_by else 'not terminated'}",
            {},
        )
    times = data.alignment_times
    return IterationResult(
        variables=data.variables,
        outputs=_group_outputs(data.outputs),
        output_records=data.outputs,
        epochs=data.epochs,
        terminated_by=data.terminated_by or "unknown",
        epoch_seconds=[b - a for a, b in itertools.pairwise(times)],
        subtask_epochs=data.subtask_epochs,
        feedback_counts=data.feedback_counts,
        rows=data.rows,
        num_partitions=n,
        mode=config.mode,
        seconds=time.perf_counter() - started,
        load_seconds=(times[0] - started_wall) if times else 0.0,
        extra={
            "repartitioned": stage.repartitioned,
            "publishes": data.publishes,
            "object_store_puts": data.object_store_puts,
        },
    )


def _group_outputs(records: list[Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for r in records:
        grouped.setdefault(r.tag, []).append(r.value)
    return grouped
