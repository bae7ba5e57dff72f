"""What an iteration returns."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coordinator import OutputRecord

__all__ = ["IterationResult", "ReplayInfo"]


@dataclass(frozen=True)
class ReplayInfo:
    """How a run with replayed streams used Spark's cache: the cached batches, the storage
    level, the bytes in memory and on disk, and the rounds (one Spark job each)."""

    batches: int
    storage_level: str
    memory_bytes: int
    disk_bytes: int
    rounds: int = 0


@dataclass(frozen=True)
class IterationResult:
    """The end state of a bounded iteration.

    * ``variables``: the newest published version of every variable.
    * ``outputs``: ``tag -> [value, ...]`` in emission order (both tiers);
      ``output_records`` has each record's epoch and source (partition id or
      ``"coordinator"``).
    * ``epochs``: epochs completed by every subtask (the last global alignment).
    * ``terminated_by``: a ``TerminationReason`` (a ``str``): ``"criteria"``,
      ``"no_variables_published"`` (nothing fed back) or ``"max_epochs"``.
    * ``epoch_seconds``: wall time between consecutive global alignments.
    * ``subtask_epochs``: epochs each subtask ran (async: fast ones run more);
      ``feedback_counts``: feedback records of each subtask that the coordinator applied
      (async: a record that arrives after termination is not applied).
    * how the run went: ``attempts`` (one line per failed attempt that was relaunched),
      ``restores`` (per restore by a coordinator Ray restarted: the epoch found and the
      epoch expected), ``checkpoint`` (the coordinator's checkpoint accounting at the end:
      ``restored_from``, ``restored_epoch``, ...; None when it could not be read),
      ``repartitioned`` (the stage routed the streams' partitions to the subtasks through
      a shuffle), ``publishes`` and ``object_store_puts`` (variables versions published,
      and those put into Ray's object store), ``replay`` (replayed streams only).
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
    attempts: tuple[str, ...] = ()
    restores: tuple[tuple[int | None, int | None], ...] = ()
    checkpoint: Mapping[str, Any] | None = None
    repartitioned: bool = False
    publishes: int = 0
    object_store_puts: int = 0
    replay: ReplayInfo | None = None

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

    def plot(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        compare: Any = None,
        tag: str | None = None,
        label: str | None = None,
    ) -> Path:
        """Write a PNG of the loss per epoch (left) and per second of training (right).

        ``compare``: more results drawn on the same axes (one ``IterationResult``, a list
        of them, or ``{label: result}``), e.g. a sync and an async run. ``tag``: the output
        to draw (default ``"loss"``, else ``"cost"``). Seconds count from the first
        epoch's start (loading excluded): from the ``<tag>_trace`` output when the run
        recorded one (``hybrid_iter.ml`` and ``ps`` do: async runs report every update),
        else from the epochs' alignment times. Needs matplotlib
        (``pip install 'hybrid-iter[plot]'``). Returns the path written (default
        ``hybrid_iter_loss.png``).
        """
        runs = [(label or self.mode, self)]
        if isinstance(compare, IterationResult):
            compare = [compare]
        if isinstance(compare, Mapping):
            runs += [(str(k), v) for k, v in compare.items()]
        elif compare is not None:
            runs += [(r.mode, r) for r in compare]
        return _plot_runs(runs, Path(path or "hybrid_iter_loss.png"), tag)

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


def _loss_tag(result: IterationResult, tag: str | None) -> str:
    if tag is not None:
        return tag
    for name in ("loss", "cost"):
        if result.outputs.get(name):
            return name
    for name, values in result.outputs.items():
        if values and all(isinstance(v, (int, float, np.number)) for v in values):
            return name
    return "loss"


def _series(
    result: IterationResult, tag: str
) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(epochs, values per epoch, seconds, values per second)`` of one run's ``tag``."""
    per_epoch: dict[int, float] = {}
    for r in result.output_records:
        if r.tag == tag:
            per_epoch[r.epoch] = float(r.value)  # async: the newest of the epoch
    epochs = sorted(per_epoch)
    trace = result.outputs.get(f"{tag}_trace")
    if trace:
        seconds, values = [float(t) for t, _ in trace], [float(v) for _, v in trace]
    else:
        ends = np.cumsum(result.epoch_seconds)  # alignment e + 1 ends epoch e
        seconds = [float(ends[e]) if e < len(ends) else float("nan") for e in epochs]
        values = [per_epoch[e] for e in epochs]
    return epochs, [per_epoch[e] for e in epochs], seconds, values


def _plot_runs(runs: list[tuple[str, IterationResult]], path: Path, tag: str | None) -> Path:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as ex:  # an optional dependency
        raise ImportError(
            "IterationResult.plot needs matplotlib: pip install 'hybrid-iter[plot]'"
        ) from ex
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)  # no pyplot: no global state, no display needed
    by_epoch, by_time = fig.subplots(1, 2)
    seen: dict[str, int] = {}
    name = _loss_tag(runs[0][1], tag)
    everything: list[float] = []
    for label, result in runs:
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label} ({seen[label]})"
        epochs, ys, seconds, values = _series(result, _loss_tag(result, tag))
        by_epoch.plot(epochs, ys, marker="." if len(epochs) < 60 else None, label=label)
        by_time.plot(seconds, values, label=label)
        everything += [v for v in ys + values if np.isfinite(v)]
    if everything and min(everything) > 0 and max(everything) / min(everything) > 20:
        by_epoch.set_yscale("log")
        by_time.set_yscale("log")
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("seconds since the first epoch started")
    for ax in (by_epoch, by_time):
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    by_epoch.set_title(f"{name} per epoch")
    by_time.set_title(f"{name} per second")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    return path
