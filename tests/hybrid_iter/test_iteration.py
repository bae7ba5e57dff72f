"""Bounded iterations on real Spark + Ray: epochs, termination, results, streams."""

from __future__ import annotations

import numpy as np
import pytest
from ops import (
    GradientDescent,
    LinRegPartition,
    PidCoordinator,
    Recorder,
    RecordingCoordinator,
    make_regression,
    numpy_linreg,
)

import hybrid_iter as hi

FEATURES = ["x0", "x1", "x2", "x3"]


@pytest.fixture(scope="module")
def regression(spark):
    return make_regression(spark, rows=1200, dims=4, partitions=3)


def run(df, body, *, init=None, **config):
    return hi.iterate_bounded_streams_until_termination(
        init if init is not None else {"version": 0},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(**config),
        body,
    )


def events(result, pid=None):
    return [e for e in result.outputs.get("event", []) if pid is None or e[0] == pid]


# -- epochs and listeners ---------------------------------------------------------------


def test_both_tiers_see_watermarks_0_1_2_and_terminate_once(spark):
    df = spark.range(40, numPartitions=2)
    result = run(
        df,
        hi.IterationBody(
            partition=Recorder(),
            coordinator=RecordingCoordinator(),
            criteria=hi.TerminateOnMaxIter(4),
        ),
        parallelism=2,
    )
    assert result.terminated_by == "criteria"
    assert result.epochs == 4
    for pid in (0, 1):
        ev = events(result, pid)
        assert [e for _, k, e in ev if k == "watermark"] == [0, 1, 2, 3]
        assert [k for _, k, _ in ev].count("terminated") == 1
        assert ev[-1][1] == "terminated"
        # sync: the variables of epoch e arrive before the watermark of e
        versions = [e for _, k, e in ev if k == "variables"]
        assert versions == [0, 1, 2, 3, 4]
        order = [(k, e) for _, k, e in ev if k != "terminated"]
        for e in (1, 2, 3):
            assert order.index(("variables", e)) < order.index(("watermark", e))
    coord = result.outputs["coord"]
    assert [e for k, e, _ in coord if k == "watermark"] == [0, 1, 2, 3]
    # the coordinator's watermark e comes after every feedback of epoch e
    assert [fe for k, _, fe in coord if k == "watermark"] == [[0], [1], [2], [3]]
    assert [k for k, _, _ in coord].count("terminated") == 1
    assert result.subtask_epochs == {0: 4, 1: 4}


def test_epoch_zero_never_terminates(spark):
    """Nothing circulates at all: epoch 0 still runs on both tiers, then it stops."""
    df = spark.range(10, numPartitions=2)
    result = run(
        df,
        hi.IterationBody(
            partition=Recorder(feedback_until=0), coordinator=RecordingCoordinator(publish=False)
        ),
        parallelism=2,
    )
    assert result.terminated_by == "no_variables_published"
    assert result.epochs == 1
    for pid in (0, 1):
        assert [e for _, k, e in events(result, pid) if k == "watermark"] == [0]
    assert [(k, e) for k, e, _ in result.outputs["coord"]] == [("watermark", 0), ("terminated", 0)]


def test_terminates_after_the_first_epoch_without_a_publish(spark):
    """The feedback edge is publish_variables (as in Flink ML): partitions report in every
    epoch, the coordinator publishes in epochs 0, 1, 2 only."""
    df = spark.range(10, numPartitions=2)
    result = run(
        df,
        hi.IterationBody(partition=Recorder(), coordinator=RecordingCoordinator(publish_until=3)),
        parallelism=2,
        max_epochs=20,
    )
    assert result.terminated_by == "no_variables_published"
    assert result.epochs == 4  # published in epochs 0, 1, 2; nothing in epoch 3
    assert [e for _, k, e in events(result, 0) if k == "watermark"] == [0, 1, 2, 3]


def test_publishing_alone_keeps_circulating_until_max_epochs(spark):
    df = spark.range(10, numPartitions=2)
    result = run(
        df,
        hi.IterationBody(partition=Recorder(feedback_until=0), coordinator=RecordingCoordinator()),
        parallelism=2,
        max_epochs=6,
    )
    assert result.terminated_by == "max_epochs"
    assert result.epochs == 6
    assert int(result.variables["version"]) == 6


@pytest.mark.parametrize("tier", ["partition", "coordinator"])
def test_criteria_emitted_by_operators(spark, tier):
    df = spark.range(10, numPartitions=2)
    body = hi.IterationBody(
        partition=Recorder(criteria_until=2 if tier == "partition" else None),
        coordinator=RecordingCoordinator(criteria_until=2 if tier == "coordinator" else None),
        criteria=True,
    )
    result = run(df, body, parallelism=2, max_epochs=50)
    assert result.terminated_by == "criteria"
    assert result.epochs == 3  # criteria in epochs 0 and 1, none in epoch 2


