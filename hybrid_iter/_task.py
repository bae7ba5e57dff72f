"""The task-side runtime: joins a Spark task (one subtask) to the coordinator actor.

Runs inside a Spark Python worker. Two ways to run a subtask, one code path:

* ``run_subtask``: the whole iteration in one barrier task (no stream replayed): read
  the data once, then one actor call (``report``) per epoch, which in sync mode returns
  at the global alignment with the next variables version.
* ``run_round``: one round of an iteration with replayed streams (one barrier job per
  round). The all-round operator's state travels to the next round's task through the
  coordinator (``stash``/``unstash``): its ``snapshot_state``/``restore_state`` when it
  defines them, else the pickled operator.
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

__all__ = ["PartitionCollector", "PartitionContext", "TaskPlan", "run_round", "run_subtask"]


@dataclass(frozen=True)
class TaskPlan:
    """Plain data every task of the barrier stage receives."""

    ray_address: str
    namespace: str
    actor_name: str
    #: the body's partition operator (cloudpickle)
    operator: bytes
    num_subtasks: int
    numeric_columns: tuple[tuple[str, ...] | None, ...]
    staleness: int | None
    has_criteria: bool
    #: which data streams are replayed every round
    replayed: tuple[bool, ...] = ()
    #: the partition operator is created afresh every round (PER_ROUND lifecycle)
    main_per_round: bool = False
    #: the for_each_round sub-body's partition operator (cloudpickle), if any
    per_round_operator: bytes | None = None
    #: which launch of the stage this is (0 first; retries after failures count up)
    attempt: int = 0
    #: subtasks restore their checkpointed state from the coordinator
    restore: bool = False
    #: fault injection for tests: ``(partition, epoch, attempt)`` raises before that
    #: partition's watermark callback of that epoch, on that attempt
    fail_at: tuple[int, int, int] | None = None


class PartitionContext:
    """What a partition operator can see. Runs in a Spark task.

    ``epoch`` is the subtask's current epoch; ``global_epoch_watermark`` the newest
    global alignment it has heard of (in sync mode equal to ``epoch`` inside
    ``on_epoch_watermark_incremented``); ``terminating`` is True only in the terminating
    round's per-round operators (variables, no data; docs/semantics.md).
    """

    def __init__(self, partition_id: int, num_partitions: int, staleness: int | None) -> None:
        self.partition_id = partition_id
        self.num_partitions = num_partitions
        self.staleness = staleness
        self.epoch = 0
        self.global_epoch_watermark = -1
        self.variables_version = -1
        #: True while the terminating round's per-round operators run (their round has
        #: the variables fed back into it but no data: replay stopped at termination)
        self.terminating = False

    @property
    def is_sync(self) -> bool:
        return self.staleness == 0


class PartitionCollector:
    """``out`` of partition-operator callbacks. Runs in a Spark task."""

    def __init__(self, has_criteria: bool, *, per_round: bool = False) -> None:
        self._has_criteria = has_criteria
        self._per_round = per_round
        self._em = Emissions()

    def _bind(self, em: Emissions) -> None:
        self._em = em

    def feedback(self, value: Any) -> None:
        """Send ``value`` to the coordinator tier's ``process_feedback``."""
        (self._em.round_feedback if self._per_round else self._em.feedback).append(value)

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


class InjectedFault(RuntimeError):
    """Raised by the fault-injection hook (``IterationConfig(faults=...)``), for tests."""


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


