"""Every exception class of the coordinator package, rooted in ``HybridIterError``;
picklable.

This module imports neither pyspark nor Ray nor ``hybrid_iter``, so the coordinator
tier can raise them and ``hybrid_iter._errors`` re-exports the same classes (the whole
tree is drawn there). The modules that raise them import them from here; no other
module of the package defines an exception class (``tests/project/test_layout.py`` checks it).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CallTimeout",
    "CheckpointCorrupt",
    "CheckpointDamaged",
    "CheckpointEncodeError",
    "CheckpointError",
    "ConfigTypeError",
    "CoreError",
    "CutError",
    "EndpointAuthError",
    "EndpointBindError",
    "EndpointError",
    "EndpointVersionMismatch",
    "FeedbackShapeMismatch",
    "ForeignCheckpoint",
    "HybridIterError",
    "IterationConfigError",
    "MissingCheckpoint",
    "NonFiniteGradient",
    "NonFiniteVariables",
    "RemoteFailure",
    "SavedModelError",
    "SpareMisuse",
    "StaleShardCall",
    "StateMachineError",
    "UnpicklableOperator",
    "UsageError",
    "UserCodeFailed",
    "ValueEncodeError",
    "VariablesMismatchError",
]


class HybridIterError(Exception):
    """Base class of every error hybrid_iter and its coordinator raise on purpose."""


class IterationConfigError(HybridIterError, ValueError):
    """An argument is wrong; the message names it and says how to fix it."""


class ConfigTypeError(IterationConfigError, TypeError):
    """An argument of the wrong type (also a ``TypeError``, so ``except TypeError`` catches it)."""


class UsageError(HybridIterError, RuntimeError):
    """An API called where it cannot be (``out.criteria()`` without a criteria stream,
    ``LBFGS.tell()`` after the minimisation finished, ...)."""


class SpareMisuse(UsageError):
    """A spare actor's life-cycle call where it cannot be (``coordinator._spare``):
    ``configure`` of an actor that serves a run already, or of a spare Ray restarted."""


class EndpointError(HybridIterError, ConnectionError):
    """A subtask cannot talk to its coordinator's endpoint (unreachable, or it failed);
    the message names the address and the fix."""


class EndpointAuthError(EndpointError):
    """The coordinator endpoint refused the subtask's token."""


class EndpointVersionMismatch(EndpointError):
    """The subtask and the coordinator endpoint speak different protocol versions."""


class EndpointBindError(EndpointError):
    """An endpoint's server cannot listen where it is told (the port is taken, the host
    is not an address of its node, ...); the message names the cause found and the fix."""


class CheckpointError(HybridIterError):
    """A checkpoint cannot be written, found, read or trusted."""


class ValueEncodeError(HybridIterError, TypeError):
    """A value that must leave the process it was made in does not pickle (a lock, an
    open file, a generator, ...): a checkpoint's, or an output on its way from the
    coordinator to the driver's result. The message names the value (a variable, an
    output's tag and epoch, the state of which operator) and the fix. A relaunch would
    meet the same value, so it is not retried."""


class CheckpointEncodeError(CheckpointError, ValueEncodeError):
    """A value a checkpoint must hold cannot be encoded (``ValueEncodeError``)."""


class UnpicklableOperator(CheckpointEncodeError):
    """An operator without snapshot_state() that cannot be pickled into a checkpoint (or
    carried from one round job to the next)."""


class ForeignCheckpoint(CheckpointError, ValueError):
    """A checkpoint of another run (another run id or another fingerprint)."""


class MissingCheckpoint(CheckpointError, RuntimeError):
    """A restore did not find the checkpoint it must find (a node-local path?)."""


class CheckpointCorrupt(CheckpointError, ValueError):
    """A checkpoint or output file failed authentication or could not be read."""


class SavedModelError(HybridIterError, ValueError):
    """A saved model (``ps`` or ``ml``) that cannot be served as it was saved: a file its
    manifest lists is missing, truncated, altered, from another save or unparseable, a
    row count or a shape differs, a value is NaN or infinite; or a model holding such a
    value was asked to be saved. The message names the file, what differs and the fix."""