def test_terminate_on_max_iter_or_tol_stops_on_tolerance(spark, regression):
    df, X, y = regression
    n = len(y)
    body = hi.IterationBody(
        partition=LinRegPartition(FEATURES),
        coordinator=GradientDescent(lr=0.5, total_rows=n),
        criteria=hi.TerminateOnMaxIterOrTol(200, tol=0.5),
    )
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(4)}, hi.ReplayableDataStreamList.not_replay(df), hi.IterationConfig(), body
    )
    losses = result.outputs["loss"]
    assert result.terminated_by == "criteria"
    assert losses[-1] <= 0.5 < losses[-2]
    assert result.epochs == len(losses) < 200
    # and with an unreachable tolerance it runs exactly max_iter epochs
    body = hi.IterationBody(
        partition=LinRegPartition(FEATURES),
        coordinator=GradientDescent(lr=0.5, total_rows=n),
        criteria=hi.TerminateOnMaxIterOrTol(7, tol=-1.0),
    )
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(4)}, hi.ReplayableDataStreamList.not_replay(df), hi.IterationConfig(), body
    )
    assert (result.terminated_by, result.epochs) == ("criteria", 7)


# -- results ------------------------------------------------------------------------------


@pytest.mark.spark_lines  # the compatibility set every CI environment runs
@pytest.mark.parametrize("partitions", [1, 2, 3])
def test_sync_equals_numpy_gradient_descent_for_any_partition_count(spark, regression, partitions):
    df, X, y = regression
    epochs, lr = 25, 0.3
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(4), "b": 0.0},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(df, numeric_columns=[*FEATURES, "y"])),
        hi.IterationConfig(staleness=0, max_epochs=epochs, parallelism=partitions),
        hi.IterationBody(
            partition=LinRegPartition(FEATURES),
            coordinator=GradientDescent(lr=lr, total_rows=len(y), intercept=True),
        ),
    )
    w, b, losses = numpy_linreg(X, y, lr, epochs, intercept=True)
    assert result.num_partitions == partitions
    assert result.terminated_by == "max_epochs" and result.epochs == epochs
    np.testing.assert_allclose(result.variables["w"], w, rtol=0, atol=1e-9)
    assert abs(float(result.variables["b"]) - b) < 1e-9
    np.testing.assert_allclose(result.outputs["loss"], losses, rtol=1e-9)
    assert sum(result.rows) == len(y)
    assert len(result.epoch_seconds) == epochs


def test_sync_is_deterministic_bit_for_bit(spark, regression):
    df, X, y = regression
    runs = [
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(4)},
            hi.ReplayableDataStreamList.not_replay(df),
            hi.IterationConfig(max_epochs=10),
            hi.IterationBody(LinRegPartition(FEATURES), GradientDescent(lr=0.3, total_rows=len(y))),
        )
        for _ in range(2)
    ]
    assert runs[0].variables["w"].tobytes() == runs[1].variables["w"].tobytes()


def test_empty_partitions_take_part(spark):
    # range splits 0..99 evenly over 3 partitions; the filter empties the third one.
    df = (
        spark.range(0, 99, numPartitions=3)
        .where("id < 50")
        .selectExpr("cast(id as double) / 50 as x0", "cast(2.0 * id / 50 + 1 as double) as y")
    )
    rows = [(r.x0, r.y) for r in df.collect()]
    X = np.array([[r[0]] for r in rows])
    y = np.array([r[1] for r in rows])
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(1)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(max_epochs=15, parallelism=3),
        hi.IterationBody(LinRegPartition(["x0"]), GradientDescent(lr=0.5, total_rows=len(y))),
    )
    w, _, _ = numpy_linreg(X, y, 0.5, 15)
    assert result.num_partitions == 3
    assert sorted(result.rows) == [50]
    np.testing.assert_allclose(result.variables["w"], w, atol=1e-12)
    assert result.subtask_epochs == {0: 15, 1: 15, 2: 15}


def test_forward_inputs_of_last_round_and_outputs_of_both_tiers(spark, regression):
    df, X, y = regression

    class EmitModel(GradientDescent):
        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            super().on_epoch_watermark_incremented(epoch, ctx, out)
            out.output("model", (epoch, self.w.copy()))

    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(4)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(max_epochs=5),
        hi.IterationBody(
            LinRegPartition(FEATURES),
            EmitModel(lr=0.3, total_rows=len(y)),
            listeners=[hi.ForwardInputsOfLastRound("model")],
        ),
    )
    (last,) = result.outputs["model"]
    assert last[0] == 4
    np.testing.assert_array_equal(last[1], result.variables["w"])
    assert len(result.outputs["loss"]) == 5
    assert {r.source for r in result.output_records if r.tag == "loss"} == {"coordinator"}


# -- several variables and data streams --------------------------------------------------