class _Subtask:
    """One subtask's operators, context and protocol state."""

    def __init__(self, plan: TaskPlan, pid: int, coord: Any) -> None:
        self.plan = plan
        self.pid = pid
        self.coord = coord
        self.ctx = PartitionContext(pid, plan.num_subtasks, plan.staleness)
        self.em = Emissions()
        self.out = PartitionCollector(plan.has_criteria)
        self.round_out = PartitionCollector(plan.has_criteria, per_round=True)
        self.all_round: Any = None  # the long-lived partition operator, if any
        self.per_round: list[tuple[Any, PartitionCollector]] = []
        self.variables: dict[str, Any] = {}
        self.rows = [0] * len(plan.numeric_columns)
        self.k = 0  # the next call to make
        self.last: Any = None  # the last reply
        self.where, self.user, self.op_name = "joining the Ray cluster", False, ""
        self._bind()

    # -- bookkeeping ------------------------------------------------------------------

    def _bind(self) -> None:
        self.out._bind(self.em)
        self.round_out._bind(self.em)

    def _drain(self) -> Emissions:
        em, self.em = self.em, Emissions()
        self._bind()
        return em

    def call(self, op: Any, method: str, *args: Any) -> Any:
        self.where, self.user, self.op_name = method, True, type(op).__name__
        return getattr(op, method)(*args)

    def step(self, what: str) -> None:
        self.where, self.user = what, False

    def ask(self, remote: Any) -> Any:
        import ray

        self.step("waiting for the coordinator")
        return ray.get(remote)

    def label(self) -> str:
        return f"{self.op_name}.{self.where}" if self.user else self.where

    def _load(self, blob: bytes) -> Any:
        import cloudpickle

        self.step("loading the partition operator")
        return cloudpickle.loads(blob)

    def _fetch_variables(self) -> None:
        payload = self.ask(self.coord.variables.remote(-1))
        self.variables = _resolve(payload)
        self.ctx.variables_version = payload.version

    def _new_round_ops(self) -> None:
        """Fresh per-round operators for the current epoch, opened with its variables."""
        blobs = []
        if self.plan.main_per_round:
            blobs.append((self.plan.operator, self.out))
        if self.plan.per_round_operator is not None:
            blobs.append((self.plan.per_round_operator, self.round_out))
        self.per_round = []
        for blob, out in blobs:
            op = self._load(blob)
            self.per_round.append((op, out))
            self.call(op, "open", self.ctx)
            self.call(op, "process_variables", self.variables, self.ctx, out)

    def _consume(self, inputs: Iterator[tuple[int, pa.RecordBatch]]) -> None:
        self.step("reading the data")
        for stream, batch in inputs:
            _check_batch(self.plan, stream, batch, self.pid)
            self.rows[stream] += batch.num_rows
            if self.all_round is not None:
                self.call(self.all_round, "process_data", stream, batch, self.ctx, self.out)
            if self.plan.replayed and self.plan.replayed[stream]:
                for op, out in self.per_round:
                    self.call(op, "process_data", stream, batch, self.ctx, out)
            self.step("reading the data")

    def _report(self) -> bool:
        """Make call ``k``; handle the reply. True when the iteration terminated."""
        rows = self.rows if self.k == 0 else None
        reply = self.ask(
            self.coord.report.remote(
                self.pid, self.k, self.ctx.variables_version, self._drain(), rows, self.plan.attempt
            )
        )
        while reply.error is None and reply.need_state:  # a checkpoint: give our state, wait
            state = self.checkpoint_state()
            reply = self.ask(
                self.coord.checkpoint_state.remote(
                    self.pid, self.k, self.ctx.variables_version, state, self.plan.attempt
                )
            )
        if reply.error is not None:
            raise _Aborted(f"subtask {self.pid} stopped because {reply.error}")
        self.k += 1
        self.last = reply
        self.ctx.global_epoch_watermark = reply.aligned
        if reply.variables is not None:
            self.step("reading the variables")
            self.variables = _resolve(reply.variables)
            self.ctx.variables_version = reply.variables.version
            if self.all_round is not None:
                # the variables belong to the epoch this reply grants (or the terminating
                # round), not to the epoch the subtask just finished
                last, self.ctx.epoch = self.ctx.epoch, reply.epoch
                self.call(self.all_round, "process_variables", self.variables, self.ctx, self.out)
                if reply.terminated:
                    self.ctx.epoch = last
        return bool(reply.terminated)

    # -- the protocol -----------------------------------------------------------------

    def start(self, inputs: Iterator[tuple[int, pa.RecordBatch]]) -> bool:
        """Epoch-0 input (initial variables, every stream's data), then call 0.

        After a failure (``plan.restore``) the subtask reloads its data, restores the
        state it checkpointed and makes again the call it was held in."""
        restored = self.ask(self.coord.restored.remote(self.pid)) if self.plan.restore else None
        self._fetch_variables()
        if not self.plan.main_per_round:
            self.all_round = self._load(self.plan.operator)
            self.call(self.all_round, "open", self.ctx)
            self.call(self.all_round, "process_variables", self.variables, self.ctx, self.out)
        self._new_round_ops()
        self._consume(inputs)
        if restored is not None:
            call, state = restored
            self._drain()  # records of reloading were applied before the checkpoint
            if state is not None and self.all_round is not None:
                import cloudpickle

                self.call(self.all_round, "restore_state", cloudpickle.loads(state))
            self.k = call
            self.ctx.epoch = call - 1
        return self._report()

    def checkpoint_state(self) -> bytes | None:
        """The all-round operator's ``snapshot_state()`` (None when it keeps no state
        beyond its data and the variables, which a restore rebuilds)."""
        op = self.all_round
        if op is None or not _defines(op, "snapshot_state"):
            return None
        import cloudpickle

        return cloudpickle.dumps(self.call(op, "snapshot_state"))

    def epoch(self, inputs: Iterator[tuple[int, pa.RecordBatch]] | None = None) -> bool:
        """Run epoch ``k - 1`` (granted by the last reply): its per-round operators and
        replayed data, every watermark callback, then call ``k``."""
        e = self.k - 1
        self.ctx.epoch = e
        if e > 0 and (self.plan.main_per_round or self.plan.per_round_operator is not None):
            self._new_round_ops()
        if inputs is not None:
            self._consume(inputs)
        fault = self.plan.fail_at
        if fault is not None and fault == (self.pid, e, self.plan.attempt):
            self.step(f"injected fault before epoch {e}")
            raise InjectedFault(
                f"injected fault: partition {self.pid} at epoch {e} on attempt {self.plan.attempt}"
            )
        if self.all_round is not None:
            self.call(self.all_round, "on_epoch_watermark_incremented", e, self.ctx, self.out)
        for op, out in self.per_round:
            self.call(op, "on_epoch_watermark_incremented", e, self.ctx, out)
        self._close_round_ops()
        return self._report()

    def terminate(self) -> None:
        """Termination. First the terminating round (the round the last published
        variables were fed into) runs its per-round operators as every round does: open,
        ``process_variables``, the end-of-round ``on_epoch_watermark_incremented``, close
        (no replayed data: replay stops at termination, as in Flink ML). Then only
        operators still alive (the all-round one) hear ``on_iteration_terminated``."""
        k = self.last.terminating_round if self.last is not None else None
        round_em = None
        if k is not None and (self.plan.main_per_round or self.plan.per_round_operator):
            last, self.ctx.epoch, self.ctx.terminating = self.ctx.epoch, k, True
            self._new_round_ops()
            for op, out in self.per_round:
                self.call(op, "on_epoch_watermark_incremented", k, self.ctx, out)
            self._close_round_ops()
            round_em = self._drain()
            self.ctx.epoch, self.ctx.terminating = last, False
        if self.all_round is not None:
            self.call(self.all_round, "on_iteration_terminated", self.ctx, self.out)
        self.ask(self.coord.finish.remote(self.pid, self._drain(), self.plan.attempt, round_em))

    def _close_round_ops(self) -> None:
        ops, self.per_round = self.per_round, []
        for op, _ in ops:
            self.call(op, "close")

    def close(self) -> None:
        """Best effort on the way out (also after a failure)."""
        for op in [self.all_round, *(op for op, _ in self.per_round)]:
            if op is not None:
                try:
                    op.close()
                except Exception:
                    pass  # close() must not hide the iteration's own outcome

    # -- state between round jobs -----------------------------------------------------

    def snapshot(self) -> bytes:
        import cloudpickle

        self.step("snapshotting the partition operator")
        op = self.all_round
        state: dict[str, Any] = {"k": self.k, "rows": self.rows, "last": self.last.aligned}
        if op is not None and _defines(op, "snapshot_state"):
            state["state"] = self.call(op, "snapshot_state")
        else:
            state["operator"] = op
        return cloudpickle.dumps(state)

    def restore(self, blob: bytes | None) -> None:
        import cloudpickle

        if blob is None:
            raise RuntimeError(f"subtask {self.pid}: no state was stashed by the previous round")
        state = cloudpickle.loads(blob)
        self.k, self.rows = state["k"], state["rows"]
        self.ctx.epoch = self.k - 1
        self.ctx.global_epoch_watermark = state["last"]
        self._fetch_variables()
        if "state" in state:
            self.all_round = self._load(self.plan.operator)
            self.call(self.all_round, "open", self.ctx)
            self.call(self.all_round, "restore_state", state["state"])
        else:
            self.all_round = state["operator"]


