"""The exception tree of hybrid_iter, in one place.

Where the classes live: every exception class of a package is defined in that package's
``_errors.py`` (``hybrid_iter/_errors.py``, ``coordinator/_errors.py``,
``spark_ops/_errors.py``, ``spark_ops/side_inputs/_errors.py``) and nowhere else;
``tests/project/test_layout.py`` fails on a class defined in another module. The modules that
raise them import them from there, and the public modules re-export them where users
import them (``hybrid_iter``, ``hybrid_iter.ps``, ``hybrid_iter.cli``,
``hybrid_iter.testing``, ``hybrid_iter.ml``, ``coordinator``, ``spark_ops``).

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
    │   ├── WorkerDiedError                  a Spark Python worker running a subtask died
    │   │                                    (killed, out of memory, a native crash): no
    │   │                                    exception of user code; the estimators and
    │   │                                    ``ps.train`` relaunch once
    │   └── TrainFailedError                 ``ps.train`` failed; ``params``: what the
    │                                        shards held when it stopped
    ├── SessionError (RuntimeError)          no session, or a session that cannot start
    │   └── SessionStoppedError              a DataFrame of a stopped SparkSession, given
    │                                        to an entry point (refused before any job)
    ├── StoredArraysLost (RuntimeError)      the array cache lost what a fit was to read
    │                                        (the fit reads from Spark instead)
    ├── UsageError (RuntimeError)            an API called where it cannot be
    │   │                                    (``out.criteria()`` without a criteria
    │   │                                    stream, ``LBFGS.tell()`` once finished)
    │   └── SpareMisuse                      ``configure`` of a spare actor that serves
    │                                        a run already, or that Ray restarted
    ├── VariablesMismatchError (ValueError)  publish_variables() with an unknown name or
    │   ├── NonFiniteVariables               a wrong shape, NaN/inf values; partitions
    │   │   └── NonFiniteGradient            feeding back arrays of different shapes
    │   │       (FloatingPointError)         (these arrive as the cause inside
    │   └── FeedbackShapeMismatch            IterationFailedError); a ps gradient with
    │                                        NaN/inf, refused before any shard applied it
    ├── ShardLost (RuntimeError)             a parameter shard's process ended under a
    │                                        ps task (the run relaunches and restores)
    ├── ShardsUnavailable (RuntimeError)     a restarted shard is not restored yet
    ├── StaleShardCall (RuntimeError)        a shard call of a launch that is over;
    │                                        nothing of it was applied
    ├── ModelExistsError (FileExistsError)   ``model.save(path)`` where a model is saved
    │                                        already (``overwrite=True`` replaces it)
    ├── ModelNotFoundError                   ``Model.load(path)`` of a path holding no
    │   (FileNotFoundError)                  saved model
    ├── SavedModelError (ValueError)         a saved model (``ps.load``, ``ml`` load) whose
    │                                        files are missing, truncated, altered, of
    │                                        another save, unparseable or not finite;
    │                                        names the file and the fix; nothing served
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
    │   │   │                                container format, under another file's name
    │   │   └── CheckpointDamaged            its bytes changed after it was written (a
    │   │                                    damaged header or body, a truncation), told
    │   │                                    apart from another key; says what to do
    │   ├── ForeignCheckpoint (ValueError)   of another run or another iteration
    │   ├── MissingCheckpoint (RuntimeError) a restore found less than was written
    │   └── OnlineCheckpointError            an online restart cannot restore every
    │       (RuntimeError)                   batch Spark committed
    ├── CallTimeout (RuntimeError)           a callback made no progress for
    │                                        call_timeout seconds (the cause inside
    │                                        IterationFailedError); not retried
    ├── StateMachineError, CutError,         the coordinator's epoch state machine, cut
    │   CoreError (RuntimeError)             protocol or core saw an event it does not
    │                                        allow (a bug, not user input)
    ├── RunStateError (RuntimeError)         the driver's run controller saw a move it
    │                                        does not allow (a bug, not user input)
    ├── InjectedFault (RuntimeError)         test-only: ``FaultInjection`` made a subtask
    │                                        fail (``hybrid_iter.testing`` re-exports it)
    ├── EndpointError (ConnectionError)      a subtask cannot use its coordinator's
    │   │                                    endpoint (unreachable, failed); names the
    │   │                                    address and the fix
    │   ├── EndpointAuthError                the endpoint refused the subtask's token
    │   ├── EndpointBindError                an endpoint's server cannot listen where it
    │   │                                    is told: the cause found (port taken, host
    │   │                                    not of its node, ...) and the fix
    │   └── EndpointVersionMismatch          subtask and coordinator protocol versions
    │                                        differ
    └── RemoteFailure                        one failure of user code, with where, epoch
                                             and the original traceback

    SparkOpsError                            root of the spark_ops errors (full-partition,
    ├── SparkOpsConfigError                  local aggregation, side inputs), re-exported
    ├── PartitionFunctionError               here; the whole tree is drawn in
    ├── UserFunctionError (PythonException)  ``spark_ops/_errors.py``. It is its own root
    ├── NonMergeableAggregateError           because spark_ops is usable without
    ├── UnsupportedSparkVersion              hybrid_iter.
    └── SideInputError

    ConvergenceWarning (UserWarning)         a fit stopped at ``max_iter`` before ``tol``
    UnverifiedModelWarning (UserWarning)     a saved model loaded without its digests
                                             checked (an older save, ``verify=False``)
    ClassArchiveWarning (UserWarning)        ``Session.local`` set a damaged JVM class
                                             archive aside (and goes on without it), or
                                             uses none in a folder others can change

    Signals that never reach a user (private to their tier): ``_Aborted`` (a subtask
    stops because another participant failed first), ``coordinator`` ``UserCodeFailed``
    (the operator host's user code raised; carries the RemoteFailure) and
    ``_FailureRecorded`` (the core's flow unwinds after recording a failure).

The classes the coordinator tier raises are defined in ``coordinator._errors``, which
imports neither pyspark nor hybrid_iter; this module re-exports the same classes, so
``hybrid_iter.HybridIterError`` is ``coordinator.HybridIterError``. The builtin bases
stay, so ``except ValueError`` / ``except TypeError`` / ``except RuntimeError`` catch
them as they catch the builtin errors. All of them pickle (they cross Spark and Ray
process boundaries).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator._errors import (
    CheckpointEncodeError,
    CheckpointError,
    ConfigTypeError,
    EndpointAuthError,
    EndpointBindError,
    EndpointError,
    EndpointVersionMismatch,
    HybridIterError,
    IterationConfigError,
    RemoteFailure,
    SavedModelError,
    UsageError,
    ValueEncodeError,
    VariablesMismatchError,
)
from spark_ops._errors import SparkOpsError, UserFunctionError

__all__ = [
    "CheckpointEncodeError",
    "CheckpointError",
    "ClassArchiveWarning",
    "CliError",
    "ConfigTypeError",
    "ConvergenceWarning",
    "DataValidationError",
    "EndpointAuthError",
    "EndpointBindError",
    "EndpointError",
    "EndpointVersionMismatch",
    "HybridIterError",
    "InjectedFault",
    "IterationConfigError",
    "IterationFailedError",
    "ModelExistsError",
    "ModelNotFoundError",
    "OnlineCheckpointError",
    "RemoteFailure",
    "RunStateError",
    "SavedModelError",
    "SessionError",
    "SessionStoppedError",
    "ShardLost",
    "ShardsUnavailable",
    "SparkOpsError",
    "StoredArraysLost",
    "TrainFailedError",
    "UnverifiedModelWarning",
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


class SessionStoppedError(SessionError):
    """A DataFrame whose SparkSession was stopped (the ``Session`` closed, or
    ``spark.stop()``) was given to an entry point: no Spark job can read it. Start a new
    session and read the data again with it."""


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

    @staticmethod
    def advice(signal: str | None) -> str:
        """What to do about a worker that died of ``signal`` (None: Spark did not say):
        memory is advised only where memory can be the cause."""
        if signal == "SIGBUS":
            return (
                "SIGBUS: it read memory mapped from a file that was cut short under it "
                "(a file in /dev/shm, where Ray's object store also lives, truncated by "
                "another process or a cleaner, or a full /dev/shm); more memory does not "
                "help: find what truncates or fills files there, and read the executor's log"
            )
        if signal in ("SIGSEGV", "SIGILL", "SIGFPE", "SIGABRT"):
            return (
                f"{signal}: it crashed in native code (a C extension the operator calls, a "
                f"library built for another CPU); more memory does not help: read the "
                f"executor's log for the native trace"
            )
        if signal is None:
            return (
                "the process was killed (from outside, by the out-of-memory killer or a "
                "container limit) or crashed in native code. If it recurs, give the "
                "executors more memory (spark.executor.memory, "
                "spark.executor.pyspark.memory), read the executor's log, and set "
                "spark.python.worker.faulthandler.enabled=true for Spark to report the "
                "signal of a crash"
            )
        if signal == "SIGKILL":
            return (
                "SIGKILL: it was killed from outside, by the out-of-memory killer or a "
                "container limit. If it recurs, give the executors more memory "
                "(spark.executor.memory, spark.executor.pyspark.memory) and read the "
                "executor's log (and the node's kernel log for the out-of-memory killer)"
            )
        return (
            f"{signal}: it was killed from outside (a scheduler preempting it, an "
            f"operator); read the executor's log"
        )

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


class OnlineCheckpointError(CheckpointError, RuntimeError):
    """The online checkpoint cannot restore every micro-batch Spark has committed; the
    message names the batch ids at risk and the choices."""

    def __init__(self, message: str, at_risk: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.at_risk = tuple(at_risk)

    def __reduce__(self):
        return (OnlineCheckpointError, (self.message, self.at_risk))


class ModelExistsError(HybridIterError, FileExistsError):
    """``model.save(path)`` where a saved model already is; also a ``FileExistsError``."""


class ModelNotFoundError(HybridIterError, FileNotFoundError):
    """``Model.load(path)`` of a path that holds no saved model; also a
    ``FileNotFoundError``."""


class TrainFailedError(IterationFailedError):
    """``ps.train`` failed (a ``IterationFailedError``: ``failures`` as there).

    ``params``: the parameters the shards held when the training stopped, in ``init``'s
    structure (tables as ``TableRef``: their shards are kept for it): every update
    applied before the failure and nothing of the step that failed (a step is checked
    whole on its worker before any shard receives a slice of it); None when a shard
    could not be read (it was lost)."""

    def __init__(
        self, message: str, failures: Mapping[int | str, BaseException], params: Any
    ) -> None:
        super().__init__(message, failures)
        self.params = params

    def __reduce__(self) -> tuple[type[TrainFailedError], tuple[Any, ...]]:
        return (TrainFailedError, (self.message, self.failures, self.params))


class ShardLost(HybridIterError, RuntimeError):
    """A parameter shard's process ended while a task called it; with checkpoints (or
    ``max_restarts``) the run is relaunched and the shards restored."""


class ShardsUnavailable(HybridIterError, RuntimeError):
    """The shards cannot serve this task yet (a restarted shard not restored)."""


class CliError(HybridIterError, ValueError):
    """A bad flag or environment variable; the message names it and the fix."""


class RunStateError(HybridIterError, RuntimeError):
    """A move the driver's run controller does not allow (a bug in the driver, not user
    input)."""


class InjectedFault(HybridIterError, RuntimeError):
    """Raised by ``FaultInjection(fail_partition=...)`` in a Spark task, for tests
    (re-exported by ``hybrid_iter.testing``, where tests import it)."""


class ClassArchiveWarning(UserWarning):
    """``Session.local`` set a damaged JVM class archive aside and started without it,
    or found the archive's folder open to others (docs/sessions.md)."""


class ConvergenceWarning(UserWarning):
    """A fit stopped at ``max_iter`` before meeting ``tol`` (a warning, not an error)."""


class UnverifiedModelWarning(UserWarning):
    """A saved model was loaded without checking its files against the digests of its
    save: it was written by an earlier hybrid_iter that recorded none, or
    ``ps.load(..., verify=False)`` was asked for. Save it again to get a verifiable copy."""


class _Aborted(Exception):
    """A subtask's signal inside its Spark task: the coordinator answered with another
    participant's failure, so the subtask stops without reporting a failure of its own."""
