"""Plain records exchanged between Spark tasks and the coordinator actor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._errors import RemoteFailure
from ._variables import VariablesPayload

__all__ = ["Emissions", "OutputRecord", "Progress", "Reply", "ResultData"]


@dataclass(slots=True)
class Emissions:
    """What a subtask emitted since its previous call, in emission order per kind."""

    feedback: list[Any] = field(default_factory=list)
    outputs: list[tuple[str, Any]] = field(default_factory=list)
    criteria: int = 0
    #: feedback of the for_each_round (per-round) partition operator
    round_feedback: list[Any] = field(default_factory=list)
    #: with ``feedback_combine``: how many ``out.feedback`` records were merged into
    #: ``feedback`` / ``round_feedback`` (None: the lists hold every record)
    combined_count: int | None = None

    def __bool__(self) -> bool:
        return bool(self.feedback or self.round_feedback or self.outputs or self.criteria)

    @property
    def feedback_count(self) -> int:
        if self.combined_count is not None:
            return self.combined_count
        return len(self.feedback) + len(self.round_feedback)


@dataclass(frozen=True, slots=True)
class OutputRecord:
    """One ``out.output(tag, value)`` record: its epoch and who emitted it."""

    tag: str
    epoch: int
    source: int | str
    value: Any


@dataclass(frozen=True, slots=True)
class Reply:
    """The coordinator's answer to call ``epoch`` of a subtask."""

    epoch: int
    terminated: bool
    aligned: int
    variables: VariablesPayload | None = None
    error: RemoteFailure | None = None
    #: a checkpoint is being taken: send your state (``checkpoint_state``) and wait there
    need_state: bool = False
    #: with ``terminated``: the round the last published variables were fed into; its
    #: per-round operators still run (open, variables, end of round, close) first
    terminating_round: int | None = None


@dataclass(frozen=True, slots=True)
class Progress:
    """A snapshot for the driver's progress display."""

    aligned: int
    epochs: int
    last_epoch_seconds: float | None
    loss: Any
    terminated_by: str | None
    done: bool
    failed: bool
    #: epochs each subtask has finished (async/SSP: they differ; the slowest is the
    #: straggler)
    subtask_epochs: tuple[int, ...] = ()
    #: rows every data stream loaded, in total (once loaded)
    rows: int = 0
    #: the newest checkpoint epoch written or restored (-1: none)
    checkpointed: int = -1
    #: the variables version (publishes so far): the model version
    version: int = 0


@dataclass(frozen=True)
class ResultData:
    variables: dict[str, Any]
    outputs: list[OutputRecord]
    epochs: int
    terminated_by: str | None
    alignment_times: list[float]
    subtask_epochs: dict[int, int]
    feedback_counts: dict[int, int]
    rows: list[int]
    publishes: int
    object_store_puts: int
    failures: list[RemoteFailure]
