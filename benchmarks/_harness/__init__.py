"""What every benchmark here shares: one accounting for every contender, one report.

* timers (``timing``): ``measure(run, repeats, warmup)`` (the same warm-up and repeats for
  each contender), ``slope``, ``ratio``;
* process watchers (``watch``): ``Watch`` (CPU seconds and peak memory of a process tree
  or of given pids over a run, per role), ``rss``, ``peak_rss``, ``reset_peak``, ``tree``,
  ``role``;
* the JSON (``report``): ``write_report(report, path)`` with ``machine()`` filled in;
* figures (``figures``): ``figure(path, draw, ...)`` in one style, ``beside(json_path)``;
* Spark's own contenders (``spark``): ``local_spark(app, cores, driver_memory, conf)``;
* a measurement in a fresh process (``worker``): ``run_worker(cmd, tag, ...)``, the JSON
  of the one line it prints as ``<tag> <json>``.

A benchmark imports it as ``from _harness import ...`` (its folder is on ``sys.path``
when run as ``python benchmarks/bench_x.py``; a benchmark imported by a test puts it
there), the suite (``python -m benchmarks``) as ``benchmarks._harness``.

A headline ratio compares like with like: steady state with steady state (an epoch after
the first against a marginal iteration), end to end with end to end (a whole fit
against a whole fit), equal quality with equal quality.
"""

from __future__ import annotations

import importlib
from typing import Any

#: name -> the module that holds it; a module is imported when one of its names is first
#: asked for (a benchmark's fresh processes import the harness and time their own imports)
_HOME = {
    "STYLE": "figures",
    "beside": "figures",
    "figure": "figures",
    "machine": "report",
    "write_report": "report",
    "Measured": "timing",
    "measure": "timing",
    "ratio": "timing",
    "slope": "timing",
    "Sample": "watch",
    "Watch": "watch",
    "peak_rss": "watch",
    "reset_peak": "watch",
    "role": "watch",
    "rss": "watch",
    "tree": "watch",
    "local_spark": "spark",
    "WorkerFailed": "worker",
    "run_worker": "worker",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value
