"""The runtime's hook points: where tests attach faults and simulated stragglers.

The runtime calls a ``RuntimeHooks`` object at a few named points and does nothing else
with it; the default is no hooks at all (``None``). The concrete actions (a process that
exits, an injected exception, a sleep) live in ``hybrid_iter.testing``, never on a
product code path. A hooks object travels to Spark tasks and into the Ray coordinator
actor, so it must pickle and hold only plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["RuntimeHooks"]


class RuntimeHooks:
    """Base class with no-op hooks; override what a test needs.

    Each docstring says which process calls it. A hook may raise (the runtime treats it
    as a failure at that point) or end its process (a crash at that point).
    """

    def at_alignment(self, epoch: int, *, attempt: int | None, restarted: bool) -> None:
        """Ray coordinator actor: global alignment ``epoch`` has just completed (before
        the checkpoint it may start). ``attempt`` is the stage launch the actor serves;
        ``restarted`` is True in an actor Ray restarted after its process died."""

    def before_watermark(self, partition: int, epoch: int, attempt: int) -> None:
        """Spark task: subtask ``partition`` is about to run its watermark callbacks of
        ``epoch`` on launch ``attempt`` of the stage (0 first, retries count up)."""

    def after_epoch_compute(self, partition: int, seconds: float) -> None:
        """Spark task (the ``hybrid_iter.ml`` estimators): subtask ``partition`` spent
        ``seconds`` computing this epoch's feedback (loading excluded)."""

    def after_array_lookup(self, store: Any) -> None:
        """Driver (the ``hybrid_iter.ml`` estimators): a fit has decided to read arrays
        the array cache kept; ``store`` is the cache's Ray actor handle. The fit's tasks
        have not read yet."""

    def after_publish(self, epoch: int, variables: Mapping[str, Any]) -> None:
        """Ray coordinator actor: the coordinator operator has just published
        ``variables`` (a new version) at ``epoch``; the arrays are the operator's, not a
        copy (read them, do not keep or change them)."""

    def after_batch(self, batch_id: int, *, resumed: bool) -> None:
        """Driver (``iterate_unbounded_streams``): micro-batch ``batch_id`` is committed
        to our checkpoint, not yet by Spark. ``resumed``: this query restored state."""
