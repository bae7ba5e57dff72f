"""The exception tree of spark_ops, in one place.

::

    SparkOpsError                                   every error spark_ops raises on purpose
    ├── SparkOpsConfigError (TypeError, ValueError) a bad argument (missing column, bad
    │   │                                           order, top_n(0), ...), raised on the
    │   │                                           driver before any Spark job starts
    │   ├── SparkOpsIndexError (IndexError)         a field index out of range
    │   ├── NonMergeableAggregateError              an aggregate without merge() where two
    │   │                                           phases need one
    │   └── SideInputConfigError                    a bad side-input argument (also a
    │       └── SideInputKeyError                   SideInputError); a keyed view whose key
    │                                               does not match the main input's
    ├── PartitionFunctionError (RuntimeError)       user code of a full-partition operation
    │                                               failed in a Spark task (names the
    │                                               operation, function, partition, key)
    └── SideInputError                              side inputs (FLIP-17)
        ├── SideInputConfigError                    (see above)
        ├── SideInputValueError (ValueError)        the side data holds more than the view
        │                                           allows (a key twice in a map, broadcast
        │                                           or keyed alike)
        ├── SideInputScopeError (LookupError)       a keyed view asked for another record's
        │                                           key (use a broadcast view for that)
        └── SideInputNotReadyError (TimeoutError)   main records waited longer than
                                                    ``ready_timeout``

The builtin bases stay, so ``except ValueError`` / ``except TypeError`` written for the
earlier, builtin errors still catches them. All of them pickle. An error raised in a
Spark task reaches the driver inside Spark's own exception (``PythonException``) with its
type name and message; ``spark_ops`` re-raises it as its own type where it runs the
action itself (streaming side inputs).
"""

from __future__ import annotations

__all__ = ["SparkOpsConfigError", "SparkOpsError", "SparkOpsIndexError"]


class SparkOpsError(Exception):
    """Base class of every error spark_ops raises on purpose."""


class SparkOpsConfigError(SparkOpsError, TypeError, ValueError):
    """An argument is wrong; the message names it and says how to fix it.

    Both a ``TypeError`` and a ``ValueError``: a wrong argument is caught by either (as
    the builtin errors spark_ops raised before were one or the other).
    """


class SparkOpsIndexError(SparkOpsConfigError, IndexError):
    """A field index is out of range."""


for _cls in (SparkOpsError, SparkOpsConfigError, SparkOpsIndexError):
    _cls.__module__ = "spark_ops"
