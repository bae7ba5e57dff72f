"""The benchmark's figure, beside its JSON: held-out log loss against time at the
narrowest and the widest D, ms per step by D, time to the target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _harness import beside, figure

from .record import dim_label

#: one color per contender in every panel
COLORS = {
    "ps_sync": "C0",
    "ps_async": "C1",
    "ps_sync_1shard": "C8",
    "ps_dense": "C4",
    "ps_fm": "C5",
    "numpy": "C2",
    "sklearn_sgd": "C7",
    "mllib_lr": "C3",
    "mllib_fm": "C6",
}


def _legend(ax: Any, size: int = 8) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=size)


def _loss_over_time(ax: Any, report: dict[str, Any], dim: int) -> None:
    target = report["targets"][dim_label(dim)]["target"]
    for r in report["results"]:
        if r["dim"] != dim or not r["epochs"]:
            continue
        xs = [e["train_s"] for e in r["epochs"] if e.get("log_loss") is not None]
        ys = [e["log_loss"] for e in r["epochs"] if e.get("log_loss") is not None]
        ax.plot(xs, ys, marker="o", label=r["contender"], color=COLORS[r["contender"]])
    ax.axhline(target, color="gray", linestyle="--", label=f"target {target:.4f}")
    ax.set_xscale("log")
    ax.set_ylim(target - 0.02, target + 0.06)
    ax.set_xlabel("training wall seconds (evaluation excluded)")
    ax.set_ylabel("held-out log loss")
    ax.set_title(f"D = {dim_label(dim)}: held-out log loss vs time")
    _legend(ax)


def _step_by_dim(ax: Any, report: dict[str, Any], dims: list[int]) -> None:
    rows = report["results"]
    for name in ("ps_sync", "ps_async", "numpy", "sklearn_sgd", "ps_dense"):
        pts = [(r["dim"], r["ms_per_step"]) for r in rows if r["contender"] == name]
        pts = [(d, v) for d, v in pts if isinstance(d, int) and v is not None]
        if pts:
            ax.plot(
                [d for d, _ in pts], [v for _, v in pts], marker="o", label=name, color=COLORS[name]
            )
    flat = report.get("sweep_ps_sync_by_dim")
    if flat:
        ax.plot(
            dims,
            [flat["ms_per_step"][dim_label(d)] for d in dims],
            marker="s",
            linestyle="--",
            color="black",
            label="ps_sync (interleaved sweep)",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter("{x:g}")
    ax.yaxis.set_minor_formatter("{x:g}")
    ax.set_xlabel("D")
    ax.set_ylabel("ms per step (2 x 1,024 rows)")
    ax.set_title("ms per step by D")
    _legend(ax)


def _time_to_target(ax: Any, report: dict[str, Any], dims: list[int]) -> None:
    rows = report["results"]
    names = [n for n in COLORS if any(r["contender"] == n for r in rows)]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        pts = [
            (j, r)
            for j, d in enumerate(dims)
            for r in rows
            if r["contender"] == name and r["dim"] == d
        ]
        xs = [j + i * width for j, _ in pts]
        ys = [r["time_to_target_s"] or 0.0 for _, r in pts]
        bars = ax.bar(xs, ys, width=width, label=name, color=COLORS[name])
        for b, (_, r) in zip(bars, pts, strict=True):
            if r["time_to_target_s"] is None:
                ax.annotate(
                    "x", (b.get_x() + b.get_width() / 2, 0), ha="center", color=COLORS[name]
                )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(dims))], [dim_label(d) for d in dims])
    ax.set_ylabel("seconds to the target (x: not reached or failed)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("time to target log loss")
    _legend(ax, 7)


def draw(report: dict[str, Any], json_path: Path) -> Path | None:
    """The four panels, written beside the report's JSON (None without matplotlib)."""
    dims = list(report["config"]["dims"])

    def panels(axes: Any) -> None:
        _loss_over_time(axes[0][0], report, dims[0])
        _loss_over_time(axes[0][1], report, dims[-1])
        _step_by_dim(axes[1][0], report, dims)
        _time_to_target(axes[1][1], report, dims)

    return figure(beside(json_path), panels, rows=2, cols=2, size=(14, 10))
