"""A DataFrame of a stopped SparkSession given to an entry point: a typed error naming
the stopped session and the fix, before any job (a fresh process: stopping the suite's
shared session is not possible)."""

from __future__ import annotations

import pytest
from fresh_process import run_job

pytestmark = pytest.mark.integration  # each test starts its own Spark or Ray

ENTRY_POINTS = {
    "iterate_bounded": "data stream 0",
    "iterate_unbounded": "data stream 0",
    "LinearRegression.fit": "the DataFrame given to LinearRegression.fit(df)",
    "KMeans.fit": "the DataFrame given to KMeans.fit(df)",
    "ps.train": "the DataFrame given to ps.train(df, ...)",
}


@pytest.mark.timeout(600)
def test_every_entry_point_names_a_stopped_session_before_any_job():
    got = run_job("stopped_session_job", "closed", timeout=500)
    for entry, what in ENTRY_POINTS.items():
        assert got[entry] is not None, f"{entry} ran on a stopped session"
        kind, text, is_session_error = got[entry]
        assert kind == "SessionStoppedError" and is_session_error, (entry, kind, text)
        assert text.startswith(f"{what} is a DataFrame of a SparkSession that was stopped"), text
        assert "read the data again" in text, text
        assert "'NoneType'" not in text
    assert got["spark_active"] is False  # nothing started a SparkContext to fail later
