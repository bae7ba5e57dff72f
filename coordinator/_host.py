"""The coordinator tier's user code: its operators, their ``ctx``/``out``, and each call.

Runs in the Ray coordinator actor, on its event loop (user code never runs concurrently
with itself). The core (``_core.py``) decides which callback runs when; the actor hands
each such ``UserCall`` to ``OperatorHost.run``, which calls the user's operators and
listeners, catches what they raise (a ``RemoteFailure`` naming the callback and epoch)
and reports what they emitted: variables published and criteria records, which the core
needs for termination. Outputs are kept here, in emission order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._checkpoint import dump_operator, dumps_state, first_unpicklable, restore_operator
from ._core import (
    COORDINATOR,
    Apply,
    ApplyCombined,
    Done,
    Terminate,
    TerminatingRound,
    UserCall,
    Watermark,
)
from ._errors import NonFiniteVariables, RemoteFailure, UserCodeFailed, ValueEncodeError
from ._finite import count_nonfinite, first_nonfinite, index_text
from ._hooks import RuntimeHooks
from ._operator_api import CoordinatorCollector, CoordinatorContext, overrides
from ._protocol import Emissions, OutputRecord
from ._tree import fold
from ._variables import VariablesStore

__all__ = ["OperatorHost"]


class OperatorHost:
    """The main coordinator operator, the for_each_round one, the listeners, and the
    outputs they emit. Runs in the Ray coordinator actor."""

    def __init__(
        self,
        *,
        num_subtasks: int,
        staleness: int | None,
        has_criteria: bool,
        store: VariablesStore,
        aligned: Callable[[], int],
        progress_tag: str = "loss",
        hooks: RuntimeHooks | None = None,
    ) -> None:
        self.store = store
        self.hooks = hooks
        self.ctx = CoordinatorContext(num_subtasks, staleness, store, aligned)
        self.out = CoordinatorCollector(self, has_criteria)
        self.listener_out = CoordinatorCollector(self, has_criteria, from_listener=True)
        self.main = _Slot(self, None, per_round=False)
        self.round = _Slot(self, None, per_round=True)
        self.listeners: Sequence[Any] = ()
        self.combiner: Any = None  # feedback_combine's, when set
        self.outputs: list[OutputRecord] = []
        self.last_loss: Any = None
        self.progress_tag = progress_tag
        #: the user call running now, ``(operator.method, epoch, since)``: read by the
        #: actor's watch thread while this one may be stuck in user code
        self.busy: tuple[str, int, float] | None = None
        self._counts: list[tuple[int, int, int]] = []

    def load(self, operators: bytes, *, main_per_round: bool) -> None:
        """Unpickle ``(main or None, per-round or None, [listeners])``."""
        import cloudpickle

        main, per_round, self.listeners = cloudpickle.loads(operators)
        self.main = _Slot(self, main, per_round=main_per_round)
        self.round = _Slot(self, per_round, per_round=True)

    # -- running user code ------------------------------------------------------------------

    def invoke(self, obj: Any, method: str, *args: Any) -> Any:
        """Call user code ``obj.method(*args)`` (a missing hook is a no-op); raises
        ``UserCodeFailed`` with the failure when it raises."""
        fn = getattr(obj, method, None)
        if fn is None:
            return None
        label = f"{type(obj).__name__}.{method}"
        self.busy = (label, self.ctx.epoch, time.monotonic())
        try:
            return fn(*args)
        except Exception as ex:
            raise UserCodeFailed(
                RemoteFailure.capture(ex, source=COORDINATOR, epoch=self.ctx.epoch, where=label)
            ) from ex
        finally:
            self.busy = None

    def emitted(self) -> tuple[tuple[int, int, int], ...]:
        """The ``(epoch, published, criteria)`` records since the last call (and forget)."""
        counts, self._counts = tuple(self._counts), []
        return counts

    def run(self, call: UserCall) -> Done:
        """Carry out one of the core's user calls; its outcome for the core."""
        self._counts = []
        try:
            match call:
                case Apply():
                    self._apply(call.epoch, call.pid, call.emissions, call.terminating)
                case ApplyCombined():
                    self._apply_combined(call.epoch, call.main, call.round)
                case Watermark():
                    self._watermark(call.epoch)
                case TerminatingRound():
                    self._terminating_round(call.epoch)
                case Terminate():
                    self._terminate(call.epoch, call.outputs)
                case _:
                    raise TypeError(f"not a user call: {call!r}")
        except UserCodeFailed as ex:
            return Done(ex.failure, self.emitted(), self.store.version)
        return Done(None, self.emitted(), self.store.version)

    def _apply(self, epoch: int, pid: int, em: Emissions, terminating: bool) -> None:
        ctx = self.ctx
        ctx.epoch, ctx.terminating = epoch, terminating
        try:
            ctx.source_partition = pid
            try:
                # the per-round sub-body's feedback goes to its own operator when it has one
                round_slot = self.round if self.round.template is not None else self.main
                for slot, values in ((self.main, em.feedback), (round_slot, em.round_feedback)):
                    if values and slot.template is not None:
                        op = slot.get(epoch)
                        for value in values:
                            self.invoke(op, "process_feedback", value, ctx, self.out)
            finally:
                ctx.source_partition = None
            for tag, value in em.outputs:
                self.route(tag, epoch, pid, value)
        finally:
            ctx.terminating = False

    def _apply_combined(self, epoch: int, main: Sequence[Any], round_: Sequence[Any]) -> None:
        """feedback_combine: one ``process_feedback`` per epoch with each merged total
        (``ctx.source_partition`` is None: the value comes from every partition)."""
        self.ctx.epoch = epoch
        try:
            totals = [fold(v, self.combiner) if v else None for v in (main, round_)]
        except Exception as ex:  # a combiner that cannot merge: fail the run, never hang
            raise UserCodeFailed(
                RemoteFailure.capture(
                    ex, source=COORDINATOR, epoch=epoch, where="combining feedback"
                )
            ) from ex
        round_slot = self.round if self.round.template is not None else self.main
        for slot, value in zip((self.main, round_slot), totals):
            if value is not None and slot.template is not None:
                self.invoke(slot.get(epoch), "process_feedback", value, self.ctx, self.out)

    def _watermark(self, epoch: int) -> None:
        self.ctx.epoch = epoch
        for slot in (self.main, self.round):
            if slot.template is not None:
                op = slot.get(epoch)
                self.invoke(op, "on_epoch_watermark_incremented", epoch, self.ctx, self.out)
                slot.end_round()
        for listener in self.listeners:
            self.invoke(
                listener, "on_epoch_watermark_incremented", epoch, self.ctx, self.listener_out
            )

    def _terminating_round(self, epoch: int) -> None:
        self.ctx.epoch, self.ctx.terminating = epoch, True
        try:
            for slot in (self.main, self.round):
                if slot.per_round and slot.template is not None:
                    op = slot.get(epoch)
                    self.invoke(op, "on_epoch_watermark_incremented", epoch, self.ctx, self.out)
                    slot.end_round()
        finally:
            self.ctx.terminating = False

    def _terminate(self, epoch: int, outputs: Sequence[tuple[int, Any]]) -> None:
        for pid, records in outputs:
            for tag, value in records:
                self.route(tag, epoch, pid, value)
        self.ctx.epoch = epoch
        # only operators still alive hear of it: per-round ones closed with their round
        op = self.main.alive()
        if op is not None:
            self.invoke(op, "on_iteration_terminated", self.ctx, self.out)
            self.invoke(op, "close")
        for listener in self.listeners:
            self.invoke(listener, "on_iteration_terminated", self.ctx, self.listener_out)

    def route(
        self, tag: str, epoch: int, source: int | str, value: Any, from_listener: bool = False
    ) -> None:
        """An output record: offered to the listeners first (one may take it), then kept."""
        if not from_listener:
            prev = self.ctx.epoch
            self.ctx.epoch = epoch
            try:
                for listener in self.listeners:
                    if self.invoke(
                        listener, "process_output", tag, value, self.ctx, self.listener_out
                    ):
                        return
            finally:
                self.ctx.epoch = prev
        if tag == self.progress_tag:
            self.last_loss = value
        self.outputs.append(OutputRecord(tag, epoch, source, value))

    # -- what ``out`` of the coordinator tier calls (``CoordinatorCollector``) ---------------

    def publish(self, variables: Mapping[str, Any]) -> None:
        if self.ctx.terminating:
            return  # the terminating round's publishes are fed back nowhere (loop closed)
        for name, value in variables.items():
            i = first_nonfinite(value)
            if i is not None:
                arr = np.asarray(value)
                raise NonFiniteVariables(
                    f"publish_variables({name}=...) at epoch {self.ctx.epoch} has "
                    f"{count_nonfinite(arr)} NaN/inf value(s) of {arr.size}, the first "
                    f"{name}{index_text(arr.shape, i)} = {arr.reshape(-1)[i]}; the update "
                    f"diverged (lower the learning rate, scale the features) or its input "
                    f"had NaN"
                )
        self.store.publish(variables)
        self._counts.append((self.ctx.epoch, 1, 0))
        if self.hooks is not None:
            self.hooks.after_publish(self.ctx.epoch, variables)

    def output(self, tag: str, value: Any, *, from_listener: bool) -> None:
        self.route(tag, self.ctx.epoch, COORDINATOR, value, from_listener)

    def criteria(self) -> None:
        self._counts.append((self.ctx.epoch, 0, 1))

    def unpicklable_output(self) -> RemoteFailure | None:
        """The first output record that does not pickle, as the failure of sending the
        result to the driver (None when every one does). Asked only after that failed."""
        found = first_unpicklable(self.outputs, "the output records")
        if found is None:
            return None
        record, what = found
        error = ValueEncodeError(
            f"{what}; the result cannot be sent to the driver. Emit with out.output only "
            f"what pickles: numbers, strings, numpy arrays, and containers and objects of "
            f"them (drop or convert the part named, e.g. a lock, an open file, a client)"
        )
        where = "sending the result to the driver"
        return RemoteFailure(
            record.source, record.epoch, where, type(error).__name__, str(error), "", error
        )

    # -- checkpoints ------------------------------------------------------------------------

    def open(self, *, checkpointed: bool) -> None:
        """Open the all-round main operator of a run that starts afresh; with checkpoints,
        refuse at once (before any job) one that a checkpoint could not hold."""
        self.main.open_all_round()
        main = self.main.alive()
        if checkpointed and main is not None and not overrides(main, "snapshot_state"):
            self.dump_main()

    def dump_main(self) -> tuple[str, bytes] | None:
        """The all-round main operator's state for a checkpoint (None: there is none)."""
        main = self.main.alive()
        if main is None:
            return None
        return dump_operator(main, f"the coordinator operator {type(main).__name__}", self.invoke)

    def checkpoint_part(self) -> dict[str, Any]:
        """What a checkpoint holds of the operators (``restore`` takes it back)."""
        return {
            "main": self.dump_main(),
            "listeners": dumps_state(list(self.listeners), "the coordinator listeners"),
            "last_loss": self.last_loss,
        }

    def restore(self, data: Mapping[str, Any]) -> None:
        import cloudpickle

        if data["main"] is not None and self.main.template is not None:

            def fresh() -> Any:
                self.main.open_all_round()
                return self.main.alive()

            self.main.adopt(restore_operator(data["main"], fresh, self.invoke))
        elif self.main.alive() is None:
            self.main.open_all_round()
        self.listeners = cloudpickle.loads(data["listeners"])
        self.last_loss = data["last_loss"]


