"""Iteration configuration: a frozen, keyword-only dataclass validated on creation."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._errors import IterationConfigError

__all__ = ["IterationConfig", "OperatorLifecycle"]


class OperatorLifecycle(str, enum.Enum):
    """How long an operator instance lives (FLIP-176)."""

    #: One instance per subtask for the whole iteration (the default).
    ALL_ROUND = "all_round"
    #: A fresh instance per epoch; needs every stream it reads to be replayed.
    PER_ROUND = "per_round"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class IterationConfig:
    """How an iteration runs.

    * ``staleness``: ``0`` is sync (global lock step), ``None`` is async (no subtask ever
      waits for another), ``k > 0`` is stale-synchronous (no subtask more than ``k``
      epochs ahead of the slowest).
    * ``max_epochs``: no subtask runs epoch ``max_epochs`` or later; the iteration ends
      at the global alignment of that epoch (``terminated_by == "max_epochs"``).
    * ``parallelism``: the number of subtasks (Spark tasks of the barrier stage);
      ``None`` takes every task slot Spark has.
    * ``operator_lifecycle``: ``ALL_ROUND`` or ``PER_ROUND``.
    * ``progress``: print a live line per epoch (epoch, loss, seconds/epoch); ``None``
      prints only when standard error is a terminal.
    * ``progress_tag``: the output tag whose newest value the progress line shows.
    * ``inline_variables_bytes``: variable versions up to this size travel inside the
      reply to each subtask; larger ones go through the Ray object store once per
      version and are read zero-copy.
    """

    staleness: int | None = 0
    max_epochs: int | None = None
    parallelism: int | None = None
    operator_lifecycle: OperatorLifecycle = OperatorLifecycle.ALL_ROUND
    progress: bool | None = None
    progress_tag: str = "loss"
    inline_variables_bytes: int = 64 * 1024
    name: str | None = None

    def __post_init__(self) -> None:
        if self.staleness is not None and (not _is_int(self.staleness) or self.staleness < 0):
            raise IterationConfigError(
                f"IterationConfig.staleness must be 0 (sync), None (async) or a positive "
                f"int (bounded staleness), got {self.staleness!r}"
            )
        if self.max_epochs is not None and (not _is_int(self.max_epochs) or self.max_epochs < 1):
            raise IterationConfigError(
                f"IterationConfig.max_epochs must be None or an int >= 1, got {self.max_epochs!r}"
            )
        if self.parallelism is not None and (not _is_int(self.parallelism) or self.parallelism < 1):
            raise IterationConfigError(
                f"IterationConfig.parallelism must be None (use every task slot) or an "
                f"int >= 1, got {self.parallelism!r}"
            )
        try:
            lifecycle = OperatorLifecycle(self.operator_lifecycle)
        except ValueError:
            raise IterationConfigError(
                f"IterationConfig.operator_lifecycle must be OperatorLifecycle.ALL_ROUND or "
                f"PER_ROUND, got {self.operator_lifecycle!r}"
            ) from None
        object.__setattr__(self, "operator_lifecycle", lifecycle)
        if self.progress is not None and not isinstance(self.progress, bool):
            raise IterationConfigError(
                f"IterationConfig.progress must be True, False or None, got {self.progress!r}"
            )
        if not isinstance(self.progress_tag, str) or not self.progress_tag:
            raise IterationConfigError("IterationConfig.progress_tag must be a non-empty string")
        if not _is_int(self.inline_variables_bytes) or self.inline_variables_bytes < 0:
            raise IterationConfigError("IterationConfig.inline_variables_bytes must be an int >= 0")

    @property
    def mode(self) -> str:
        """``"sync"``, ``"async"`` or ``"ssp"``."""
        if self.staleness == 0:
            return "sync"
        return "async" if self.staleness is None else "ssp"
