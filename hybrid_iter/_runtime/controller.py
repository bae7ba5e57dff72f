"""The driver's controller of one bounded run: its states, and which failures it relaunches.

Pure: no Spark, no Ray, no files. ``iterate.py`` carries out what it decides (start a
coordinator and the barrier stage, poll, kill, ask a coordinator Ray restarted what it
restored) and tells it what happened::

    LAUNCHING --running()--> RUNNING --finished()--> FINISHED
                                     --failed(ex)--> RESTORING   (the policy relaunches)
                                                 --> FAILED      (it does not)
    RESTORING --restored(r)--> LAUNCHING  (the next attempt, from the newest checkpoint)
                           --> FAILED     (r missed a checkpoint that was written)
    any state but FINISHED --abort()--> FAILED  (an error outside the attempt's stage)

``FailurePolicy`` decides by the **type** of a failure, never by its message: the
failure itself (bad arguments, bad data, an interrupt), or the type of the cause a
``RemoteFailure`` carries (a callback that timed out, mismatched variables, a
checkpoint of another run, ...). A failure of user code met a second time (the same
exception type and message, object addresses blanked, in the same callback at the same
epoch) is deterministic: relaunching it again would spend the restarts on a bug.
"""

from __future__ import annotations

import enum
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator import (
    CallTimeout,
    ForeignCheckpoint,
    MissingCheckpoint,
    RemoteFailure,
    RestoredCheckpoint,
    ValueEncodeError,
)

from .._errors import (
    DataValidationError,
    IterationConfigError,
    IterationFailedError,
    RunStateError,
    StoredArraysLost,
    UsageError,
    VariablesMismatchError,
    WorkerDiedError,
)

T = TypeVar("T")

__all__ = [
    "Decision",
    "FailurePolicy",
    "RunController",
    "RunState",
    "RunStateError",
    "Verdict",
    "relaunch_if_worker_died",
]


class RunState(enum.Enum):
    LAUNCHING = "launching"
    RUNNING = "running"
    RESTORING = "restoring"
    FINISHED = "finished"
    FAILED = "failed"


_MOVES: dict[RunState, frozenset[RunState]] = {
    RunState.LAUNCHING: frozenset({RunState.RUNNING, RunState.FAILED}),
    RunState.RUNNING: frozenset({RunState.FINISHED, RunState.RESTORING, RunState.FAILED}),
    RunState.RESTORING: frozenset({RunState.LAUNCHING, RunState.FAILED}),
    RunState.FINISHED: frozenset(),
    RunState.FAILED: frozenset(),
}


class Verdict(enum.Enum):
    #: may be transient (a lost process, a Spark error): relaunch from the newest checkpoint
    RELAUNCH = "relaunch"
    #: a relaunch would meet it again (bad input, a blocking callback, a foreign checkpoint)
    FATAL = "fatal"
    #: no restart left
    EXHAUSTED = "exhausted"
    #: the same failure of user code as an earlier attempt: deterministic
    REPEATED = "repeated"


#: failures that are themselves final: bad arguments, bad data, an interrupt
FATAL_ERRORS: tuple[type[BaseException], ...] = (
    IterationConfigError,
    DataValidationError,
    KeyboardInterrupt,
    SystemExit,
)

#: failures of a run (``IterationFailedError``) that a relaunch would meet again, by the
#: type of a ``RemoteFailure``'s cause
FATAL_CAUSES: tuple[type[BaseException], ...] = (
    VariablesMismatchError,
    IterationConfigError,
    StoredArraysLost,  # a relaunch would miss the same arrays: the fit reads from Spark
    ForeignCheckpoint,
    MissingCheckpoint,  # the restore found less than was written: the path is not shared
    ValueEncodeError,  # the same value would be met again (a checkpoint's, an output)
    UsageError,  # an API called where it cannot be: the same call is made again
    CallTimeout,  # a callback that blocks would block again
)


@dataclass(frozen=True)
class Decision:
    """What the controller does about a failure; ``error``: what the driver raises
    instead of the failure itself (None: the failure, unchanged)."""

    verdict: Verdict
    why: str
    error: BaseException | None = None

    @property
    def relaunch(self) -> bool:
        return self.verdict is Verdict.RELAUNCH


def _causes(ex: BaseException) -> list[BaseException]:
    if not isinstance(ex, IterationFailedError):
        return []
    return [c for f in ex.failures.values() if (c := getattr(f, "cause", None)) is not None]


def failure_identity(ex: BaseException) -> tuple[Any, ...] | None:
    """What identifies a failure of user code across attempts: where (partition or
    coordinator, callback, epoch) and what (exception type and message, object
    addresses blanked). None for failures that name no user code (a lost process, a
    Spark error)."""
    if not isinstance(ex, IterationFailedError):
        return None
    for f in ex.failures.values():
        if isinstance(f, RemoteFailure):
            message = re.sub(r"0x[0-9a-fA-F]+", "0x?", f.message)
            return (f.source, f.epoch, f.where, f.type_name, message)
    return None


