"""The errors side inputs raise (the whole spark_ops tree is drawn in ``_errors``).

::

    SideInputError (a spark_ops.SparkOpsError)
    ├── SideInputConfigError (TypeError, ValueError)  a bad argument, raised on the driver
    │   │                                             before any Spark job starts
    │   └── SideInputKeyError                         a keyed view whose key does not match
    │                                                 the main input's key (arity or type)
    ├── SideInputValueError (ValueError)              the side data holds more than the view
    │                                                 allows: two values for a singleton, a
    │                                                 key twice in one version of a map
    ├── SideInputScopeError (LookupError)             a keyed view asked for another
    │                                                 record's key: use a broadcast view
    └── SideInputNotReadyError (TimeoutError)         main records waited longer than
                                                      ``ready_timeout`` for a side input

All of them pickle (a ``SideInputValueError`` found in a Spark task crosses to the driver
inside Spark's own exception, with its message intact).
"""

from __future__ import annotations

from .._errors import SparkOpsConfigError, SparkOpsError

__all__ = [
    "SideInputConfigError",
    "SideInputError",
    "SideInputKeyError",
    "SideInputNotReadyError",
    "SideInputScopeError",
    "SideInputValueError",
]


class SideInputError(SparkOpsError):
    """Base class of every error side inputs raise on purpose."""


class SideInputConfigError(SideInputError, SparkOpsConfigError):
    """An argument is wrong; the message names it and says how to fix it.

    Both a ``TypeError`` and a ``ValueError`` (as numpy's ``AxisError`` is both an
    ``IndexError`` and a ``ValueError``): a wrong argument is caught by either.
    """


class SideInputKeyError(SideInputConfigError):
    """A keyed view's key does not match the main input's key."""


class SideInputValueError(SideInputError, ValueError):
    """The side data holds more values than the view allows."""


class SideInputScopeError(SideInputError, LookupError):
    """A keyed view was asked for a key other than the current record's: a keyed side
    input lives in keyed state (FLIP-17), so a record sees only its own key's entries."""


class SideInputNotReadyError(SideInputError, TimeoutError):
    """Main records waited longer than ``ready_timeout`` for a side input's first data."""

    def __init__(self, message: str, views: tuple[str, ...] = (), waited: float = 0.0) -> None:
        super().__init__(message)
        self.message = message
        self.views = tuple(views)
        self.waited = float(waited)

    def __reduce__(self):
        return (SideInputNotReadyError, (self.message, self.views, self.waited))
