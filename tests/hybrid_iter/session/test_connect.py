"""``Session.attach`` of a Spark Connect client: bounded iterations and the ml
estimators and ``ps.train`` run through the coordinator's and the shards' endpoints
with no Ray (nor py4j) beside the server's tasks, and give the classic session's
results; online iterations are refused before any job. Before this process has Ray: the
client is recognised as Connect, ``Session.attach`` to an unreachable Ray is refused with
no job run, and a job tag cancels a Connect job. One Connect server (``connect_attach_job.py``,
a process of its own) serves every check; the classic side runs here."""

from __future__ import annotations

import numpy as np
import pytest
from checkpoint_job import ROWS
from connect_attach_job import EPOCHS, feature_names, features
from connect_ops import WhereLinReg, ps_run, with_class
from fresh_process import run_job
from ops import GradientDescent, Recorder, RecordingCoordinator

import hybrid_iter as hi
from spark_ops import _spark_compat as compat

pytestmark = [
    pytest.mark.spark_lines,  # the compatibility set every CI environment runs
    pytest.mark.skipif(
        not compat.dataframe_barrier_paths(None),
        reason=f"Spark Connect clients run on PySpark >= 4.1 (DataFrame.repartitionById); "
        f"this is {compat.spark_version_string()}",
    ),
    pytest.mark.integration,  # a Spark Connect server of its own
]


#: the Connect job starts once collection ends, beside the tests before these
#: (``fresh_process.py``); where these tests skip, it does not start
EARLY_JOBS = [("connect_attach_job", "all")] if compat.dataframe_barrier_paths(None) else []


@pytest.fixture(scope="module")
def connect():
    return run_job(
        "connect_attach_job", "all", timeout=480
    )  # under pytest-timeout: a hang reports its stderr


def _ok(connect, name):
    got = connect[name]
    assert "error" not in got or got.get("where") is not None, got.get("trace", got)
    return got


def _no_ray_in_subtasks(where):
    assert sorted(p for p, _ in where) == [0, 1]
    assert [used for _, used in where] == [False, False]  # no subtask imported Ray


def test_a_connect_client_attaches_without_a_jvm(connect):
    assert "sc://127.0.0.1:" in connect["session"]
    assert connect["client_jvm"] is False
    assert connect["client_classic_context"] is False


def test_a_connect_session_is_recognised(connect, spark):
    from spark_ops._spark_compat import is_connect

    lines = _ok(connect, "lines")
    assert lines["is_connect"] is True and is_connect(spark) is False
    assert lines["rows"] == 5


def test_attach_of_a_connect_session_to_an_unreachable_ray_fails_naming_it_before_any_job(
    connect,
):
    lines = _ok(connect, "lines")
    assert lines["attach"] == "refused"
    assert "127.0.0.1:1" in lines["attach_message"]
    assert lines["jobs_for_attach"] == 0
    assert lines["ray_initialized"] is False


def test_a_job_tag_cancels_a_connect_job(connect):
    lines = _ok(connect, "lines")
    assert lines["job_started"] is True
    assert lines["cancel"]["result"] == "failed", lines["cancel"]  # not ended by its own bound


def test_a_sync_iteration_over_connect_equals_the_classic_run_bit_for_bit(connect, spark):
    got = _ok(connect, "sync")
    names = feature_names()
    classic = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(len(names)), "b": 0.0},
        hi.ReplayableDataStreamList.not_replay(features(spark)),
        hi.IterationConfig(max_epochs=EPOCHS, parallelism=2),
        hi.IterationBody(
            WhereLinReg(names), GradientDescent(lr=0.3, total_rows=ROWS, intercept=True)
        ),
    )
    assert got["terminated_by"] == "max_epochs" and got["epochs"] == EPOCHS
    assert np.array(got["w"]).tobytes() == classic.variables["w"].tobytes()
    assert got["b"] == float(classic.variables["b"])
    assert got["loss"] == classic.outputs["loss"]
    _no_ray_in_subtasks(got["where"])


