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
    ├── UserFunctionError (pyspark's                a user function of spark_ops raised in a
    │   PythonException, RuntimeError)              Spark task: what the action raises on
    │                                               the driver (see below)
    ├── PartitionFunctionError (RuntimeError)       the same failure of a full-partition
    │                                               operation, inside the task
    ├── UnsupportedSparkVersion (RuntimeError)      the installed PySpark is outside the
    │                                               supported lines; before any job
    └── SideInputError                              side inputs (FLIP-17)
        ├── SideInputConfigError                    (see above)
        ├── SideInputValueError (ValueError)        the side data holds more than the view
        │                                           allows (a key twice in a map, broadcast
        │                                           or keyed alike)
        ├── SideInputScopeError (LookupError)       a keyed view asked for another record's
        │                                           key (use a broadcast view for that)
        └── SideInputNotReadyError (TimeoutError)   main records waited longer than
                                                    ``ready_timeout``

Every class is defined here (the side-input ones in ``side_inputs/_errors.py``) and
re-exported where users import it; ``tests/project/test_layout.py`` fails on an exception class
defined anywhere else. The builtin bases stay, so ``except ValueError`` / ``except
TypeError`` catch them as they catch the builtin errors. All of them pickle.

User functions that raise. Every operation that runs user code in Spark tasks
(``map_partition``, ``sort_partition``'s key function, ``aggregate`` and ``reduce`` of
``full_partition``, keyed or not, with ``open``/``close``; ``local_key_by(...)``'s
``aggregate``/``reduce``/ufunc; the functions of ``with_side_inputs(...)``, bounded or
streaming) returns a lazy DataFrame: the user's own action (``collect``, ``count``, a
write) runs the job, so the error cannot be raised by a spark_ops call. Instead the task
adds one line to its error, ``spark_ops-user-function-failure: {json}`` (operation,
function, partition, key, the exception's type with its bases, message and the
function's traceback), and spark_ops wraps pyspark's ``convert_exception`` (installed
once, on import): a ``PythonException`` carrying that line becomes a
``UserFunctionError``. Any other error is left exactly as pyspark converts it.

Why a subclass of pyspark's ``PythonException`` rather than a new error raised from it:
code written for pyspark (``except PythonException``) keeps working, and ``except
SparkOpsError`` catches the failure too. The user's own exception class is not
re-created on the driver (it may not be importable there); ``err.exception_type`` names
it, ``err.raised(MyError)`` tests it, bases included. Not covered: Spark Connect
sessions (pyspark converts their errors elsewhere), and a streaming query's failure,
which stays pyspark's ``StreamingQueryException`` (its text carries the same line).
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Sequence
from typing import Any

from pyspark.errors import PythonException

__all__ = [
    "NonMergeableAggregateError",
    "PartitionFunctionError",
    "SparkOpsConfigError",
    "SparkOpsError",
    "SparkOpsIndexError",
    "UnsupportedSparkVersion",
    "UserFunctionError",
    "failure_line",
    "install_error_translation",
    "user_traceback",
]


class SparkOpsError(Exception):
    """Base class of every error spark_ops raises on purpose."""


class SparkOpsConfigError(SparkOpsError, TypeError, ValueError):
    """An argument is wrong; the message names it and says how to fix it.

    Both a ``TypeError`` and a ``ValueError``: a wrong argument is caught by either,
    whichever a caller expects of a bad type or a bad value.
    """


class SparkOpsIndexError(SparkOpsConfigError, IndexError):
    """A field index is out of range."""


class NonMergeableAggregateError(SparkOpsConfigError):
    """The aggregate cannot be merged, so it cannot run in two phases."""


class UnsupportedSparkVersion(SparkOpsError, RuntimeError):
    """The installed PySpark is outside the supported lines (the message names it and
    the fix); raised before any Spark job."""


class PartitionFunctionError(SparkOpsError, RuntimeError):
    """User code of a full-partition operation failed in a Spark task.

    Raised in the task; on the driver the action raises ``spark_ops.UserFunctionError``
    (a pyspark ``PythonException``) with the operation, function, partition id, key and
    the user's traceback.
    """


PartitionFunctionError.__module__ = "spark_ops.full_partition"  # where users import it


class UserFunctionError(SparkOpsError, PythonException, RuntimeError):
    """A user function of a spark_ops operation raised in a Spark task: what the Spark
    action raises on the driver. Also pyspark's ``PythonException``.

    ``operation`` (``"map_partition"``, ``"local_key_by('k').aggregate(Mean())"``, ...),
    ``function`` (its name), ``partition`` (the Spark partition id), ``key`` (the key's
    repr, keyed operations), ``exception_type`` (``module.QualName`` of what the function
    raised) and ``exception_types`` (with its bases), ``exception_message``,
    ``traceback_text`` (the function's frames) and ``spark_message`` (pyspark's whole
    text, the Python worker's traceback included).
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str = "",
        function: str = "",
        partition: int | None = None,
        key: str | None = None,
        exception_type: str = "",
        exception_types: Sequence[str] = (),
        exception_message: str = "",
        traceback_text: str = "",
        spark_message: str = "",
    ) -> None:
        super().__init__(message)
        self._text = message
        self.operation = operation
        self.function = function
        self.partition = partition
        self.key = key
        self.exception_type = exception_type
        self.exception_types = tuple(exception_types)
        self.exception_message = exception_message
        self.traceback_text = traceback_text
        self.spark_message = spark_message

    def raised(self, exc_type: type[BaseException] | str) -> bool:
        """Whether the function raised an ``exc_type`` (a class, or its qualified or
        plain name), subclasses included."""
        if isinstance(exc_type, str):
            return any(exc_type in (t, t.rsplit(".", 1)[-1]) for t in self.exception_types)
        return _qualified(exc_type) in self.exception_types

    def __str__(self) -> str:
        return self._text

    def __reduce__(self) -> Any:
        fields = {
            "operation": self.operation,
            "function": self.function,
            "partition": self.partition,
            "key": self.key,
            "exception_type": self.exception_type,
            "exception_types": self.exception_types,
            "exception_message": self.exception_message,
            "traceback_text": self.traceback_text,
            "spark_message": self.spark_message,
        }
        return (_rebuild_user_function_error, (self._text, fields))


def _rebuild_user_function_error(message: str, fields: dict[str, Any]) -> UserFunctionError:
    return UserFunctionError(message, **fields)


for _cls in (SparkOpsError, SparkOpsConfigError, SparkOpsIndexError, UserFunctionError):
    _cls.__module__ = "spark_ops"

# -- the task side: one line the driver reads back --------------------------------------------

_MARKER = "spark_ops-user-function-failure: "
_LIMIT = 20_000  # characters of a message or a traceback carried in the line
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _qualified(cls: type) -> str:
    """``module.QualName`` without any ``<locals>`` part: a class defined in a function
    and shipped by value (cloudpickle) has the short form in the task and the long one
    on the driver."""
    return f"{cls.__module__}.{cls.__qualname__.rsplit('<locals>.', 1)[-1]}"


def user_traceback(ex: BaseException) -> str:
    """``ex``'s traceback from the first frame outside spark_ops (the user's code)."""
    tb = ex.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(
        _PACKAGE + os.sep
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(ex), ex, tb or ex.__traceback__)).rstrip()


def failure_line(
    headline: str,
    ex: BaseException,
    *,
    operation: str,
    function: str,
    partition: int,
    key: str | None = None,
    traceback_text: str | None = None,
) -> str:
    """The line a Spark task appends to the message of the error it raises when the
    user's function raised ``ex``; the driver turns it into a ``UserFunctionError``
    whose message is ``headline`` and the function's traceback. Runs in the task."""
    record = {
        "headline": headline[:_LIMIT],
        "operation": operation,
        "function": function,
        "partition": partition,
        "key": key,
        "type": _qualified(type(ex)),
        "types": [_qualified(c) for c in type(ex).__mro__ if c not in (BaseException, object)],
        "message": str(ex)[:_LIMIT],
        "traceback": (user_traceback(ex) if traceback_text is None else traceback_text)[-_LIMIT:],
    }
    return _MARKER + json.dumps(record, ensure_ascii=True, default=repr)


