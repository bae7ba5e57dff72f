"""Replay survives data larger than Spark's storage memory (the cache spills to disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import TESTS

pytestmark = pytest.mark.integration  # each test starts its own Spark or Ray


def test_replayed_data_larger_than_storage_memory_still_replays():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(TESTS / "replay_spill_job.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    data = json.loads(line[len("RESULT ") :])
    # most of the replay cache could not stay in memory: Spark put it on disk
    assert data["disk"] > data["raw_bytes"] / 2, data
    assert data["memory"] < data["disk"], data
    # and every round still saw every row
    assert [r[0] for r in data["rounds"]] == [0, 1, 2]
    for _, rows, total in data["rounds"]:
        assert rows == data["rows"]
        assert abs(total - data["expected_total"]) < 1e-6 * data["expected_total"]
