"""The iteration body and the coordinator-tier helpers of FLIP-176.

``TerminateOnMaxIter``, ``TerminateOnMaxIterOrTol`` and ``ForwardInputsOfLastRound``
run in the Ray coordinator actor, after the user's coordinator operator, and see every
output record of both tiers (``process_output``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator._tree import DEFAULT_FAN_IN, load_combiner

from ._errors import IterationConfigError
from ._operators import CoordinatorOperator, IterationListener, PartitionOperator

__all__ = [
    "CoordinatorListener",
    "ForwardInputsOfLastRound",
    "IterationBody",
    "TerminateOnMaxIter",
    "TerminateOnMaxIterOrTol",
    "TerminationCriteria",
]


class CoordinatorListener(IterationListener):
    """A helper in the coordinator tier that sees output records. Runs in the Ray actor."""

    def process_output(self, tag: str, value: Any, ctx: Any, out: Any) -> bool:
        """Called for each ``out.output(tag, value)`` of either tier (``ctx.epoch`` is the
        record's epoch). Return True to consume the record (it then does not reach
        ``IterationResult.outputs``)."""
        return False


class TerminationCriteria(CoordinatorListener):
    """A termination-criteria stream: the iteration ends after an epoch in which no
    criteria record was emitted. Subclass it and call ``out.criteria()`` to continue."""


def _positive_int(name: str, v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise IterationConfigError(f"{name} must be an int >= 1, got {v!r}")
    return v


class TerminateOnMaxIter(TerminationCriteria):
    """Continue while ``epoch + 1 < max_iter``: the iteration runs ``max_iter`` epochs."""

    def __init__(self, max_iter: int) -> None:
        self.max_iter = _positive_int("TerminateOnMaxIter(max_iter)", max_iter)

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        if epoch + 1 < self.max_iter:
            out.criteria()


class TerminateOnMaxIterOrTol(TerminationCriteria):
    """Continue while ``epoch + 1 < max_iter`` and the newest ``loss_tag`` output is
    above ``tol`` (the loss is taken as +inf until one is emitted)."""

    def __init__(self, max_iter: int, tol: float, *, loss_tag: str = "loss") -> None:
        self.max_iter = _positive_int("TerminateOnMaxIterOrTol(max_iter)", max_iter)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or math.isnan(tol):
            raise IterationConfigError(
                f"TerminateOnMaxIterOrTol(tol) must be a number, got {tol!r}"
            )
        self.tol = float(tol)
        self.loss_tag = loss_tag
        self.loss = math.inf

    def process_output(self, tag: str, value: Any, ctx: Any, out: Any) -> bool:
        if tag == self.loss_tag:
            self.loss = float(value)
        return False

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        if epoch + 1 < self.max_iter and self.loss > self.tol:
            out.criteria()


class ForwardInputsOfLastRound(CoordinatorListener):
    """Hold back the outputs tagged ``tag`` and emit, at termination, only those of the
    last epoch that had any (e.g. the final model instead of one per epoch)."""

    def __init__(self, tag: str) -> None:
        if not isinstance(tag, str) or not tag:
            raise IterationConfigError("ForwardInputsOfLastRound(tag) must be a non-empty string")
        self.tag = tag
        self._epoch = -1
        self._values: list[Any] = []

    def process_output(self, tag: str, value: Any, ctx: Any, out: Any) -> bool:
        if tag != self.tag:
            return False
        if ctx.epoch > self._epoch:
            self._epoch, self._values = ctx.epoch, []
        if ctx.epoch == self._epoch:
            self._values.append(value)
        return True

    def on_iteration_terminated(self, ctx: Any, out: Any) -> None:
        for v in self._values:
            out.output(self.tag, v)


def _check_operator(what: str, op: Any, base: type, optional: bool) -> None:
    if op is None and optional:
        return
    if isinstance(op, type):
        keyword = what[what.index("(") + 1 : what.index("=")]
        raise IterationConfigError(
            f"{what} needs an instance, got the class {op.__name__}; write "
            f"{keyword}={op.__name__}()"
        )
    if not isinstance(op, base):
        allowed = f"a hybrid_iter.{base.__name__}" + (" or None" if optional else "")
        raise IterationConfigError(f"{what} must be {allowed}, got {type(op).__name__}")


@dataclass(frozen=True)
class IterationBody:
    """A partition operator, a coordinator operator and coordinator-tier helpers.

    * ``partition``: a ``PartitionOperator`` instance; every subtask gets a copy.
    * ``coordinator``: a ``CoordinatorOperator`` instance (or ``None``: no parameter
      server, partitions only exchange outputs).
    * ``criteria``: a ``TerminationCriteria`` helper (e.g. ``TerminateOnMaxIter(10)``),
      or ``True`` when the operators themselves emit ``out.criteria()``; ``None`` means
      the body has no criteria stream.
    * ``listeners``: more coordinator-tier helpers, e.g. ``ForwardInputsOfLastRound``.

    * ``feedback_combine``: the feedback is combinable (sync iterations only): ``"sum"``
      (numbers, numpy arrays, and tuples, lists or dicts of them, added element by
      element) or an object with ``merge(a, b)`` returning the combined value. Subtasks
      then merge their feedback in a tree (groups of subtasks report through aggregator
      actors, at most ``feedback_fan_in`` calls reach the coordinator per epoch), and
      ``process_feedback`` is called once per epoch with the merged total of every
      partition (``ctx.source_partition`` is None there). The merge order is fixed by the
      number of partitions and the fan-in: sync runs stay bit-for-bit reproducible, equal
      to the flat sum up to float rounding.
    * ``feedback_fan_in``: at most this many partial values (and calls) per epoch into the
      coordinator with ``feedback_combine`` (default 32).

    ``body.for_each_round(partition=..., coordinator=...)`` adds a per-round sub-body
    (``per_round_partition`` / ``per_round_coordinator``): fresh instances every round
    next to the all-round operators.
    """

    partition: PartitionOperator
    coordinator: CoordinatorOperator | None = None
    criteria: TerminationCriteria | bool | None = None
    listeners: Sequence[CoordinatorListener] = field(default_factory=tuple)
    per_round_partition: PartitionOperator | None = None
    per_round_coordinator: CoordinatorOperator | None = None
    feedback_combine: Any = None
    feedback_fan_in: int = DEFAULT_FAN_IN

    def __post_init__(self) -> None:
        if self.feedback_combine is not None:
            try:
                load_combiner(self.feedback_combine)
            except (TypeError, ValueError) as ex:
                raise IterationConfigError(f"IterationBody: {ex}") from ex
        fan_in = self.feedback_fan_in
        if not isinstance(fan_in, int) or isinstance(fan_in, bool) or fan_in < 1:
            raise IterationConfigError(
                f"IterationBody(feedback_fan_in=...) must be an int >= 1, got {fan_in!r}"
            )
        _check_operator("IterationBody(partition=...)", self.partition, PartitionOperator, False)
        _check_operator(
            "IterationBody(coordinator=...)", self.coordinator, CoordinatorOperator, True
        )
        _check_operator(
            "for_each_round(partition=...)", self.per_round_partition, PartitionOperator, True
        )
        _check_operator(
            "for_each_round(coordinator=...)",
            self.per_round_coordinator,
            CoordinatorOperator,
            True,
        )
        if self.per_round_coordinator is not None and self.per_round_partition is None:
            raise IterationConfigError(
                "for_each_round(coordinator=...) needs a partition operator too: it receives "
                "the feedback of for_each_round(partition=...)"
            )
        if not (
            self.criteria is None
            or isinstance(self.criteria, bool)
            or isinstance(self.criteria, TerminationCriteria)
        ):
            raise IterationConfigError(
                f"IterationBody(criteria=...) must be a TerminationCriteria (e.g. "
                f"TerminateOnMaxIter(10)), True, or None, got {type(self.criteria).__name__}"
            )
        listeners = tuple(self.listeners)
        for i, listener in enumerate(listeners):
            if not isinstance(listener, CoordinatorListener):
                raise IterationConfigError(
                    f"IterationBody(listeners[{i}]) must be a CoordinatorListener, "
                    f"got {type(listener).__name__}"
                )
        object.__setattr__(self, "listeners", listeners)

    def for_each_round(
        self, partition: PartitionOperator, coordinator: CoordinatorOperator | None = None
    ) -> IterationBody:
        """This body plus a per-round sub-body (FLIP-176 ``forEachRound``).

        Every round ``e`` gets a fresh ``partition`` instance per subtask (and a fresh
        ``coordinator`` in the actor): it is opened, sees the variables of ``e`` and the
        replayed streams' records of round ``e``, its watermark callback of ``e``, and is
        closed; its state never leaks into another round. Its feedback goes to the
        per-round ``coordinator`` when given, else to the body's coordinator.
        """
        if self.per_round_partition is not None:
            raise IterationConfigError(
                "this body already has a for_each_round sub-body; put both per-round "
                "computations in one PartitionOperator"
            )
        return dataclasses.replace(
            self, per_round_partition=partition, per_round_coordinator=coordinator
        )

    @property
    def has_criteria(self) -> bool:
        return self.criteria is not None and self.criteria is not False

    @property
    def coordinator_listeners(self) -> tuple[CoordinatorListener, ...]:
        first = (self.criteria,) if isinstance(self.criteria, CoordinatorListener) else ()
        return (*first, *self.listeners)
