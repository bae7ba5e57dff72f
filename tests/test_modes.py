"""Sync, async and bounded-staleness modes with a straggler, on real Spark + Ray."""

from __future__ import annotations

import time

import numpy as np
import pytest
from ops import GradientDescent, LinRegPartition, make_regression

import hybrid_iter as hi

FEATURES = ["x0", "x1", "x2"]


@pytest.fixture(scope="module")
def data(spark):
    return make_regression(spark, rows=900, dims=3, partitions=2, seed=3)


class Traced(LinRegPartition):
    """Records when each epoch's watermark callback starts and ends (system-wide
    monotonic clock, comparable across processes on this machine)."""

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("trace", (ctx.partition_id, epoch, "start", time.monotonic()))
        super().on_epoch_watermark_incremented(epoch, ctx, out)
        out.output("trace", (ctx.partition_id, epoch, "end", time.monotonic()))


def traces(result):
    t = {}
    for pid, epoch, kind, ts in result.outputs["trace"]:
        t[(pid, epoch, kind)] = ts
    return t


def max_lead(t, pids):
    """The largest number of epochs one subtask was ahead of another when it started."""
    lead = 0
    for (_, e, kind), ts in t.items():
        if kind != "start":
            continue
        for q in pids:
            # q's current epoch at time ts: one past the last epoch it had finished
            ended = [eq for (qq, eq, k), tq in t.items() if qq == q and k == "end" and tq <= ts]
            current = max(ended, default=-1) + 1
            lead = max(lead, e - current)
    return lead


def check_bound(t, pids, staleness):
    """p starts epoch e only after every q ended epoch e - staleness - 1."""
    for (p, e, kind), ts in t.items():
        if kind != "start":
            continue
        for q in pids:
            before = e - staleness - 1
            if before >= 0 and (q, before, "end") in t:
                assert t[(q, before, "end")] < ts, (p, e, q, before)


def fit(df, n, *, staleness, epochs, delay=0.03, body_criteria=True):
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(staleness=staleness, parallelism=2),
        hi.IterationBody(
            partition=Traced(FEATURES, delay_partition=1, delay_s=delay),
            coordinator=GradientDescent(lr=0.5, total_rows=n),
            criteria=hi.TerminateOnMaxIter(epochs),
        ),
    )


def test_sync_lock_step_under_a_straggler(data):
    df, X, y = data
    result = fit(df, len(y), staleness=0, epochs=6)
    t = traces(result)
    check_bound(t, [0, 1], 0)
    assert max_lead(t, [0, 1]) == 0
    assert result.subtask_epochs == {0: 6, 1: 6}
    assert result.feedback_counts == {0: 6, 1: 6}


@pytest.mark.parametrize("staleness", [1, 2])
def test_ssp_never_exceeds_its_bound_and_uses_it(data, staleness):
    df, X, y = data
    result = fit(df, len(y), staleness=staleness, epochs=10)
    t = traces(result)
    check_bound(t, [0, 1], staleness)
    assert max_lead(t, [0, 1]) == staleness  # the fast subtask did run ahead, as far as allowed
    assert result.mode == "ssp"


def test_async_fast_subtask_makes_more_updates_and_the_model_converges(data):
    df, X, y = data
    result = fit(df, len(y), staleness=None, epochs=15, delay=0.05)
    counts = result.feedback_counts
    assert counts[0] > counts[1] * 2, counts  # the straggler did not hold the fast one back
    assert result.subtask_epochs[0] > result.subtask_epochs[1]
    # every update was applied on arrival and published at once
    assert result.extra["publishes"] == counts[0] + counts[1]
    w_ls = np.linalg.lstsq(X, y, rcond=None)[0]
    np.testing.assert_allclose(result.variables["w"], w_ls, atol=0.05)
    assert result.terminated_by == "criteria" and result.epochs == 15


def test_async_max_epochs_caps_every_subtask(data):
    df, X, y = data
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(staleness=None, parallelism=2, max_epochs=8),
        hi.IterationBody(
            partition=LinRegPartition(FEATURES, delay_partition=1, delay_s=0.02),
            coordinator=GradientDescent(lr=0.5, total_rows=len(y)),
        ),
    )
    assert result.terminated_by == "max_epochs"
    assert result.feedback_counts == {0: 8, 1: 8}
