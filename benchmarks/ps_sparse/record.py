"""A contender's run at one D (``Run``: its epochs, its step and pass times, what it
moved, its processes) and the accounting every runner shares."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .config import BATCH
from .data import Data


def working_memory(contender: str, procs: dict[str, Any] | None) -> tuple[float | None, str]:
    """The peak memory of the processes doing a contender's work (MB) and which: the
    driver's growth for in-driver ones, the shards and Spark's Python workers for
    ``ps.train``, the JVM (its heap is not returned: the largest since it started) for
    MLlib."""
    roles = (procs or {}).get("by_role") or {}
    if not roles:
        return None, "not measured"
    if contender in ("numpy", "sklearn_sgd"):
        d = roles.get("driver") or {}
        grew = d.get("peak_rss_mb", 0.0) - d.get("start_rss_mb", 0.0)
        return grew, "driver peak RSS minus its RSS at the start"
    if contender.startswith("ps_"):
        mb = sum(
            (roles.get(r) or {}).get("sum_peak_rss_mb", 0.0) for r in ("ps_shards", "spark_python")
        )
        return mb, "sum of the peak RSS of the shards and of Spark's Python workers"
    return (roles.get("spark_jvm") or {}).get("peak_rss_mb", 0.0), "the Spark JVM's peak RSS"


@dataclass
class Run:
    """One contender at one D: per epoch (or fit) the cumulative training seconds and
    the held-out metrics; the rest of its accounting."""

    contender: str
    dim: Any
    epochs: list[dict[str, Any]] = field(default_factory=list)
    ms_per_step: float | None = None
    ms_per_pass: float | None = None
    bytes_per_step: float | None = None
    bytes_how: str | None = None
    procs: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_json(self, target: float | None) -> dict[str, Any]:
        reached = (
            [e for e in self.epochs if e.get("log_loss") is not None and e["log_loss"] <= target]
            if target is not None
            else []
        )
        losses = [e["log_loss"] for e in self.epochs if e.get("log_loss") is not None]
        return {
            "contender": self.contender,
            "dim": self.dim,
            "dim_log2": int(math.log2(self.dim)) if isinstance(self.dim, int) else self.dim,
            "target_log_loss": target,
            "time_to_target_s": reached[0]["train_s"] if reached else None,
            "epoch_to_target": reached[0]["epoch"] if reached else None,
            "best_log_loss": min(losses) if losses else None,
            "best_auc": max(
                (e["auc"] for e in self.epochs if e.get("auc") is not None), default=None
            ),
            "ms_per_step": self.ms_per_step,
            "ms_per_pass": self.ms_per_pass,
            "bytes_per_step": self.bytes_per_step,
            "bytes_how": self.bytes_how,
            "epochs": self.epochs,
            "working_memory_mb": working_memory(self.contender, self.procs)[0],
            "working_memory_how": working_memory(self.contender, self.procs)[1],
            "cpu_and_memory": self.procs,
            "notes": self.notes,
            "error": self.error,
            **self.extra,
        }


def median_lists(lists: list[list[float]]) -> list[float]:
    n = min(len(x) for x in lists)
    return [statistics.median(x[i] for x in lists) for i in range(n)]


def steady_seconds(per_epoch: list[float]) -> float:
    """Seconds of an epoch after the first (their mean: async epochs overlap, only their
    sum is meaningful), or of the only one."""
    return statistics.fmean(per_epoch[1:]) if len(per_epoch) > 1 else per_epoch[0]


def steps_per_epoch(data: Data) -> int:
    return max(math.ceil(len(p) / BATCH) for p in data.parts())


def dim_label(dim: Any) -> str:
    """How a D is named in the report: ``2^20``, or ``raw`` for the 64-bit ids."""
    if dim is None or dim == "raw":
        return "raw"
    return f"2^{int(math.log2(dim))}" if isinstance(dim, int) else str(dim)
