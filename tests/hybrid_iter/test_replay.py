"""Replayed streams, per-round operators and for_each_round, on real Spark + Ray."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from ops import GradientDescent, LinRegPartition, make_regression, numpy_linreg

import hybrid_iter as hi

PER_ROUND = hi.OperatorLifecycle.PER_ROUND


@pytest.fixture(scope="module")
def zero_to_999(spark):
    """4 partitions, each holding 0..999."""
    return spark.range(0, 4000, numPartitions=4).selectExpr("id % 1000 as v")


class RoundSum(hi.PartitionOperator):
    """Sums what it sees; reports (epoch, partition, instance, rows, sum, data epochs)."""

    def __init__(self, tag="round"):
        self.tag = tag

    def open(self, ctx):
        self.instance = uuid.uuid4().hex
        self.rows, self.total, self.data_epochs = 0, 0, set()
        self.first_data = None

    def process_data(self, stream, batch, ctx, out):
        if self.first_data is None:
            self.first_data = time.monotonic()
        v = batch.column(0).to_numpy()
        self.rows += len(v)
        self.total += int(v.sum())
        self.data_epochs.add(ctx.epoch)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output(
            self.tag,
            (
                epoch,
                ctx.partition_id,
                self.instance,
                self.rows,
                self.total,
                sorted(self.data_epochs),
                self.first_data,
            ),
        )
        out.feedback(self.rows)

    def on_iteration_terminated(self, ctx, out):
        out.output(f"{self.tag}_terminated", (ctx.partition_id, self.instance))


class RoundCoordinator(hi.CoordinatorOperator):
    """Counts the feedback records its instance got; publishes a version per epoch."""

    def open(self, init_variables, ctx):
        self.instance = uuid.uuid4().hex
        self.feedback = 0
        self.version = int(init_variables["version"])

    def process_feedback(self, value, ctx, out):
        self.feedback += 1

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("coord", (epoch, self.instance, self.feedback, time.monotonic()))
        self.version += 1
        out.publish_variables(version=self.version)

    def on_iteration_terminated(self, ctx, out):
        out.output("coord_terminated", self.instance)


def by_epoch(records):
    rounds = {}
    for r in records:
        rounds.setdefault(r[0], []).append(r)
    return rounds


def test_per_round_operators_see_exactly_their_round(zero_to_999):
    result = hi.iterate_bounded_streams_until_termination(
        {"version": 0},
        hi.ReplayableDataStreamList.replay(zero_to_999),
        hi.IterationConfig(operator_lifecycle=PER_ROUND, parallelism=4),
        hi.IterationBody(RoundSum(), RoundCoordinator(), criteria=hi.TerminateOnMaxIter(5)),
    )
    assert (result.terminated_by, result.epochs, result.replay.rounds) == ("criteria", 5, 5)
    rounds = by_epoch(result.outputs["round"])
    # rounds 0-4 read the data; round 5, into which the variables of round 4 were fed
    # back, still runs its per-round operators before termination (as in Flink ML), with
    # no replayed data: replay stops at termination
    assert sorted(rounds) == [0, 1, 2, 3, 4, 5]
    instances = set()
    for epoch, records in rounds.items():
        assert sorted(r[1] for r in records) == [0, 1, 2, 3]
        for _, _, instance, rows, total, data_epochs, _ in records:
            if epoch < 5:
                assert (rows, total) == (1000, 499500)  # every round's sum is the same
                assert data_epochs == [epoch]  # replayed records carry the round's epoch
            else:
                assert (rows, total, data_epochs) == (0, 0, [])
            instances.add(instance)
    assert len(instances) == 6 * 4  # a fresh partition operator per round and subtask
    coords = result.outputs["coord"]
    assert [c[0] for c in coords] == [0, 1, 2, 3, 4, 5]
    assert len({c[1] for c in coords}) == 6  # a fresh coordinator operator per round
    assert all(c[2] == 4 for c in coords)  # each saw only its round's feedback
    # per-round operators are closed with their round: termination reaches none of them
    assert "round_terminated" not in result.outputs and "coord_terminated" not in result.outputs


def test_replay_starts_only_after_the_previous_rounds_watermark(zero_to_999):
    result = hi.iterate_bounded_streams_until_termination(
        {"version": 0},
        hi.ReplayableDataStreamList.replay(zero_to_999),
        hi.IterationConfig(operator_lifecycle=PER_ROUND, parallelism=4, max_epochs=4),
        hi.IterationBody(RoundSum(), RoundCoordinator()),
    )
    coord_done = {c[0]: c[3] for c in result.outputs["coord"]}  # end of wm(e), in the actor
    for epoch, _, _, _, _, _, first_data in result.outputs["round"]:
        if epoch > 0:
            assert first_data > coord_done[epoch - 1]


def test_for_each_round_mixes_all_round_and_per_round_operators(spark, zero_to_999):
    once = spark.range(0, 40, numPartitions=4).selectExpr("id + 1000000 as v")  # seen once
    body = hi.IterationBody(RoundSum("all"), RoundCoordinator(), criteria=hi.TerminateOnMaxIter(3))
    body = body.for_each_round(RoundSum("each"))
    result = hi.iterate_bounded_streams_until_termination(
        {"version": 0},
        hi.ReplayableDataStreamList.replay(zero_to_999).and_not_replay(once),
        hi.IterationConfig(parallelism=4),
        body,
    )
    assert result.epochs == 3
    # the all-round operator: one instance per subtask for every round (its state moved
    # from one round job to the next), replayed rows every round plus the other stream once
    all_round = by_epoch(result.outputs["all"])
    for pid in range(4):
        mine = [r for e in sorted(all_round) for r in all_round[e] if r[1] == pid]
        assert len({r[2] for r in mine}) == 1
        assert [r[3] for r in mine] == [1010, 2010, 3010]
    # the per-round operator: fresh every round, only the replayed stream, only its round
    each = by_epoch(result.outputs["each"])
    assert sorted(each) == [0, 1, 2, 3]  # round 3: the terminating round, no data
    for epoch, records in each.items():
        expected = (1000, 499500, (epoch,)) if epoch < 3 else (0, 0, ())
        assert {(r[3], r[4], tuple(r[5])) for r in records} == {expected}
    assert len({r[2] for rs in each.values() for r in rs}) == 4 * 4
    # termination reaches the operators still alive: the all-round ones
    assert sorted(p for p, _ in result.outputs["all_terminated"]) == [0, 1, 2, 3]
    assert "each_terminated" not in result.outputs
    assert len(result.outputs["coord_terminated"]) == 1  # the all-round coordinator


class Stateful(hi.PartitionOperator):
    """Keeps its state through snapshot_state/restore_state instead of being pickled."""

    def open(self, ctx):
        self.seen = 0
        self.lock = __import__("threading").Lock()  # not picklable: must not be pickled

    def process_data(self, stream, batch, ctx, out):
        self.seen += batch.num_rows

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("seen", (epoch, ctx.partition_id, self.seen))
        out.feedback(1)

    def snapshot_state(self):
        return {"seen": self.seen}

    def restore_state(self, state):
        self.seen = state["seen"]


def test_all_round_state_uses_snapshot_state_when_defined(zero_to_999):
    result = hi.iterate_bounded_streams_until_termination(
        {"version": 0},
        hi.ReplayableDataStreamList.replay(zero_to_999),
        hi.IterationConfig(parallelism=4, max_epochs=3),
        hi.IterationBody(Stateful(), RoundCoordinator()),
    )
    seen = sorted(result.outputs["seen"])
    assert [s for e, p, s in seen if p == 0] == [1000, 2000, 3000]


@pytest.mark.parametrize(
    "lifecycle",
    [
        # the compatibility set every CI environment runs: one lifecycle is enough there
        pytest.param(PER_ROUND, marks=pytest.mark.spark_lines),
        hi.OperatorLifecycle.ALL_ROUND,
    ],
)
def test_replayed_gradient_descent_equals_numpy(spark, lifecycle):
    df, X, y = make_regression(spark, rows=900, dims=3, partitions=3, seed=5)
    features = ["x0", "x1", "x2"]

    class Fresh(LinRegPartition):
        def process_data(self, stream, batch, ctx, out):
            if lifecycle is hi.OperatorLifecycle.ALL_ROUND and ctx.epoch > 0:
                return  # all-round: it cached round 0 already; replays are ignored
            super().process_data(stream, batch, ctx, out)

    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.replay(df),
        hi.IterationConfig(operator_lifecycle=lifecycle, max_epochs=8, parallelism=3),
        hi.IterationBody(Fresh(features), GradientDescent(lr=0.4, total_rows=len(y))),
    )
    w, _, losses = numpy_linreg(X, y, 0.4, 8)
    np.testing.assert_allclose(result.variables["w"], w, atol=1e-9)
    np.testing.assert_allclose(result.outputs["loss"], losses, rtol=1e-9)
    assert "Disk" in result.replay.storage_level and "Memory" in result.replay.storage_level


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("staleness", [None, 2])
def test_replay_needs_sync_mode(zero_to_999, staleness):
    with pytest.raises(hi.IterationConfigError, match=r"replayed streams.*staleness=0"):
        hi.iterate_bounded_streams_until_termination(
            {"version": 0},
            hi.ReplayableDataStreamList.replay(zero_to_999),
            hi.IterationConfig(staleness=staleness),
            hi.IterationBody(RoundSum(), RoundCoordinator()),
        )


def test_per_round_with_a_stream_read_once_is_rejected(spark, zero_to_999):
    once = spark.range(4)
    with pytest.raises(hi.IterationConfigError, match=r"PER_ROUND.*\[1\] are not replayed"):
        hi.iterate_bounded_streams_until_termination(
            {"version": 0},
            hi.ReplayableDataStreamList.replay(zero_to_999).and_not_replay(once),
            hi.IterationConfig(operator_lifecycle=PER_ROUND),
            hi.IterationBody(RoundSum(), RoundCoordinator()),
        )


def test_for_each_round_arguments():
    body = hi.IterationBody(RoundSum())
    with pytest.raises(hi.IterationConfigError, match=r"partition=RoundSum\(\)"):
        body.for_each_round(RoundSum)  # type: ignore[arg-type]
    with pytest.raises(hi.IterationConfigError, match="already has a for_each_round"):
        body.for_each_round(RoundSum()).for_each_round(RoundSum())
    with pytest.raises(hi.IterationConfigError, match="CoordinatorOperator"):
        body.for_each_round(RoundSum(), coordinator=RoundSum())  # type: ignore[arg-type]


class Nested(hi.PartitionOperator):
    """Tries to start an iteration from inside a Spark task (the boosting pattern)."""

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        hi.iterate_bounded_streams_until_termination(
            {"x": 0}, None, hi.IterationConfig(), hi.IterationBody(hi.PartitionOperator())
        )


def test_nested_iteration_inside_an_operator_is_a_clear_error(zero_to_999):
    with pytest.raises(
        hi.IterationConfigError, match=r"nested iterations are not supported.*Spark task"
    ):
        hi.iterate_bounded_streams_until_termination(
            {"version": 0},
            hi.ReplayableDataStreamList.replay(zero_to_999),
            hi.IterationConfig(operator_lifecycle=PER_ROUND, max_epochs=2),
            hi.IterationBody(Nested(), RoundCoordinator()),
        )


class NestedOnline(hi.PartitionOperator):
    """Tries to start an online iteration from inside a Spark task."""

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        hi.iterate_unbounded_streams({"x": 0}, None, hi.IterationBody(hi.PartitionOperator()))


def test_a_nested_online_iteration_is_refused_like_a_bounded_one(zero_to_999):
    # the two entry points share their argument checks: the online one names the nesting
    # too, not the first argument it happens to dislike
    with pytest.raises(
        hi.IterationConfigError, match=r"nested iterations are not supported.*Spark task"
    ):
        hi.iterate_bounded_streams_until_termination(
            {"version": 0},
            hi.ReplayableDataStreamList.replay(zero_to_999),
            hi.IterationConfig(operator_lifecycle=PER_ROUND, max_epochs=2),
            hi.IterationBody(NestedOnline(), RoundCoordinator()),
        )
