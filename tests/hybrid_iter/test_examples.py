"""The examples, run small on the shared session: they must train what they claim."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest
from paths import EXAMPLES

import hybrid_iter as hi


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = module  # operators pickle by value from here
    spec.loader.exec_module(module)
    return module


def test_logistic_regression_sync_and_async_reach_the_true_models_accuracy(session):
    lr = load("logistic_regression")
    summary = lr.main(
        session, rows=40_000, features=10, partitions=2, max_epochs=150, batch_rows=2_000
    )
    for mode in ("sync", "async"):
        s = summary[mode]
        assert s["accuracy"] >= s["oracle_accuracy"] - 0.01, (mode, s)
        assert np.isfinite(s["final_loss"]) and s["final_loss"] < 0.6
    assert summary["sync"]["terminated_by"] in ("criteria", "max_epochs")
    assert summary["async"]["terminated_by"] == "max_epochs"


def test_linear_regression_recovers_the_weights(session):
    ex = load("linear_regression")
    result = ex.main(session, rows=20_000, features=5, partitions=2, epochs=300, progress=False)
    w_true = np.linspace(-2.0, 2.0, 5)
    np.testing.assert_allclose(result.variables["w"], w_true, atol=0.02)
    assert abs(float(result.variables["b"]) - 1.5) < 0.02
    assert result.terminated_by == "criteria" and result.epochs < 300


def test_linear_regression_mini_batches(session):
    ex = load("linear_regression")
    result = ex.main(
        session, rows=20_000, features=5, partitions=2, epochs=300, batch_rows=1_000, progress=False
    )
    np.testing.assert_allclose(result.variables["w"], np.linspace(-2.0, 2.0, 5), atol=0.05)


def test_kmeans_finds_the_blobs_and_is_deterministic_for_a_seed(session):
    km = load("kmeans")
    df, means = km.generate(session.spark, 20_000, 4, 5, 2, seed=3)
    df = df.cache()
    cols = [f"x{j}" for j in range(4)]
    a = km.fit(df, cols, 5, seed=3, max_iter=40, tol=1e-6, progress=False)
    b = km.fit(df, cols, 5, seed=3, max_iter=40, tol=1e-6, progress=False)
    assert a.variables["centres"].tobytes() == b.variables["centres"].tobytes()
    assert not np.isnan(a.variables["centres"]).any()
    costs = a.outputs["cost"]
    # Lloyd's iterations never increase the cost
    assert all(c2 <= c1 * (1 + 1e-12) for c1, c2 in itertools.pairwise(costs))
    df.unpersist()


def test_kmeans_empty_cluster_keeps_its_centre(session):
    km = load("kmeans")
    df = session.spark.createDataFrame(
        [(float(i % 5), float(i % 3)) for i in range(200)], "x0 double, x1 double"
    ).repartition(2)
    far = [1000.0, 1000.0]
    result = hi.iterate_bounded_streams_until_termination(
        {"centres": np.array([[0.0, 0.0], [4.0, 2.0], far])},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(max_epochs=5),
        hi.IterationBody(km.Assign(["x0", "x1"]), km.Centres()),
    )
    centres = result.variables["centres"]
    assert not np.isnan(centres).any()
    np.testing.assert_array_equal(centres[2], far)
    assert result.outputs["empty_clusters"] == [1] * 5


@pytest.mark.integration
def test_the_readme_main_job_runs_as_a_script():
    """The README's first command runs this script; run it small, as a user would."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "logistic_regression.py"),
            "--rows",
            "20000",
            "--features",
            "5",
            "--max-epochs",
            "40",
            "--batch-rows",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "generated 20,000 x 5 points" in out
    for mode in ("sync", "async"):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{mode}:"))
        assert "final loss" in line and "accuracy" in line and "terminated by" in line
    assert "epoch" in proc.stderr  # the live progress line
