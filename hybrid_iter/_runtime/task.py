"""The task-side runtime: joins a Spark task (one subtask) to the coordinator.

Runs inside a Spark Python worker. The coordinator is reached through a
``coordinator.CoordinatorLink`` (Ray's; in tests the in-process coordinator's), so this
code does not know the transport. Two ways to run a subtask, one code path:

* ``run_subtask``: the whole iteration in one barrier task (no stream replayed): read
  the data once, then one actor call (``report``) per epoch, which in sync mode returns
  at the global alignment with the next variables version.
* ``run_round``: one round of an iteration with replayed streams (one barrier job per
  round). The all-round operator's state travels to the next round's task through the
  coordinator (``stash``/``unstash``): its ``snapshot_state``/``restore_state`` when it
  defines them, else the pickled operator.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from coordinator import (
    CallTimeout,
    CoordinatorLink,
    Emissions,
    Pending,
    RayLink,
    RemoteFailure,
    RuntimeHooks,
)
from coordinator._checkpoint import dump_operator, restore_operator
from coordinator._finite import all_finite, count_nonfinite
from coordinator._operator_api import PartitionCollector, PartitionContext
from coordinator._tree import TreeSpec, precombine

from .._errors import DataValidationError, UsageError, _Aborted

__all__ = ["TaskPlan", "run_round", "run_subtask"]


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
    #: the run (unique per iteration): what a Python worker keys its per-run caches by,
    #: since a coordinator actor (and so ``actor_name``) may serve several runs
    run: str = ""
    #: subtasks restore their checkpointed state from the coordinator
    restore: bool = False
    #: feedback_combine: merge feedback in a tree (``coordinator._tree``)
    tree: TreeSpec | None = None
    #: called at named points (``IterationConfig.hooks``); None: no hooks
    hooks: RuntimeHooks | None = None
    #: seconds a step of this subtask may make no progress (``IterationConfig``)
    call_timeout: float = 600.0
    #: a checkpoint every this many epochs (0: none); in sync mode without a feedback
    #: tree a subtask sends its state with the call a cut will hold (no second round trip)
    checkpoint_every: int = 0
    #: the iteration ends at alignment ``max_epochs`` (no cut there); None: no limit
    max_epochs: int | None = None
    #: the coordinator endpoint (``coordinator._endpoint.EndpointAddress``) the subtasks
    #: reach their coordinator through, without Ray; None: through Ray
    endpoint: Any = None


_links: dict[tuple[str, str], CoordinatorLink] = {}
#: feedback_combine: (run, attempt, partition) -> (group link or None, combiner)
_groups: dict[tuple[str, int, int], tuple[Any, Any]] = {}


def _coordinator(plan: Any) -> CoordinatorLink:
    """The link to the run's coordinator (cached per worker): its endpoint when the plan
    names one (no Ray in this process), else the Ray actor ``plan.actor_name``."""
    endpoint = getattr(plan, "endpoint", None)
    if endpoint is not None:
        key = (endpoint.location, endpoint.token)
        link = _links.get(key)
        if link is None:
            from coordinator._endpoint import FlightLink

            _drop_links()
            link = _links[key] = FlightLink(endpoint)
        return link
    return _ray_coordinator(plan)


def _drop_links() -> None:
    """One live iteration per worker at a time: drop stale links."""
    for old in _links.values():
        close = getattr(old, "close", None)
        if close is not None:
            close()
    _links.clear()


def _ray_coordinator(plan: Any) -> CoordinatorLink:
    from .._cluster.ray_util import connect

    connect(plan.ray_address, namespace=plan.namespace)
    key = (plan.ray_address, plan.actor_name)
    link = _links.get(key)
    if link is None:
        import ray

        _drop_links()
        handle = ray.get_actor(plan.actor_name, namespace=plan.namespace)
        link = _links[key] = RayLink(handle)
    return link


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
        column = batch.column(idx)
        nulls = column.null_count
        if nulls:
            raise DataValidationError(
                f"data stream {stream}: numeric column {name!r} has {nulls} null value(s) "
                f"in partition {pid}; drop or fill them first (df.na.drop(subset=[{name!r}]))"
            )
        if pa.types.is_floating(column.type):
            values = column.to_numpy(zero_copy_only=False)
            if not all_finite(values):
                raise DataValidationError(
                    f"data stream {stream}: numeric column {name!r} has "
                    f"{count_nonfinite(values)} NaN/inf value(s) in "
                    f"partition {pid}; drop them first (df.filter(~F.isnan({name!r}) & "
                    f"(F.abs({name!r}) < float('inf'))))"
                )


class _TaskSteps:
    """Where one Spark task of an iteration is, for its watchdog and its failure report.

    Shared by the bounded subtask (``_Subtask``) and the online micro-batch partition
    (``online.partition.run_partition``): every user callback goes through ``call`` and every
    step of our own through ``step``/``ask``, so ``label()`` names what the task is doing
    (``"Op.process_data"``, ``"reading the data"``) and ``since`` says since when. The
    watchdog thread (``_watch``) reads them; ``_guard`` reports a failure with them.
    ``note`` is appended to every label (online: ``" (micro-batch 3)"``); ``config``
    names the configuration holding ``call_timeout`` in the watchdog's message.
    """

    def __init__(
        self,
        pid: int,
        ctx: PartitionContext,
        coord: CoordinatorLink | None,
        *,
        call_timeout: float,
        attempt: int = 0,
        config: str = "IterationConfig",
        note: str = "",
    ) -> None:
        self.pid = pid
        self.ctx = ctx
        self.coord = coord
        self.call_timeout = float(call_timeout)
        self.attempt = attempt
        self.config = config
        self.note = note
        self.where, self.user, self.op_name = "joining the Ray cluster", False, ""
        self.since = time.monotonic()  # when the current step began (the watchdog reads it)

    def call(self, op: Any, method: str, *args: Any) -> Any:
        """Call user callback ``op.method(*args)``."""
        self.where, self.user, self.op_name = method, True, type(op).__name__
        self.since = time.monotonic()
        return getattr(op, method)(*args)

    def step(self, what: str) -> None:
        """A step of our own begins (the watchdog times it like a callback)."""
        self.where, self.user = what, False
        self.since = time.monotonic()

    def ask(self, answer: Pending[Any]) -> Any:
        """Wait for a coordinator call (not timed: the coordinator waits for others)."""
        self.step("waiting for the coordinator")
        return answer.result()

    def label(self) -> str:
        return (f"{self.op_name}.{self.where}" if self.user else self.where) + self.note


def _send_failure(task: _TaskSteps, failure: RemoteFailure) -> None:
    """Give ``failure`` to the coordinator, waiting a bounded time for it to take it."""
    if task.coord is None:
        return
    try:
        task.coord.fail(failure, task.attempt).result(timeout=30)
    except Exception:
        pass  # the coordinator is gone; Spark's own failure still reaches the driver


@contextmanager
def _guard(task: _TaskSteps, connect: Callable[[], CoordinatorLink]) -> Iterator[_TaskSteps]:
    """The body of a Spark task of an iteration, bounded and online alike: connect to
    the coordinator (``connect()`` when ``task.coord`` is None), watch the task's steps
    (``_watch``: a step without progress for ``call_timeout`` seconds fails the run),
    and when the body raises, report it to the coordinator as a ``RemoteFailure`` naming
    the partition, the epoch and ``task.label()`` (the callback that raised), then let
    the exception go on to Spark. ``_Aborted`` (another participant failed first) is
    not reported again."""
    stop = threading.Event()
    try:
        if task.coord is None:
            task.coord = connect()
        _watch(task, stop)
        yield task
    except _Aborted:
        raise
    except Exception as ex:
        _send_failure(
            task,
            RemoteFailure.capture(ex, source=task.pid, epoch=task.ctx.epoch, where=task.label()),
        )
        raise
    finally:
        stop.set()


class _Subtask(_TaskSteps):
    """One subtask's operators, context and protocol state."""

    coord: CoordinatorLink

    def __init__(self, plan: TaskPlan, pid: int, coord: CoordinatorLink | None) -> None:
        super().__init__(
            pid,
            PartitionContext(pid, plan.num_subtasks, plan.staleness),
            coord,
            call_timeout=plan.call_timeout,
            attempt=plan.attempt,
        )
        self.plan = plan
        self.em = Emissions()
        self.out = PartitionCollector(plan.has_criteria)
        self.round_out = PartitionCollector(plan.has_criteria, per_round=True)
        self.all_round: Any = None  # the long-lived partition operator, if any
        self.per_round: list[tuple[Any, PartitionCollector]] = []
        self.variables: dict[str, Any] = {}
        self.rows = [0] * len(plan.numeric_columns)
        self.k = 0  # the next call to make
        self.last: Any = None  # the last reply
        self._tree: tuple[Any, Any] | None = None  # (group actor or None, combiner)
        self._restored_call = -1  # the held call a restored subtask makes again
        self._bind()

    # -- bookkeeping ------------------------------------------------------------------

    def _bind(self) -> None:
        self.out._bind(self.em)
        self.round_out._bind(self.em)

    def _drain(self) -> Emissions:
        em, self.em = self.em, Emissions()
        self._bind()
        return em

    def _load(self, blob: bytes) -> Any:
        import cloudpickle

        self.step("loading the partition operator")
        return cloudpickle.loads(blob)

    def _fetch_variables(
        self, inputs: Iterator[tuple[int, pa.RecordBatch]] | None = None
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """The newest variables from the coordinator. With ``inputs``, data batches are
        read while the answer is on the way (at the start of a run the coordinator may
        still be loading): returns the inputs, the batches read meanwhile first. Only
        what arrives before the answer is held, and the operators still see the
        variables before any data."""
        answer = self.coord.variables(-1)
        rest = iter(inputs if inputs is not None else ())
        early: list[tuple[int, pa.RecordBatch]] = []
        if inputs is not None:
            self.step("reading the data")
            while not answer.ready():
                got = next(rest, None)
                if got is None:
                    break
                early.append(got)
        payload = self.ask(answer)
        self.variables = self.coord.resolve(payload)
        self.ctx.variables_version = payload.version
        return itertools.chain(early, rest)

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

    def _tree_target(self) -> tuple[Any, Any]:
        """feedback_combine: the group to report to (None: the coordinator) and the
        combiner, asked of the coordinator once per launch and worker process."""
        if self._tree is None:
            key = (self.plan.run, self.plan.attempt, self.pid)
            got = _groups.get(key)
            if got is None:
                assert self.plan.tree is not None
                self.step("loading the feedback combiner")
                combiner = self.plan.tree.load()
                if len(_groups) > 4096:
                    _groups.clear()  # stale launches; one entry per subtask run here
                got = _groups[key] = (self.ask(self.coord.group_of(self.pid)), combiner)
            self._tree = got
        return self._tree

    def _report(self) -> bool:
        """Make call ``k``; handle the reply. True when the iteration terminated."""
        rows = self.rows if self.k == 0 else None
        em, target = self._drain(), self.coord
        if self.plan.tree is not None:
            group, combiner = self._tree_target()
            self.step("combining the feedback (feedback_combine)")
            em = precombine(em, combiner)
            target = group if group is not None else self.coord
        offered = (self.checkpoint_state(),) if self._offers_state() else None
        reply = self.ask(
            target.report(
                self.pid, self.k, self.ctx.variables_version, em, rows, self.plan.attempt, offered
            )
        )
        while reply.error is None and reply.need_state:  # a checkpoint: give our state, wait
            state = self.checkpoint_state()
            reply = self.ask(
                self.coord.checkpoint_state(
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
            self.variables = self.coord.resolve(reply.variables)
            self.ctx.variables_version = reply.variables.version
            if self.all_round is not None:
                # the variables belong to the epoch this reply grants (or the terminating
                # round), not to the epoch the subtask just finished
                last, self.ctx.epoch = self.ctx.epoch, reply.epoch
                self.call(self.all_round, "process_variables", self.variables, self.ctx, self.out)
                if reply.terminated:
                    self.ctx.epoch = last
        return bool(reply.terminated)

    def _offers_state(self) -> bool:
        """Call ``k`` is one a checkpoint's cut will hold (the cut epochs are fixed in
        sync mode): its state goes with the call. Not a restored subtask's held call (it
        was cut already), not the last alignment (the iteration ends there) and not
        through a feedback group (which only forwards)."""
        every, k = self.plan.checkpoint_every, self.k
        return (
            every > 0
            and self.plan.staleness == 0
            and self.plan.tree is None
            and k >= 1
            and k % every == 0
            and k != self._restored_call
            and (self.plan.max_epochs is None or k < self.plan.max_epochs)
        )

    # -- the protocol -----------------------------------------------------------------

    def start(self, inputs: Iterator[tuple[int, pa.RecordBatch]]) -> bool:
        """Epoch-0 input (initial variables, every stream's data), then call 0.

        After a failure (``plan.restore``) the subtask reloads its data, restores the
        state it checkpointed (its ``snapshot_state``, or the pickled operator object
        itself, which already holds its data) and makes again the call it was held in,
        reporting the variables version it had processed at the cut: the coordinator
        then hands it the newer variables of that call again, *after* its state is
        restored, exactly as in the run without the fault."""
        restored = self.ask(self.coord.restored(self.pid)) if self.plan.restore else None
        kind, blob = (restored[2] or (None, None)) if restored is not None else (None, None)
        inputs = self._fetch_variables(inputs)
        if not self.plan.main_per_round and kind != "object":
            self.all_round = self._load(self.plan.operator)
            self.call(self.all_round, "open", self.ctx)
            self.call(self.all_round, "process_variables", self.variables, self.ctx, self.out)
        self._new_round_ops()
        self._consume(inputs)  # an adopted operator object holds its data already
        if restored is not None:
            call, known_version, _ = restored
            self._drain()  # records of reloading were applied before the checkpoint
            if kind == "object":
                assert blob is not None  # an "object" checkpoint holds the pickled operator
                self.all_round = self._load(blob)
            elif kind == "state" and self.all_round is not None:
                import cloudpickle

                self.step("loading the checkpointed state")
                self.call(self.all_round, "restore_state", cloudpickle.loads(blob))
            self.k = self._restored_call = call
            self.ctx.epoch = call - 1
            self.ctx.variables_version = known_version
        return self._report()

    def checkpoint_state(self) -> tuple[str, bytes] | None:
        """The all-round operator's state for a checkpoint (``dump_operator``'s form, as
        the coordinator tier's); None without an all-round operator."""
        op = self.all_round
        if op is None:
            return None
        self.step(f"pickling the partition operator {type(op).__name__} for a checkpoint")
        return dump_operator(op, self._owner(op), self.call)

    def _owner(self, op: Any) -> str:
        return f"the partition operator {type(op).__name__} (partition {self.pid})"

    def epoch(self, inputs: Iterator[tuple[int, pa.RecordBatch]] | None = None) -> bool:
        """Run epoch ``k - 1`` (granted by the last reply): its per-round operators and
        replayed data, every watermark callback, then call ``k``."""
        e = self.k - 1
        self.ctx.epoch = e
        if e > 0 and (self.plan.main_per_round or self.plan.per_round_operator is not None):
            self._new_round_ops()
        if inputs is not None:
            self._consume(inputs)
        if self.plan.hooks is not None:
            self.step(f"hooks before epoch {e}")
            self.plan.hooks.before_watermark(self.pid, e, self.plan.attempt)
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
        self.ask(self.coord.finish(self.pid, self._drain(), self.plan.attempt, round_em))

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
        """What the next round job of this subtask continues from (``stash``)."""
        import cloudpickle

        self.step("snapshotting the partition operator")
        op = self.all_round
        dumped = dump_operator(op, self._owner(op), self.call) if op is not None else None
        state = {"k": self.k, "rows": self.rows, "last": self.last.aligned, "operator": dumped}
        return cloudpickle.dumps(state)

    def restore(self, blob: bytes | None) -> None:
        import cloudpickle

        if blob is None:
            raise UsageError(f"subtask {self.pid}: no state was stashed by the previous round")
        state = cloudpickle.loads(blob)
        self.k, self.rows = state["k"], state["rows"]
        self.ctx.epoch = self.k - 1
        self.ctx.global_epoch_watermark = state["last"]
        self._fetch_variables()
        if state["operator"] is not None:

            def fresh() -> Any:
                op = self._load(self.plan.operator)
                self.call(op, "open", self.ctx)
                return op

            self.all_round = restore_operator(state["operator"], fresh, self.call)


def _guarded(plan: TaskPlan, pid: int, body: Any, link: CoordinatorLink | None) -> bytes:
    """Run ``body(subtask)`` under ``_guard``: a failure of this subtask reaches the
    coordinator (which fails the run) before Spark's. ``link``: the coordinator (None:
    the Ray actor ``plan.actor_name``)."""
    sub = _Subtask(plan, pid, None)
    aborted = False
    try:
        with _guard(sub, (lambda: link) if link is not None else (lambda: _coordinator(plan))):
            body(sub)
    except _Aborted:
        # Another participant failed and the coordinator holds its error for the driver;
        # this subtask ends quietly instead of adding a second, misleading traceback.
        aborted = True
        sub.close()
    except Exception:
        sub.close()
        raise
    summary = {"partition_id": pid, "epochs": sub.k - 1, "rows": sub.rows, "aborted": aborted}
    return pickle.dumps(summary)


def _watch(task: _TaskSteps, stop: threading.Event) -> None:
    """A daemon thread of the Spark task: when a step of the task (a user callback,
    reading the data, ...; not waiting for the coordinator, which is waiting for the
    others) makes no progress for ``call_timeout`` seconds, tell the coordinator, which
    fails the run; the driver then cancels the Spark job (that ends the stuck Python
    worker)."""
    timeout = task.call_timeout
    tick = min(1.0, timeout / 10)

    def run() -> None:
        while not stop.wait(tick):
            where, since = task.where, task.since
            stuck = time.monotonic() - since
            if where == "waiting for the coordinator" or stuck < timeout:
                continue
            label = task.label()
            message = (
                f"partition {task.pid} made no progress for {stuck:.0f} s in {label} at "
                f"epoch {task.ctx.epoch} ({task.config}(call_timeout={timeout:g})): a "
                f"callback that blocks, or one that needs a larger call_timeout"
            )
            failure = RemoteFailure(
                task.pid, task.ctx.epoch, label, "CallTimeout", message, "", CallTimeout(message)
            )
            _send_failure(task, failure)  # the coordinator gone: the job fails anyway
            return

    threading.Thread(target=run, name=f"hybrid_iter-watch-{task.pid}", daemon=True).start()


def run_subtask(
    plan: TaskPlan,
    pid: int,
    inputs: Iterator[tuple[int, pa.RecordBatch]],
    link: CoordinatorLink | None = None,
) -> bytes:
    """The whole iteration in one task; returns a pickled summary for the driver."""

    def body(sub: _Subtask) -> None:
        terminated = sub.start(inputs)
        while not terminated:
            terminated = sub.epoch()
        sub.terminate()
        sub.close()

    return _guarded(plan, pid, body, link)


def run_round(
    plan: TaskPlan,
    round_: int,
    pid: int,
    inputs: Iterator[tuple[int, pa.RecordBatch]],
    link: CoordinatorLink | None = None,
) -> bytes:
    """Round ``round_`` of an iteration with replayed streams (one barrier job per round)."""

    def body(sub: _Subtask) -> None:
        if round_ == 0:
            terminated = sub.start(inputs) or sub.epoch()
        else:
            sub.restore(sub.ask(sub.coord.unstash(pid)))
            terminated = sub.epoch(inputs)
        if terminated:
            sub.terminate()
            sub.close()
        else:
            sub.ask(sub.coord.stash(pid, sub.snapshot()))

    return _guarded(plan, pid, body, link)