# -- the driver side: pyspark's converted error, read back ------------------------------------


def from_spark_text(text: str) -> UserFunctionError | None:
    """The ``UserFunctionError`` the (last) failure line in ``text`` describes, if any."""
    at = text.rfind(_MARKER)
    if at < 0:
        return None
    line = text[at + len(_MARKER) :].split("\n", 1)[0]
    try:
        record = json.loads(line)
        headline = str(record["headline"])
    except (ValueError, KeyError, TypeError):
        return None  # not one of ours after all: leave pyspark's error as it is
    tb = str(record.get("traceback") or "")
    message = f"{headline}\n--- the function's traceback:\n{tb}" if tb else headline
    partition = record.get("partition")
    return UserFunctionError(
        message,
        operation=str(record.get("operation", "")),
        function=str(record.get("function", "")),
        partition=partition if isinstance(partition, int) else None,
        key=record.get("key"),
        exception_type=str(record.get("type", "")),
        exception_types=[str(t) for t in record.get("types", ())],
        exception_message=str(record.get("message", "")),
        traceback_text=tb,
        spark_message=text,
    )


def install_error_translation() -> None:
    """Make pyspark's conversion of a failed job's error (``_spark_compat``) turn a
    ``PythonException`` (or an unclassified error) carrying a failure line into a
    ``UserFunctionError``; anything else is returned unchanged. Runs on the driver, once,
    on import (idempotent)."""
    from ._spark_compat import translate_converted_errors

    translate_converted_errors(_translated)


def _translated(converted: Any) -> Any:
    """``converted`` (pyspark's exception of a failed job) as a ``UserFunctionError``
    when a user function of ours raised in it, else None."""
    from pyspark.errors.exceptions import captured

    if not isinstance(converted, (PythonException, captured.UnknownException)):
        return None
    try:
        text = getattr(converted, "desc", None) or str(converted)
    except Exception:  # pyspark could not render it: leave it as it is
        return None
    return from_spark_text(text)