class TwoStreams(hi.PartitionOperator):
    """Stream 0: points (id, x); stream 1: per-id weights (id, weight). Fits the weighted
    mean of x, and reports which ids of each stream it saw."""

    def open(self, ctx):
        self.x, self.ids0, self.weights = {}, [], {}

    def process_data(self, stream, batch, ctx, out):
        d = batch.to_pydict()
        if stream == 0:
            self.x.update(zip(d["id"], d["x"]))
            self.ids0 += d["id"]
        else:
            self.weights.update(zip(d["id"], d["weight"]))

    def process_variables(self, variables, ctx, out):
        self.mean = float(variables["mean"])
        self.scale = variables["scale"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == 0:
            out.output("seen", (ctx.partition_id, sorted(self.ids0), sorted(self.weights)))
        num = sum(self.weights[i] * (self.x[i] - self.mean) for i in self.x)
        den = sum(self.weights[i] for i in self.x)
        out.feedback((num, den))


class MeanStep(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.mean = float(init_variables["mean"])
        self.acc = [0.0, 0.0]

    def process_feedback(self, value, ctx, out):
        self.acc[0] += value[0]
        self.acc[1] += value[1]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.mean += 0.5 * self.acc[0] / self.acc[1]
        self.acc = [0.0, 0.0]
        out.publish_variables(mean=self.mean, scale=np.full(3, epoch + 1.0))


@pytest.mark.parametrize("source_partitions, subtasks", [(3, 3), (3, 2), (4, 3)])
def test_two_streams_are_co_partitioned_and_two_variables_update(
    spark, source_partitions, subtasks
):
    n = 60
    points = spark.createDataFrame([(i, float(i % 7)) for i in range(n)], "id long, x double")
    weights = spark.createDataFrame([(i, 1.0 + i % 3) for i in range(n)], "id long, weight double")
    # co-partitioned inputs: the same ids live in partition j of both streams
    points = points.repartition(source_partitions, "id")
    weights = weights.repartition(source_partitions, "id")
    result = hi.iterate_bounded_streams_until_termination(
        {"mean": 0.0, "scale": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(points).and_not_replay(weights),
        hi.IterationConfig(max_epochs=30, parallelism=subtasks),
        hi.IterationBody(TwoStreams(), MeanStep()),
    )
    seen = result.outputs["seen"]
    assert sorted(p for p, _, _ in seen) == list(range(subtasks))
    for _, ids0, ids1 in seen:
        assert ids0 == ids1  # each subtask got matching partitions of both streams
    assert sorted(i for _, ids, _ in seen for i in ids) == list(range(n))
    w = np.array([1.0 + i % 3 for i in range(n)])
    x = np.array([float(i % 7) for i in range(n)])
    assert abs(float(result.variables["mean"]) - (w @ x) / w.sum()) < 1e-6
    np.testing.assert_array_equal(result.variables["scale"], np.full(3, 30.0))
    assert result.rows == [n, n]


@pytest.mark.parametrize("shape", ["coalesce", "union"])
def test_dataframes_spark_refuses_in_a_barrier_stage_still_run(spark, regression, shape):
    df, X, y = regression  # 3 partitions
    if shape == "coalesce":
        df2 = df.repartition(4).coalesce(2)
    else:
        half = df.where("id % 2 = 0").coalesce(1)
        df2 = half.unionByName(df.where("id % 2 = 1").coalesce(1))
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(4)},
        hi.ReplayableDataStreamList.not_replay(df2),
        hi.IterationConfig(max_epochs=5, parallelism=2),
        hi.IterationBody(LinRegPartition(FEATURES), GradientDescent(lr=0.3, total_rows=len(y))),
    )
    w, _, _ = numpy_linreg(X, y, 0.3, 5)
    np.testing.assert_allclose(result.variables["w"], w, atol=1e-9)
    assert result.repartitioned is True


# -- the coordinator's process -------------------------------------------------------------


def test_a_coordinator_that_ended_well_serves_the_drivers_next_run_from_a_clean_start(spark):
    """A run Ray never restarts (no checkpoints) takes the coordinator process the driver's
    previous run left (no process to start: the slow part of a short run), which starts
    from nothing of that run; a coordinator whose run failed is killed, not reused."""
    df = spark.range(40, numPartitions=2)

    def body(**kw):
        return hi.IterationBody(
            partition=Recorder(),
            coordinator=PidCoordinator(**kw),
            criteria=hi.TerminateOnMaxIter(3),
        )

    first = run(df, body(), parallelism=2)
    second = run(df, body(), init={"version": 5, "w": np.zeros(3)}, parallelism=2)
    (pid1,), (pid2,) = first.outputs["coordinator_pid"], second.outputs["coordinator_pid"]
    assert pid1 == pid2
    # nothing of the first run: its variables, outputs and epochs are the second's own
    assert second.outputs["init_names"] == [["version", "w"]]
    assert sorted(second.variables) == ["version", "w"] and second.variables["version"] == 8
    assert second.outputs["coord"] == first.outputs["coord"] and second.epochs == 3
    assert len(second.outputs["event"]) == len(first.outputs["event"])

    with pytest.raises(hi.IterationFailedError, match="coordinator fails at epoch 1"):
        run(df, body(fail_at=1), parallelism=2)
    third = run(df, body(), parallelism=2)
    (pid3,) = third.outputs["coordinator_pid"]
    assert pid3 != pid2  # the failed run's process (the reused one) was killed
    assert third.outputs["coord"] == first.outputs["coord"]