def test_an_async_iteration_over_connect_runs_every_epoch(connect):
    got = _ok(connect, "async")
    assert got["subtask_epochs"] == {"0": 30, "1": 30}
    from checkpoint_job import DIMS

    np.testing.assert_allclose(got["w"], np.arange(1.0, DIMS + 1), atol=0.1)
    _no_ray_in_subtasks(got["where"])


def test_termination_over_connect_calls_back_as_the_classic_run(connect, spark):
    got = _ok(connect, "termination")
    classic = hi.iterate_bounded_streams_until_termination(
        {"version": 0},
        hi.ReplayableDataStreamList.not_replay(spark.range(40, numPartitions=2)),
        hi.IterationConfig(parallelism=2, max_epochs=50),
        hi.IterationBody(Recorder(criteria_until=3), RecordingCoordinator(), criteria=True),
    )
    assert got["terminated_by"] == classic.terminated_by == "criteria"
    assert got["epochs"] == classic.epochs == 4
    assert got["events"] == sorted(map(list, classic.outputs["event"]))
    assert got["coord"] == [list(c) for c in classic.outputs["coord"]]


def test_a_large_variable_reaches_every_subtask_over_connect(connect):
    from connect_attach_job import BIG

    got = _ok(connect, "large")
    by_epoch = {(p, e): (v, n) for p, e, v, n in got["seen"]}
    for p in (0, 1):
        for e in (1, 2):
            assert by_epoch[(p, e)] == (float(e), BIG)
    _no_ray_in_subtasks(got["where"])


def test_a_fault_over_connect_is_restored_from_a_checkpoint_bit_for_bit(connect):
    got = _ok(connect, "restore")
    assert got["attempts"] == 1
    assert got["restored_from"].endswith("chk-0000000012.ckpt")
    assert got["same"] is True


def test_ml_estimators_over_connect_equal_the_classic_fits(connect, spark):
    from hybrid_iter.ml import KMeans, LinearRegression, LogisticRegression

    got = _ok(connect, "ml")
    names = feature_names()
    df = features(spark)
    lin = LinearRegression(features_col=names, label_col="y", parallelism=2).fit(df)
    log = LogisticRegression(features_col=names, label_col="c", parallelism=2).fit(with_class(df))
    km = KMeans(features_col=names, k=3, seed=7, parallelism=2).fit(df)
    np.testing.assert_allclose(
        got["linear"], [*lin.coefficients, lin.intercept], rtol=1e-10, atol=1e-12
    )
    np.testing.assert_allclose(
        got["logistic"], [*log.coefficients, log.intercept], rtol=1e-10, atol=1e-12
    )
    np.testing.assert_allclose(got["kmeans"], km.cluster_centers, rtol=1e-10, atol=1e-12)


def test_ps_train_over_connect_equals_the_classic_run_bit_for_bit(connect, spark):
    # the server's Python workers cannot import Ray: every pull and push went through
    # the shards' endpoints
    got = _ok(connect, "ps_train")
    classic = ps_run(features(spark), feature_names())
    assert np.array(got["w"]).tobytes() == np.array(classic["w"]).tobytes()
    assert got["b"] == classic["b"]
    assert all(calls > 0 for calls in got["endpoint_calls"]), got
    assert classic["endpoint_calls"] == [0, 0]  # the classic session's tasks used Ray


def test_an_online_iteration_on_connect_is_refused_before_any_job(connect):
    got = connect["online"]
    assert got.get("refused") is True, got
    assert "Spark Connect session of sc://127.0.0.1:" in got["message"]
    assert "classic SparkSession" in got["message"]  # the fix
    assert got["jobs"] == 0 and got["named_actors"] == 0 and got["queries"] == 0


def test_an_unreachable_endpoint_fails_a_connect_run_naming_the_address(connect):
    got = connect["unreachable"]
    assert got["type"] == "IterationFailedError", got
    assert got["error"].startswith(
        f"the iteration failed: a subtask could not use its coordinator: EndpointError: "
        f"the coordinator endpoint at {got['where']} cannot be reached within 5 s"
    )
    assert "advertise" in got["error"]
