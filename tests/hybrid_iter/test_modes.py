"""Sync, async and bounded-staleness modes with a straggler, on real Spark + Ray.

The assertions read orderings and counts from recorded events, never durations: in the
async and SSP tests the straggler is made by an event (the slow subtask holds an epoch
until the fast one has ended a given epoch), so how far the fast one runs ahead does not
depend on how busy the machine is."""

from __future__ import annotations

import os
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


class Gated(Traced):
    """Subtask ``slow`` holds its epoch ``hold_at`` until subtask ``fast`` has ended its
    epoch ``until`` (a file in ``directory`` says so). A mode that held the fast subtask
    back further than it allows would never let it get there: the wait then fails."""

    def __init__(self, features, directory, *, hold_at, until, slow=1, fast=0):
        super().__init__(features)
        self.directory = directory
        self.hold_at, self.until = hold_at, until
        self.slow, self.fast = slow, fast

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if ctx.partition_id == self.slow and epoch == self.hold_at:
            self._wait(os.path.join(self.directory, f"ended-{self.until}"))
        super().on_epoch_watermark_incremented(epoch, ctx, out)
        if ctx.partition_id == self.fast:
            with open(os.path.join(self.directory, f"ended-{epoch}"), "w"):
                pass

    @staticmethod
    def _wait(path, timeout=600.0):
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fast subtask never got to {path}: it was held back")
            time.sleep(0.01)


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


def gated_fit(df, n, directory, *, staleness, epochs, hold_at, until):
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(staleness=staleness, parallelism=2),
        hi.IterationBody(
            partition=Gated(FEATURES, str(directory), hold_at=hold_at, until=until),
            coordinator=GradientDescent(lr=0.5, total_rows=n),
            criteria=hi.TerminateOnMaxIter(epochs),
        ),
    )


@pytest.mark.parametrize("staleness", [1, 2])
def test_ssp_never_exceeds_its_bound_and_uses_it(data, staleness, tmp_path):
    df, X, y = data
    # the slow subtask holds epoch 2 until the fast one ended epoch 2 + staleness: as far
    # ahead as the bound allows, no further
    result = gated_fit(
        df, len(y), tmp_path, staleness=staleness, epochs=10, hold_at=2, until=2 + staleness
    )
    t = traces(result)
    check_bound(t, [0, 1], staleness)
    assert max_lead(t, [0, 1]) == staleness  # the fast subtask did run ahead, as far as allowed
    assert result.mode == "ssp"


def test_async_fast_subtask_is_never_held_back_and_the_model_converges(data, tmp_path):
    df, X, y = data
    # the slow subtask holds epoch 1 until the fast one ended epoch 8: async lets it
    result = gated_fit(df, len(y), tmp_path, staleness=None, epochs=15, hold_at=1, until=8)
    t = traces(result)
    assert max_lead(t, [0, 1]) >= 8 - 1
    assert t[(0, 8, "end")] < t[(1, 1, "start")]
    counts = result.feedback_counts
    assert counts[0] >= 9 and result.subtask_epochs[0] >= 9, counts
    # every update was applied on arrival and published at once
    assert result.publishes == counts[0] + counts[1]
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