class CheckpointDamaged(CheckpointCorrupt):
    """A checkpoint or output file whose bytes changed after it was written (a flipped
    or lost byte, a truncation): told apart from a file sealed with another key. The
    message names the file, what is damaged and what to do."""


class VariablesMismatchError(HybridIterError, ValueError):
    """``publish_variables`` named a variable that does not exist or gave a wrong shape."""


class NonFiniteVariables(VariablesMismatchError):
    """``publish_variables`` with NaN or infinite values."""


class FeedbackShapeMismatch(VariablesMismatchError):
    """Partitions fed back arrays of different shapes (a sum would broadcast them); a
    relaunch would meet them again, so it is not retried."""


class CallTimeout(HybridIterError, RuntimeError):
    """A callback (or the coordinator) made no progress for ``call_timeout`` seconds; a
    relaunch would block in it again, so it is not retried. It reaches the driver as the
    ``cause`` of a ``RemoteFailure``."""


class NonFiniteGradient(NonFiniteVariables, FloatingPointError):
    """A gradient holding NaN or infinity, refused before any shard applied any of it:
    by the ``ps.train`` worker that computed it (which names the parameter and index),
    or by the shard a ``Sparse`` push reached. Not retried (a ``VariablesMismatchError``):
    the same parameters and data give the same gradient again."""


class StaleShardCall(HybridIterError, RuntimeError):
    """A call of a task whose launch is over: the shards were reset or restored since
    (or the shard was restarted and is not restored yet). Nothing of it was applied."""


# -- the coordinator's own bugs: an event its protocol does not allow, never user input --


class StateMachineError(HybridIterError, RuntimeError):
    """An event that the epoch state machine does not allow (a bug in the shell)."""


class CutError(HybridIterError, RuntimeError):
    """An event the cut protocol does not allow (a bug in the shell, not user input)."""


class CoreError(HybridIterError, RuntimeError):
    """An event the core does not take now (a bug in the shell, not user input)."""


class RemoteFailure(HybridIterError):
    """A failure of user code in a Spark task or in the coordinator actor.

    Carries where it happened (``source`` is a partition id or ``"coordinator"``), the
    epoch, the operator method, the original exception type name and message, and the
    formatted traceback of the original process. The original exception object is kept
    when it pickles (``cause``), so ``isinstance`` checks on it still work.
    """

    def __init__(
        self,
        source: int | str,
        epoch: int | None,
        where: str,
        type_name: str,
        message: str,
        traceback_text: str,
        cause: BaseException | None = None,
    ) -> None:
        self.source = source
        self.epoch = epoch
        self.where = where
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text
        self.cause = cause
        super().__init__(self._summary())

    def _summary(self) -> str:
        who = f"partition {self.source}" if isinstance(self.source, int) else str(self.source)
        at = f" at epoch {self.epoch}" if self.epoch is not None else ""
        return f"{who}{at} in {self.where}: {self.type_name}: {self.message}"

    def __reduce__(  # keep every field through pickling
        self,
    ) -> tuple[type[RemoteFailure], tuple[Any, ...]]:
        return (
            RemoteFailure,
            (
                self.source,
                self.epoch,
                self.where,
                self.type_name,
                self.message,
                self.traceback_text,
                self.cause,
            ),
        )

    @classmethod
    def capture(
        cls, exc: BaseException, *, source: int | str, epoch: int | None, where: str
    ) -> RemoteFailure:
        """Wrap ``exc`` (being handled now) with its traceback text."""
        import pickle
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        cause: BaseException | None = exc
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            cause = None
        return cls(source, epoch, where, type(exc).__name__, str(exc), text, cause)


# -- signals inside the coordinator: never raised to a user -------------------------------


class UserCodeFailed(Exception):
    """User code the operator host ran raised; ``failure`` says where and what. The
    actor and the online coordinator turn it into a failed iteration."""

    def __init__(self, failure: RemoteFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


class _FailureRecorded(Exception):
    """The core's flow unwinds: a user call (or a checkpoint write) failed and the core
    already recorded the failure."""
