"""What user operators see on both tiers: ``ctx`` and ``out``, and their hooks' defaults.

One place for both tiers (``hybrid_iter`` re-exports the classes): the partition tier's
``PartitionContext``/``PartitionCollector`` run in a Spark task, the coordinator tier's
``CoordinatorContext``/``CoordinatorCollector`` in the Ray coordinator actor. The checks
both tiers share are written once, on the base classes, with one exception type per
misuse: a bad output tag is a ``ConfigTypeError`` (a ``TypeError``), ``out.criteria()``
without a criteria stream a ``UsageError`` (a ``RuntimeError``).

``default_hook`` marks the no-op hooks of the operator base classes, so that
``overrides(op, "snapshot_state")`` tells on either tier whether the user wrote one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from ._errors import ConfigTypeError, UsageError
from ._protocol import Emissions

__all__ = [
    "Collector",
    "CoordinatorCollector",
    "CoordinatorContext",
    "OperatorContext",
    "PartitionCollector",
    "PartitionContext",
    "default_hook",
    "overrides",
]

F = TypeVar("F", bound=Callable[..., Any])


def default_hook(fn: F) -> F:
    """Mark ``fn`` as a base class's no-op hook (``overrides`` then says False for it)."""
    fn.__hybrid_iter_default_hook__ = True  # type: ignore[attr-defined]
    return fn


def overrides(obj: Any, method: str) -> bool:
    """True when ``obj``'s class has ``method`` and it is not a base class's no-op hook."""
    fn = getattr(type(obj), method, None)
    return fn is not None and not getattr(fn, "__hybrid_iter_default_hook__", False)


class OperatorContext:
    """What both tiers' ``ctx`` hold: the epoch being handled, the mode, and whether the
    terminating round's per-round operators are running."""

    def __init__(self, num_partitions: int, staleness: int | None) -> None:
        self.num_partitions = num_partitions
        self.staleness = staleness
        self.epoch = 0
        #: True while the terminating round's per-round operators run (their round has
        #: the variables fed back into it but no data: replay stopped at termination)
        self.terminating = False

    @property
    def is_sync(self) -> bool:
        return self.staleness == 0


class PartitionContext(OperatorContext):
    """What a partition operator can see. Runs in a Spark task.

    ``epoch`` is the subtask's current epoch; ``global_epoch_watermark`` the newest
    global alignment it has heard of (in sync mode equal to ``epoch`` inside
    ``on_epoch_watermark_incremented``); ``terminating`` is True only in the terminating
    round's per-round operators (variables, no data; docs/semantics.md).
    """

    def __init__(self, partition_id: int, num_partitions: int, staleness: int | None) -> None:
        super().__init__(num_partitions, staleness)
        self.partition_id = partition_id
        self.global_epoch_watermark = -1
        self.variables_version = -1


class _Variables(Protocol):
    """The coordinator's view of the newest published variables."""

    @property
    def values(self) -> Mapping[str, Any]: ...

    @property
    def version(self) -> int: ...


class CoordinatorContext(OperatorContext):
    """What coordinator-tier code can see. Runs in the Ray coordinator actor.

    ``epoch`` is the epoch of the record or watermark being handled; ``source_partition``
    is the sending partition inside ``process_feedback`` (``None`` elsewhere);
    ``variables`` is the newest published version.
    """

    def __init__(
        self,
        num_partitions: int,
        staleness: int | None,
        variables: _Variables,
        aligned: Callable[[], int],
    ) -> None:
        super().__init__(num_partitions, staleness)
        self.source_partition: int | None = None
        self._variables = variables
        self._aligned = aligned

    @property
    def variables(self) -> Mapping[str, Any]:
        return self._variables.values

    @property
    def variables_version(self) -> int:
        return self._variables.version

    @property
    def global_epoch_watermark(self) -> int:
        """The coordinator tier's epoch watermark (-1 before epoch 0 completes)."""
        return self._aligned() - 1


class Collector:
    """What both tiers' ``out`` share: outputs and termination criteria, checked once."""

    def __init__(self, has_criteria: bool) -> None:
        self._has_criteria = has_criteria

    def output(self, tag: str, value: Any) -> None:
        """Emit a record to the iteration's outputs under ``tag``."""
        if not isinstance(tag, str) or not tag:
            raise ConfigTypeError(f"output tag must be a non-empty string, got {tag!r}")
        self._output(tag, value)

    def criteria(self, value: Any = 1) -> None:
        """Emit a termination-criteria record: the iteration continues this epoch."""
        if not self._has_criteria:
            raise UsageError(
                "out.criteria() was called but the IterationBody has no criteria stream; "
                "pass IterationBody(..., criteria=True) or a criteria helper such as "
                "TerminateOnMaxIter(n)"
            )
        self._criteria()

    def _output(self, tag: str, value: Any) -> None:
        raise NotImplementedError

    def _criteria(self) -> None:
        raise NotImplementedError


class PartitionCollector(Collector):
    """``out`` of partition-operator callbacks. Runs in a Spark task."""

    def __init__(self, has_criteria: bool, *, per_round: bool = False) -> None:
        super().__init__(has_criteria)
        self._per_round = per_round
        self._em = Emissions()

    def _bind(self, em: Emissions) -> None:
        self._em = em

    def feedback(self, value: Any) -> None:
        """Send ``value`` to the coordinator tier's ``process_feedback``."""
        (self._em.round_feedback if self._per_round else self._em.feedback).append(value)

    def _output(self, tag: str, value: Any) -> None:
        self._em.outputs.append((tag, value))

    def _criteria(self) -> None:
        self._em.criteria += 1


class _Sink(Protocol):
    """Where the coordinator tier's emissions go (the coordinator's operator host)."""

    def publish(self, variables: Mapping[str, Any]) -> None: ...

    def output(self, tag: str, value: Any, *, from_listener: bool) -> None: ...

    def criteria(self) -> None: ...


class CoordinatorCollector(Collector):
    """``out`` of coordinator-tier callbacks. Runs in the Ray coordinator actor."""

    def __init__(self, sink: _Sink, has_criteria: bool, *, from_listener: bool = False) -> None:
        super().__init__(has_criteria)
        self._sink = sink
        self._from_listener = from_listener

    def publish_variables(self, **variables: Any) -> None:
        """Publish new values of some variables: the next epoch's broadcast to partitions."""
        self._sink.publish(variables)

    def _output(self, tag: str, value: Any) -> None:
        self._sink.output(tag, value, from_listener=self._from_listener)

    def _criteria(self) -> None:
        self._sink.criteria()