class _Slot:
    """One coordinator-tier operator: one instance for the whole iteration (all-round), or
    a fresh copy of the template every round (per-round: opened with the variables of
    its round when first needed, closed after its round's watermark)."""

    def __init__(self, host: OperatorHost, template: Any, *, per_round: bool):
        self._host = host
        self.template = template
        self.per_round = per_round
        self._instance: Any = None
        self._epoch: int | None = None
        self._blob: bytes | None = None

    def open_all_round(self) -> None:
        if self.template is not None and not self.per_round:
            self._instance = self.template
            self._host.invoke(self._instance, "open", self._host.store.values, self._host.ctx)

    def get(self, epoch: int) -> Any:
        if not self.per_round:
            return self._instance
        if self._instance is None or self._epoch != epoch:
            self.end_round()
            import cloudpickle

            if self._blob is None:
                self._blob = cloudpickle.dumps(self.template)
            self._instance, self._epoch = cloudpickle.loads(self._blob), epoch
            self._host.invoke(self._instance, "open", self._host.store.values, self._host.ctx)
        return self._instance

    def end_round(self) -> None:
        if self.per_round and self._instance is not None:
            op, self._instance, self._epoch = self._instance, None, None
            self._host.invoke(op, "close")

    def alive(self) -> Any:
        return None if self.per_round else self._instance

    def adopt(self, instance: Any) -> None:
        """Use a restored all-round instance (already opened in its first life)."""
        self._instance = instance