def _defines(op: Any, method: str) -> bool:
    """True when the operator's class overrides the base class's hook."""
    from ._operators import PartitionOperator

    return getattr(type(op), method, None) is not getattr(PartitionOperator, method)


def _guarded(plan: TaskPlan, pid: int, body: Any) -> bytes:
    """Run ``body(subtask)``; report a failure of this subtask to the coordinator."""
    import ray

    sub = _Subtask(plan, pid, None)
    aborted = False
    try:
        sub.coord = _coordinator(plan)
        body(sub)
    except _Aborted:
        # Another participant failed and the coordinator holds its error for the driver;
        # this subtask ends quietly instead of adding a second, misleading traceback.
        aborted = True
    except Exception as ex:
        failure = RemoteFailure.capture(ex, source=pid, epoch=sub.ctx.epoch, where=sub.label())
        if sub.coord is not None:
            try:
                ray.get(sub.coord.fail.remote(failure, plan.attempt), timeout=30)
            except Exception:
                pass  # the coordinator is gone; Spark's own failure still reaches the driver
        sub.close()
        raise
    if aborted:
        sub.close()
    summary = {"partition_id": pid, "epochs": sub.k - 1, "rows": sub.rows, "aborted": aborted}
    return pickle.dumps(summary)


def run_subtask(plan: TaskPlan, pid: int, inputs: Iterator[tuple[int, pa.RecordBatch]]) -> bytes:
    """The whole iteration in one task; returns a pickled summary for the driver."""

    def body(sub: _Subtask) -> None:
        terminated = sub.start(inputs)
        while not terminated:
            terminated = sub.epoch()
        sub.terminate()
        sub.close()

    return _guarded(plan, pid, body)


def run_round(
    plan: TaskPlan, round_: int, pid: int, inputs: Iterator[tuple[int, pa.RecordBatch]]
) -> bytes:
    """Round ``round_`` of an iteration with replayed streams (one barrier job per round)."""

    def body(sub: _Subtask) -> None:
        if round_ == 0:
            terminated = sub.start(inputs) or sub.epoch()
        else:
            sub.restore(sub.ask(sub.coord.unstash.remote(pid)))
            terminated = sub.epoch(inputs)
        if terminated:
            sub.terminate()
            sub.close()
        else:
            sub.ask(sub.coord.stash.remote(pid, sub.snapshot()))

    return _guarded(plan, pid, body)