@dataclass
class FailurePolicy:
    """Which failures of a run are relaunched, ``restarts`` times at most."""

    restarts: int
    #: the failures of user code met so far, with the attempt that met each first
    seen: dict[tuple[Any, ...], int] = field(default_factory=dict)

    @staticmethod
    def classify(ex: BaseException) -> Verdict:
        """RELAUNCH or FATAL, by the type of ``ex`` or of a cause it carries."""
        if isinstance(ex, FATAL_ERRORS):
            return Verdict.FATAL
        if any(isinstance(c, FATAL_CAUSES) for c in _causes(ex)):
            return Verdict.FATAL
        return Verdict.RELAUNCH

    def decide(self, ex: BaseException, attempt: int) -> Decision:
        """The decision about ``ex``, the failure of attempt ``attempt`` (0-based)."""
        if self.classify(ex) is Verdict.FATAL:
            kind = [type(c).__name__ for c in _causes(ex) if isinstance(c, FATAL_CAUSES)]
            return Decision(Verdict.FATAL, f"{(kind or [type(ex).__name__])[0]} is final")
        if attempt >= self.restarts:
            return Decision(Verdict.EXHAUSTED, f"{self.restarts} restart(s) spent")
        key = failure_identity(ex)
        if key is not None and key in self.seen:
            assert isinstance(ex, IterationFailedError)
            error = IterationFailedError(
                f"{ex.message} (the same failure as attempt {self.seen[key]}: a relaunch "
                f"met it again, so it is deterministic and not retried again; fix the code "
                f"or data it names)",
                ex.failures,
            )
            return Decision(Verdict.REPEATED, f"met in attempt {self.seen[key]}", error)
        if key is not None:
            self.seen[key] = attempt
        return Decision(Verdict.RELAUNCH, f"{self.restarts - attempt} restart(s) left")


class RunController:
    """The state of one bounded run on the driver, and its moves.

    ``checkpoint_uri``: where the run checkpoints (None: it does not); ``restore``: the next launch restores the newest checkpoint (a relaunch with
    checkpoints, or ``resume_from``); ``expect``: the newest checkpoint known to exist
    (a restore that finds less fails loudly)."""

    def __init__(
        self,
        restarts: int,
        *,
        checkpoint_uri: str | None,
        resume: bool = False,
        expect: int | None = None,
    ) -> None:
        self.state = RunState.LAUNCHING
        self.policy = FailurePolicy(restarts)
        self.checkpoint_uri = checkpoint_uri
        self.attempt = 0
        self.restore = resume
        self.expect = expect
        #: one line per failed attempt that was relaunched
        self.failed_attempts: list[str] = []
        #: what each coordinator Ray restarted reported it restored
        self.restores: list[RestoredCheckpoint] = []

    def _move(self, to: RunState) -> None:
        if to not in _MOVES[self.state]:
            raise RunStateError(
                f"the run controller cannot go from {self.state.value} to {to.value}"
            )
        self.state = to

    def running(self) -> None:
        """The attempt's coordinator and Spark stage were launched."""
        self._move(RunState.RUNNING)

    def checkpointed(self, epoch: int) -> None:
        """The coordinator reported checkpoint ``epoch`` written (-1: none yet)."""
        if epoch >= 0:
            self.expect = max(self.expect or 0, epoch)

    def finished(self) -> None:
        self._move(RunState.FINISHED)

    def failed(self, ex: BaseException) -> Decision:
        """The attempt failed with ``ex``: RESTORING when the policy relaunches, else FAILED."""
        if self.state is not RunState.RUNNING:
            raise RunStateError(
                f"the run controller was told of a failure while {self.state.value}"
            )
        decision = self.policy.decide(ex, self.attempt)
        if not decision.relaunch:
            self._move(RunState.FAILED)
            return decision
        self._move(RunState.RESTORING)
        self.failed_attempts.append(
            f"attempt {self.attempt}: {type(ex).__name__}: {ex}".splitlines()[0]
        )
        self.attempt += 1
        self.restore = self.checkpoint_uri is not None
        return decision

    def restored(self, outcome: RestoredCheckpoint | None) -> MissingCheckpoint | None:
        """The next coordinator is ready: a new one (``outcome`` None: it checks what it
        restores itself), or one Ray restarted with what it restored. Back to LAUNCHING,
        or FAILED with the error when the restore missed a checkpoint that was written."""
        if self.state is not RunState.RESTORING:
            raise RunStateError(f"the run controller restored while {self.state.value}")
        if outcome is not None:
            self.restores.append(outcome)
            if outcome.missing:
                self._move(RunState.FAILED)
                return outcome.error(
                    self.checkpoint_uri or "", "the coordinator, restarted by Ray,"
                )
        self._move(RunState.LAUNCHING)
        return None

    def abort(self) -> None:
        """An error outside an attempt's stage ended the run."""
        if self.state is not RunState.FINISHED:
            self.state = RunState.FAILED


def relaunch_if_worker_died(owner: str, run: Callable[[], T]) -> T:
    """``run()``, once more when a Spark Python worker died under it
    (``WorkerDiedError``: killed, out of memory; no exception of user code). A fit is a
    function of its data and parameters, so the relaunch gives the same model (bit for
    bit in sync mode); a second death fails naming the partition."""
    try:
        return run()
    except WorkerDiedError as first:
        warnings.warn(f"{owner}: {first.what}; relaunching the fit once", UserWarning, stacklevel=3)
    try:
        return run()
    except WorkerDiedError as again:
        raise WorkerDiedError(
            f"{owner} failed: a Spark Python worker died, the fit was relaunched once and a "
            f"worker died again; {again.message.removeprefix('the iteration failed: ')}",
            again.failures,
            again.partition,
            again.signal,
            again.exit_code,
            again.report,
            again.spark_message,
        ) from again
