"""The figures benchmarks draw: one style, a PNG beside the JSON.

``figure(path, draw, rows=, cols=, size=)`` makes a grid of panels in the common style
(``STYLE``), lets ``draw(axes)`` fill them (``axes[row][col]``, always two-dimensional),
lays them out and writes the PNG; ``beside(json_path)`` is where a report's figure goes.
Without matplotlib it says so and returns None: the JSON is the result, the figure a view
of it. The figure is built without pyplot (no global state, nothing to close).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["STYLE", "beside", "figure"]

#: every benchmark's figures: light grids, small legends and ticks, 100 dpi
STYLE: dict[str, Any] = {
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.alpha": 0.3,
    "axes.titlesize": 10,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "savefig.dpi": 100,
}


def beside(json_path: str | Path) -> Path:
    """The PNG that goes with a report: its path with ``.png``."""
    return Path(json_path).with_suffix(".png")


def figure(
    path: str | Path,
    draw: Callable[[Any], None],
    *,
    rows: int = 1,
    cols: int = 1,
    size: tuple[float, float] | None = None,
) -> Path | None:
    """Draw ``rows`` x ``cols`` panels with ``draw(axes)`` and write them to ``path``."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(f"no figure {Path(path).name}: matplotlib is not installed (pip install matplotlib)")
        return None
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=size or (6.5 * cols, 4.5 * rows))
        FigureCanvasAgg(fig)
        draw(fig.subplots(rows, cols, squeeze=False))
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png")
    return out
