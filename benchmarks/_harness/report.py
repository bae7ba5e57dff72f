"""The JSON a benchmark writes, and what it was measured on.

* ``machine()``: CPUs, Python, platform, the load at the end;
* ``write_report(report, path)``: the JSON file (``machine`` filled in, a benchmark's own
  ``machine`` entries kept over it), parents created; returns the path. numpy scalars are
  written as numbers, arrays as lists, anything else JSON has no type for as its text.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine", "write_report"]


def machine() -> dict[str, Any]:
    try:
        load: tuple[float, float, float] | None = os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux
        load = None
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_1min_at_end": load[0] if load else None,
        "load_average_at_end": list(load) if load else None,
    }


def _plain(value: Any) -> Any:
    """What ``json`` cannot write: a number (numpy scalars), a list (arrays), or text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {**report, "machine": {**machine(), **report.get("machine", {})}}
    out.write_text(json.dumps(report, indent=2, default=_plain) + "\n")
    return out
