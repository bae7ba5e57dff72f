"""Imported by the session warm-up's Spark tasks in ``warm_up_job.main('closed')``: says
it started (a file ``started.<pid>`` in ``HYBRID_ITER_TEST_BLOCK_DIR``) and holds the
task until a file ``go`` appears there (at most 300 s), so that the test stops the
session while the warm-up's Spark job certainly runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

_dir = Path(os.environ["HYBRID_ITER_TEST_BLOCK_DIR"])
(_dir / f"started.{os.getpid()}").write_text("")
_deadline = time.monotonic() + 300
while not (_dir / "go").exists() and time.monotonic() < _deadline:
    time.sleep(0.1)  # held on purpose: the test cancels this task by stopping the session
