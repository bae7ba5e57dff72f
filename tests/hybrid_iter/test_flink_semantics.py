"""Flink-faithful iteration semantics, on real Spark + Ray.

Each test is one of Flink ML's own iteration behaviours translated to our API.
"""

from __future__ import annotations

import pytest
from conftest import SLOTS

import hybrid_iter as hi


class Reporter(hi.PartitionOperator):
    """Feeds back a token in every epoch (the partitions never stop reporting) and
    records its watermarks and the ``ctx.epoch`` its variables arrive with."""

    def open(self, ctx):
        self.pid = ctx.partition_id

    def process_variables(self, variables, ctx, out):
        out.output("variables", (self.pid, ctx.epoch, int(variables["version"])))

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("watermark", (self.pid, epoch))
        out.feedback(1)


class PublishUntil(hi.CoordinatorOperator):
    """Publishes ``version = epoch + 1`` in its watermark callback of epochs
    ``< until``, then stops publishing (partitions keep reporting)."""

    def __init__(self, until=10**9):
        self.until = until

    def open(self, init_variables, ctx):
        self.feedback = 0

    def process_feedback(self, value, ctx, out):
        self.feedback += value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("coord", epoch)
        if epoch < self.until:
            out.publish_variables(version=epoch + 1)

    def on_iteration_terminated(self, ctx, out):
        out.output("coord_terminated", ctx.epoch)


def run(df, body, *, replay=False, **config):
    streams = (
        hi.ReplayableDataStreamList.replay(df)
        if replay
        else hi.ReplayableDataStreamList.not_replay(df)
    )
    return hi.iterate_bounded_streams_until_termination(
        {"version": 0}, streams, hi.IterationConfig(**config), body
    )


# -- 1. termination counts the feedback edge (publish_variables) --------------------------


@pytest.mark.parametrize("staleness", [0, None], ids=["sync", "async"])
def test_a_coordinator_that_stops_publishing_ends_the_iteration(spark, staleness):
    """The coordinator publishes in epochs 0 and 1 only; partitions report every epoch.
    Flink ML terminates at the alignment after epoch 2 (nothing fed back into epoch 3):
    watermarks 0, 1, 2 on the coordinator tier, then TERMINATED once: the partitions'
    feedback alone does not keep it running (until max_epochs)."""
    df = spark.range(40, numPartitions=2)
    body = hi.IterationBody(partition=Reporter(), coordinator=PublishUntil(until=2))
    result = run(df, body, parallelism=2, staleness=staleness, max_epochs=8)
    assert result.terminated_by == "no_variables_published"
    assert result.epochs == 3
    assert result.outputs["coord"] == [0, 1, 2]
    assert result.outputs["coord_terminated"] == [2]
    assert int(result.variables["version"]) == 2
    if staleness == 0:  # lock step: every subtask saw exactly the epochs 0, 1, 2
        assert sorted(result.outputs["watermark"]) == [(p, e) for p in (0, 1) for e in range(3)]


# -- 2. the terminating round runs its per-round operators ------------------------------


class RoundState(hi.PartitionOperator):
    """A per-round operator with state: the version it got and the rows of its round;
    one output per round, at the end of the round."""

    def open(self, ctx):
        self.version, self.rows = None, 0

    def process_variables(self, variables, ctx, out):
        self.version = int(variables["version"])

    def process_data(self, stream, batch, ctx, out):
        self.rows += batch.num_rows

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("round", (epoch, ctx.partition_id, self.version, self.rows))
        out.feedback(self.rows)

    def close(self):
        self.version = "closed"


class RoundCoordinator(hi.CoordinatorOperator):
    """A per-round coordinator operator: sums its round's feedback."""

    def open(self, init_variables, ctx):
        self.rows, self.records = 0, 0

    def process_feedback(self, value, ctx, out):
        self.rows += value
        self.records += 1

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("round_coord", (epoch, self.records, self.rows))


def test_the_terminating_round_runs_its_per_round_operators(spark):
    """TerminateOnMaxIter(3): rounds 0, 1, 2 read the replayed data; the variables
    published after round 2 are fed into round 3, where the iteration terminates. As in
    Flink ML that round's per-round operators are still created, get the variables and
    their end of round (no replayed data: replay stops at termination), before
    on_iteration_terminated: one output per round including the last."""
    df = spark.range(0, 60, numPartitions=2)
    body = hi.IterationBody(
        partition=hi.PartitionOperator(),
        coordinator=PublishUntil(),
        criteria=hi.TerminateOnMaxIter(3),
    ).for_each_round(RoundState(), RoundCoordinator())
    result = run(df, body, replay=True, parallelism=2)
    assert (result.terminated_by, result.epochs) == ("criteria", 3)
    rounds = sorted(result.outputs["round"])
    assert rounds == [(e, p, e, 30 if e < 3 else 0) for e in range(4) for p in (0, 1)], rounds
    # the coordinator tier's per-round operator of round 3 got that round's feedback
    assert sorted(result.outputs["round_coord"]) == [(0, 2, 60), (1, 2, 60), (2, 2, 60), (3, 2, 0)]
    assert result.outputs["coord_terminated"] == [2]


# -- 3. ctx.epoch inside process_variables ------------------------------------------------


def test_process_variables_sees_the_epoch_the_variables_belong_to(spark):
    """Version v is published in the watermark callback of epoch v - 1, so it belongs to
    epoch v: process_variables must see ctx.epoch == v (not v - 1)."""
    df = spark.range(20, numPartitions=2)
    body = hi.IterationBody(
        partition=Reporter(), coordinator=PublishUntil(), criteria=hi.TerminateOnMaxIter(3)
    )
    result = run(df, body, parallelism=2)
    seen = sorted(result.outputs["variables"])
    assert seen == [(p, v, v) for p in (0, 1) for v in range(4)], seen


# -- 4. no Spark job before validation ------------------------------------------------------


def test_too_few_slots_fails_before_any_spark_job(spark):
    """A repartition()ed DataFrame under adaptive execution (Spark 3.5's default): the
    slot check must fail before any job runs (reading the partition count from the
    executed RDD ran the shuffle-map stage first)."""
    assert spark.conf.get("spark.sql.adaptive.enabled") == "true"
    df = spark.range(100).repartition(5)
    sc = spark.sparkContext
    group = "no-job-before-validation"
    sc.setJobGroup(group, "validation must not run a job")
    try:
        before = set(sc.statusTracker().getJobIdsForGroup(group))
        with pytest.raises(hi.IterationConfigError, match="task slots"):
            run(df, hi.IterationBody(partition=Reporter()), parallelism=SLOTS + 1)
        after = set(sc.statusTracker().getJobIdsForGroup(group))
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
        sc.setLocalProperty("spark.job.interruptOnCancel", None)
    assert after - before == set(), f"jobs ran before validation: {sorted(after - before)}"
    # the probe itself sees jobs of its group (so zero above is not vacuous)
    sc.setJobGroup(group, "probe")
    try:
        df.count()
        assert set(sc.statusTracker().getJobIdsForGroup(group)) - after
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
        sc.setLocalProperty("spark.job.interruptOnCancel", None)
