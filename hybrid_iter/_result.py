"""What an iteration returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator import OutputRecord

__all__ = ["IterationResult"]


@dataclass(frozen=True)
class IterationResult:
    """The end state of a bounded iteration.

    * ``variables``: the newest published version of every variable.
    * ``outputs``: ``tag -> [value, ...]`` in emission order (both tiers);
      ``output_records`` has each record's epoch and source (partition id or
      ``"coordinator"``).
    * ``epochs``: epochs completed by every subtask (the last global alignment).
    * ``terminated_by``: ``"criteria"``, ``"no_feedback"`` or ``"max_epochs"``.
    * ``epoch_seconds``: wall time between consecutive global alignments.
    * ``subtask_epochs``: epochs each subtask ran (async: fast ones run more);
      ``feedback_counts``: feedback records of each subtask that the coordinator applied
      (async: a record that arrives after termination is not applied).
    """

    variables: Mapping[str, np.ndarray]
    outputs: Mapping[str, list[Any]]
    output_records: list[OutputRecord]
    epochs: int
    terminated_by: str
    epoch_seconds: list[float]
    subtask_epochs: Mapping[int, int]
    feedback_counts: Mapping[int, int]
    rows: list[int]
    num_partitions: int
    mode: str
    seconds: float
    load_seconds: float
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def seconds_per_epoch(self) -> float | None:
        """Median wall time of one epoch (None when no epoch completed)."""
        return float(np.median(self.epoch_seconds)) if self.epoch_seconds else None

    def outputs_of(self, tag: str, *, source: int | str | None = None) -> list[Any]:
        """Values of ``tag``, optionally only those of one source."""
        return [
            r.value
            for r in self.output_records
            if r.tag == tag and (source is None or r.source == source)
        ]

    def summary(self) -> str:
        spe = self.seconds_per_epoch
        loss = self.outputs.get("loss")
        parts = [
            f"{self.mode} iteration over {sum(self.rows):,} rows on {self.num_partitions} partitions",
            f"{self.epochs} epochs, terminated by {self.terminated_by}",
            f"{spe * 1000:.1f} ms/epoch (median)" if spe is not None else "no epoch timings",
            f"total {self.seconds:.2f} s (load {self.load_seconds:.2f} s)",
        ]
        if loss:
            parts.insert(2, f"final loss {float(loss[-1]):.6g}")
        return "; ".join(parts)
