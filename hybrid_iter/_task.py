"""The task-side runtime: joins a Spark task (one subtask) to the coordinator actor.

Runs inside a Spark Python worker. Reads the subtask's data once, then loops epochs with
one actor call per epoch (``report``), which in sync mode returns at the global
alignment with the next variables version.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from coordinator import Emissions, RemoteFailure, VariablesPayload

from ._errors import DataValidationError

__all__ = ["PartitionCollector", "PartitionContext", "TaskPlan", "run_subtask"]


@dataclass(frozen=True)
class TaskPlan:
    """Plain data every task of the barrier stage receives."""

    ray_address: str
    namespace: str
    actor_name: str
    operator: bytes
    num_subtasks: int
    numeric_columns: tuple[tuple[str, ...] | None, ...]
    staleness: int | None
    has_criteria: bool


class PartitionContext:
    """What a partition operator can see. Runs in a Spark task.

    ``epoch`` is the subtask's current epoch; ``global_epoch_watermark`` the newest
    global alignment it has heard of (in sync mode equal to ``epoch`` inside
    ``on_epoch_watermark_incremented``).
    """

    def __init__(self, partition_id: int, num_partitions: int, staleness: int | None) -> None:
        self.partition_id = partition_id
        self.num_partitions = num_partitions
        self.staleness = staleness
        self.epoch = 0
        self.global_epoch_watermark = -1
        self.variables_version = -1

    @property
    def is_sync(self) -> bool:
        return self.staleness == 0


class PartitionCollector:
    """``out`` of partition-operator callbacks. Runs in a Spark task."""

    def __init__(self, has_criteria: bool) -> None:
        self._has_criteria = has_criteria
        self._em = Emissions()

    def feedback(self, value: Any) -> None:
        """Send ``value`` to the coordinator tier's ``process_feedback``."""
        self._em.feedback.append(value)

    def output(self, tag: str, value: Any) -> None:
        """Emit a record to the iteration's outputs under ``tag``."""
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"output tag must be a non-empty string, got {tag!r}")
        self._em.outputs.append((tag, value))

    def criteria(self, value: Any = 1) -> None:
        """Emit a termination-criteria record: the iteration continues this epoch."""
        if not self._has_criteria:
            raise RuntimeError(
                "out.criteria() was called but the IterationBody has no criteria stream; "
                "pass IterationBody(..., criteria=True)"
            )
        self._em.criteria += 1

    def drain(self) -> Emissions:
        em, self._em = self._em, Emissions()
        return em


class _Aborted(Exception):
    """The coordinator answered with another participant's failure."""


_handles: dict[tuple[str, str], Any] = {}


def _coordinator(plan: TaskPlan) -> Any:
    from ._ray_util import connect

    connect(plan.ray_address, namespace=plan.namespace)
    key = (plan.ray_address, plan.actor_name)
    handle = _handles.get(key)
    if handle is None:
        import ray

        _handles.clear()  # one live iteration per worker at a time; drop stale handles
        handle = _handles[key] = ray.get_actor(plan.actor_name, namespace=plan.namespace)
    return handle


def _resolve(payload: VariablesPayload) -> dict[str, np.ndarray]:
    if payload.ref is not None:
        import ray

        return dict(ray.get(payload.ref))  # zero-copy, read-only views of the object store
    values = dict(payload.inline or {})
    for v in values.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    return values


def _check_batch(plan: TaskPlan, stream: int, batch: pa.RecordBatch, pid: int) -> None:
    cols = plan.numeric_columns[stream]
    if not cols:
        return
    for name in cols:
        idx = batch.schema.get_field_index(name)
        if idx < 0:
            raise DataValidationError(
                f"data stream {stream}: column {name!r} is missing in partition {pid}"
            )
        nulls = batch.column(idx).null_count
        if nulls:
            raise DataValidationError(
                f"data stream {stream}: numeric column {name!r} has {nulls} null value(s) "
                f"in partition {pid}; drop or fill them first (df.na.drop(subset=[{name!r}]))"
            )


def run_subtask(plan: TaskPlan, pid: int, inputs: Iterator[tuple[int, pa.RecordBatch]]) -> bytes:
    """Run one subtask to the end; returns a pickled summary for the driver."""
    import cloudpickle
    import ray

    ctx = PartitionContext(pid, plan.num_subtasks, plan.staleness)
    out = PartitionCollector(plan.has_criteria)
    coord: Any = None
    op: Any = None
    # what runs now: a user method (named after the operator) or a framework step
    where, user = "joining the Ray cluster and the coordinator", False
    rows = [0] * len(plan.numeric_columns)
    k = 0
    aborted = False

    def ask(call: Any) -> Any:
        nonlocal where, user
        where, user = "waiting for the coordinator", False
        return ray.get(call)

    try:
        coord = _coordinator(plan)
        where = "loading the partition operator"
        op = cloudpickle.loads(plan.operator)
        where, user = "open", True
        op.open(ctx)
        payload = ask(coord.variables.remote(-1))
        ctx.variables_version = payload.version
        where, user = "process_variables", True
        op.process_variables(_resolve(payload), ctx, out)
        where, user = "reading the data", False
        for stream, batch in inputs:
            _check_batch(plan, stream, batch, pid)
            rows[stream] += batch.num_rows
            where, user = "process_data", True
            op.process_data(stream, batch, ctx, out)
            where, user = "reading the data", False
        while True:
            em = out.drain()
            reply = ask(
                coord.report.remote(pid, k, ctx.variables_version, em, rows if k == 0 else None)
            )
            if reply.error is not None:
                raise _Aborted(f"subtask {pid} stopped because {reply.error}")
            ctx.global_epoch_watermark = reply.aligned
            if reply.variables is not None:
                ctx.variables_version = reply.variables.version
                where, user = "process_variables", True
                op.process_variables(_resolve(reply.variables), ctx, out)
            if reply.terminated:
                break
            ctx.epoch = k
            where, user = "on_epoch_watermark_incremented", True
            op.on_epoch_watermark_incremented(k, ctx, out)
            k += 1
        where, user = "on_iteration_terminated", True
        op.on_iteration_terminated(ctx, out)
        ask(coord.finish.remote(pid, out.drain()))
    except _Aborted:
        # Another participant failed and the coordinator holds its error for the driver;
        # this subtask ends quietly instead of adding a second, misleading traceback.
        aborted = True
    except Exception as ex:
        label = f"{type(op).__name__}.{where}" if user else where
        failure = RemoteFailure.capture(ex, source=pid, epoch=ctx.epoch, where=label)
        if coord is not None:
            try:
                ray.get(coord.fail.remote(failure), timeout=30)
            except Exception:
                pass  # the coordinator is gone; Spark's own failure still reaches the driver
        raise
    finally:
        if op is not None and hasattr(op, "close"):
            try:
                op.close()
            except Exception:
                pass  # close() must not hide the iteration's own outcome
    return pickle.dumps({"partition_id": pid, "epochs": k, "rows": rows, "aborted": aborted})
