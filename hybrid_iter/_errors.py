"""The exception tree of hybrid_iter, in one place.

::

    HybridIterError                          every error hybrid_iter and its coordinator
    │                                        raise on purpose
    ├── IterationConfigError (ValueError)    bad arguments, raised before any job starts:
    │   │                                    config fields, streams, variables, task
    │   │                                    slots, estimator and ps parameters
    │   └── ConfigTypeError (TypeError)      an argument of the wrong type (variables
    │                                        that are not numeric, ``out.output(tag)``
    │                                        with a bad tag, a grad_fn's bad return)
    ├── CliError (ValueError)                ``hybrid-iter run``: a bad flag or env var
    ├── DataValidationError (ValueError)     bad data met while loading it (nulls,
    │                                        non-numeric values, an empty stream);
    │                                        nothing was trained
    ├── IterationFailedError (RuntimeError)  user code failed in a Spark task or in the
    │   │                                    coordinator; ``failures`` maps the partition
    │   │                                    id (or "coordinator") to a RemoteFailure
    │   └── WorkerDiedError                  a Spark Python worker running a subtask died
    │                                        (killed, out of memory, a native crash): no
    │                                        exception of user code; the estimators and
    │                                        ``ps.train`` relaunch once
    ├── SessionError (RuntimeError)          no session, or a session that cannot start
    ├── StoredArraysLost (RuntimeError)      the array cache lost what a fit was to read
    │                                        (the fit reads from Spark instead)
    ├── UsageError (RuntimeError)            an API called where it cannot be
    │                                        (``out.criteria()`` without a criteria
    │                                        stream, ``LBFGS.tell()`` once finished)
    ├── VariablesMismatchError (ValueError)  publish_variables() with an unknown name or
    │   ├── NonFiniteVariables               a wrong shape, NaN/inf values; partitions
    │   └── FeedbackShapeMismatch            feeding back arrays of different shapes
    │                                        (these arrive as the cause inside
    │                                        IterationFailedError)
    ├── ModelExistsError (FileExistsError)   ``model.save(path)`` where a model is saved
    │                                        already (``overwrite=True`` replaces it)
    ├── ModelNotFoundError                   ``Model.load(path)`` of a path holding no
    │   (FileNotFoundError)                  saved model
    ├── ValueEncodeError (TypeError)         a value that must leave its process does
    │                                        not pickle: an output on its way to the
    │                                        driver; names it; not retried
    ├── CheckpointError                      a checkpoint cannot be written, found, read,
    │   │                                    trusted
    │   ├── CheckpointEncodeError            a value a checkpoint must hold does not
    │   │   │ (ValueEncodeError)             pickle; names it (variable, output tag and
    │   │   │                                epoch, which operator's state); not retried
    │   │   └── UnpicklableOperator          an operator a checkpoint cannot pickle
    │   ├── CheckpointCorrupt (ValueError)   failed authentication, truncated, an older
    │   │                                    container format
    │   ├── ForeignCheckpoint (ValueError)   of another run or another iteration
    │   ├── MissingCheckpoint (RuntimeError) a restore found less than was written
    │   └── OnlineCheckpointError            an online restart cannot restore every
    │       (RuntimeError)                   batch Spark committed
    ├── CallTimeout (RuntimeError)           a callback made no progress for
    │                                        call_timeout seconds (the cause inside
    │                                        IterationFailedError); not retried
    ├── CutError (RuntimeError)              the coordinator's cut protocol saw an event
    │                                        it does not allow (a bug, not user input)
    └── RemoteFailure                        one failure of user code, with where, epoch
                                             and the original traceback

    SparkOpsError                            root of the spark_ops errors (full-partition,
    ├── SparkOpsConfigError                  local aggregation, side inputs), re-exported
    ├── PartitionFunctionError               here; the whole tree is drawn in
    ├── UserFunctionError (PythonException)  ``spark_ops/_errors.py``. It is its own root
    ├── NonMergeableAggregateError           because spark_ops is usable without
    └── SideInputError                       hybrid_iter.

The classes the coordinator tier raises are defined in ``coordinator._errors`` (and next
to the code that raises them in ``coordinator``), which imports neither pyspark nor
hybrid_iter; this module re-exports the same classes, so ``hybrid_iter.HybridIterError``
is ``coordinator.HybridIterError``. The builtin bases stay, so ``except ValueError`` /
``except TypeError`` / ``except RuntimeError`` written for the earlier, builtin errors
still catches them. Test-only errors (``InjectedFault``) live in ``hybrid_iter.testing``.
All of them pickle (they cross Spark and Ray process boundaries).
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator import (
    CheckpointEncodeError,
    CheckpointError,
    ConfigTypeError,
    HybridIterError,
    IterationConfigError,
    RemoteFailure,
    UsageError,
    ValueEncodeError,
    VariablesMismatchError,
)
from spark_ops import SparkOpsError, UserFunctionError

__all__ = [
    "CheckpointEncodeError",
    "CheckpointError",
    "ConfigTypeError",
    "DataValidationError",
    "HybridIterError",
    "IterationConfigError",
    "IterationFailedError",
    "ModelExistsError",
    "ModelNotFoundError",
    "RemoteFailure",
    "SessionError",
    "SparkOpsError",
    "StoredArraysLost",
    "UsageError",
    "UserFunctionError",
    "ValueEncodeError",
    "VariablesMismatchError",
    "WorkerDiedError",
]


class DataValidationError(HybridIterError, ValueError):
    """The data cannot be iterated over (found while loading it, before epoch 0)."""


class SessionError(HybridIterError, RuntimeError):
    """No usable Spark + Ray session."""


class StoredArraysLost(HybridIterError, RuntimeError):
    """Arrays the array cache kept from an earlier fit are gone (the store actor or a
    node lost); ``hybrid_iter.ml`` then reads the DataFrame from Spark again."""


class IterationFailedError(HybridIterError, RuntimeError):
    """User code failed; ``failures`` maps partition id or "coordinator" to the failure."""

    def __init__(self, message: str, failures: Mapping[int | str, BaseException]) -> None:
        self.failures = dict(failures)
        details = "\n".join(
            f"--- {k}: {v}\n{getattr(v, 'traceback_text', '')}".rstrip()
            for k, v in self.failures.items()
        )
        super().__init__(f"{message}\n{details}" if details else message)
        self.message = message

    def __reduce__(self):
        return (IterationFailedError, (self.message, self.failures))


class WorkerDiedError(IterationFailedError):
    """A Spark Python worker running a subtask died: killed from outside, by the
    out-of-memory killer or a container limit, or crashed in native code; no exception
    of user code. ``partition``: the subtask (None when Spark did not name it);
    ``signal`` / ``exit_code``: when Spark's report gives them; ``report``: Spark's words
    in one line; ``spark_message``: Spark's own report, JVM trace included (the Spark
    error is also the ``__cause__``). The ``hybrid_iter.ml`` estimators and ``ps.train``
    relaunch once on it: a relaunch reads the same data and gives the same model."""

    def __init__(
        self,
        message: str,
        failures: Mapping[int | str, BaseException],
        partition: int | None = None,
        signal: str | None = None,
        exit_code: int | None = None,
        report: str = "",
        spark_message: str = "",
    ) -> None:
        super().__init__(message, failures)
        self.partition = partition
        self.signal = signal
        self.exit_code = exit_code
        self.report = report
        self.spark_message = spark_message

    @property
    def what(self) -> str:
        """One line: which worker died, and how Spark said it."""
        return self.describe(self.partition, self.signal, self.exit_code, self.report)

    @staticmethod
    def describe(
        partition: int | None, signal: str | None, exit_code: int | None, report: str
    ) -> str:
        who = "a subtask" if partition is None else f"partition {partition}"
        how = f" of {signal}" if signal else ""
        if exit_code is not None:
            how += f" (exit code {exit_code})"
        return f"the Spark Python worker running {who} died{how}; Spark said {report!r}"

    def __reduce__(self):
        return (
            WorkerDiedError,
            (
                self.message,
                self.failures,
                self.partition,
                self.signal,
                self.exit_code,
                self.report,
                self.spark_message,
            ),
        )


class ModelExistsError(HybridIterError, FileExistsError):
    """``model.save(path)`` where a saved model already is; also a ``FileExistsError``."""


class ModelNotFoundError(HybridIterError, FileNotFoundError):
    """``Model.load(path)`` of a path that holds no saved model; also a
    ``FileNotFoundError``."""
