"""Garbage is refused, never trained on: NaN / inf in numeric columns, in the
initial or published variables, and feedback arrays whose shapes differ across
partitions (a sum would broadcast them)."""

from __future__ import annotations

import numpy as np
import pytest

import hybrid_iter as hi


class Feed(hi.PartitionOperator):
    def __init__(self, shapes=None):
        self.shapes = shapes

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        shape = self.shapes[ctx.partition_id] if self.shapes else (2,)
        out.feedback(np.ones(shape))


class Sum(hi.CoordinatorOperator):
    def __init__(self, nan_at=None):
        self.nan_at = nan_at

    def open(self, init_variables, ctx):
        self.g = 0

    def process_feedback(self, value, ctx, out):
        self.g = self.g + value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        w = ctx.variables["w"] + (np.nan if epoch == self.nan_at else 1.0)
        out.publish_variables(w=w)


def run(df, partition=None, coordinator=None, init=None, streams=None):
    return hi.iterate_bounded_streams_until_termination(
        init or {"w": np.zeros(2)},
        streams or hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(max_epochs=4, parallelism=2),
        hi.IterationBody(partition or Feed(), coordinator or Sum()),
    )


def test_nan_in_a_declared_numeric_column_is_a_data_validation_error(spark):
    df = spark.createDataFrame(
        [(float(i), 1.0) for i in range(7)] + [(float("nan"), 1.0)], ["x", "y"]
    )
    streams = hi.ReplayableDataStreamList.not_replay(
        hi.DataStream(df.repartition(2), numeric_columns=("x", "y"))
    )
    with pytest.raises(hi.DataValidationError, match=r"column 'x' has 1 NaN/inf value"):
        run(df, streams=streams)


def test_nan_initial_variables_are_refused_before_any_job(spark):
    with pytest.raises(hi.IterationConfigError, match=r"init_variables\['w'\] has NaN"):
        run(spark.range(4), init={"w": np.array([0.0, np.inf])})


def test_publishing_nan_fails_the_run_naming_the_variable_and_epoch(spark):
    with pytest.raises(
        hi.IterationFailedError, match=r"publish_variables\(w=...\) at epoch 2 has 2 NaN"
    ):
        run(spark.range(4, numPartitions=2), coordinator=Sum(nan_at=2))


def test_feedback_shapes_differing_across_partitions_are_refused(spark):
    with pytest.raises(
        hi.IterationFailedError, match=r"partition 1 fed back an array of shape \(1, 2\)"
    ):
        run(spark.range(4, numPartitions=2), partition=Feed({0: (2,), 1: (1, 2)}))
