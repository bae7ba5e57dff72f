"""The exception tree of hybrid_iter, in one place.

::

    HybridIterError
    ├── IterationConfigError (ValueError)  bad arguments, raised before any job starts:
    │                                      config fields, streams, variables, task slots
    ├── DataValidationError (ValueError)   bad data met while loading it (nulls, non-numeric
    │                                      values, an empty stream); nothing was trained
    ├── IterationFailedError (RuntimeError) user code failed in a Spark task or in the
    │                                      coordinator; ``failures`` maps the partition id
    │                                      (or "coordinator") to a RemoteFailure with the
    │                                      original traceback
    └── SessionError (RuntimeError)        no session, or a session that cannot start

    RemoteFailure               one failure of user code, with where/epoch/traceback
    VariablesMismatchError      publish_variables() with an unknown name or wrong shape
                                (arrives as the cause inside IterationFailedError)

    SparkOpsError                   root of the spark_ops errors (full-partition, local
    ├── SparkOpsConfigError         aggregation, side inputs), re-exported here; the
    ├── PartitionFunctionError      whole tree is drawn in ``spark_ops/_errors.py``
    ├── NonMergeableAggregateError  (bad arguments are still TypeError / ValueError)
    └── SideInputError

All of them pickle (they cross Spark and Ray process boundaries).
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator import RemoteFailure, VariablesMismatchError
from spark_ops import SparkOpsError

__all__ = [
    "DataValidationError",
    "HybridIterError",
    "IterationConfigError",
    "IterationFailedError",
    "RemoteFailure",
    "SessionError",
    "SparkOpsError",
    "VariablesMismatchError",
]


class HybridIterError(Exception):
    """Base class of every error hybrid_iter raises on purpose."""


class IterationConfigError(HybridIterError, ValueError):
    """An argument is wrong; the message names it and says how to fix it."""


class DataValidationError(HybridIterError, ValueError):
    """The data cannot be iterated over (found while loading it, before epoch 0)."""


class SessionError(HybridIterError, RuntimeError):
    """No usable Spark + Ray session."""


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
