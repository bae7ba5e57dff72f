"""The driver's side of ``IterationBody(feedback_combine=...)``: its checks, and the
``TreeSpec`` the coordinator and the tasks receive.

Runs on the driver, before any Spark job: the combiner must be a supported name or an
object with ``merge(a, b)``, the iteration must be sync, and the combiner must pickle.
The tree itself (the combining, the aggregator actors) is ``coordinator._tree``.
"""

from __future__ import annotations

from typing import Any

from coordinator._tree import TreeSpec

from .._errors import IterationConfigError
from .shipping import dumps

__all__ = ["tree_spec"]


def tree_spec(body: Any, staleness: int | None) -> TreeSpec | None:
    """The ``TreeSpec`` of ``body`` (None without ``feedback_combine``)."""
    if body.feedback_combine is None:
        return None
    if staleness != 0:
        mode = "async (staleness=None)" if staleness is None else f"SSP (staleness={staleness})"
        raise IterationConfigError(
            f"IterationBody(feedback_combine=...) merges each epoch's feedback of every "
            f"partition before the coordinator sees it, which needs a sync iteration; this one "
            f"is {mode}. Use IterationConfig(staleness=0), or leave feedback_combine unset "
            f"(async and SSP apply each partition's feedback as it arrives)"
        )
    blob = dumps(body.feedback_combine, "IterationBody(feedback_combine=...)")
    return TreeSpec(blob, body.feedback_fan_in)
