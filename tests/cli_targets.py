"""Entry functions that tests/hybrid_iter/cli/test_cli.py runs with ``hybrid-iter run cli_targets:NAME``.

They run on the driver, in the CLI's process, with the CLI's Session.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Point:
    x: float
    y: float


def echo(session: Any, **params: Any) -> dict[str, Any]:
    """Returns what it got, with numpy values and a dataclass the CLI turns into JSON."""
    return {
        "kind": session.kind,
        "count": session.spark.range(5).count(),
        "params": params,
        "vector": np.arange(3.0),
        "scalar": np.float64(0.5),
        "point": Point(1.0, 2.0),
    }


def fail(session: Any) -> None:
    raise ValueError("boom from the entry function")


def wait_for_sigterm(session: Any, *, ready: str) -> None:
    """Says it is running (its PID in ``ready``), then waits to be stopped."""
    session.spark.range(2).count()  # Spark and Ray are up
    Path(ready).write_text(str(os.getpid()))
    while True:
        time.sleep(3600)  # interrupted by SIGTERM, whose handler unwinds the session
