"""Bulk and delta iterations (DataSet iterate / iterateDelta), via the shipped examples."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from paths import EXAMPLES

import hybrid_iter as hi


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("replay", [False, True])
def test_pagerank_bulk_iteration_matches_numpy(session, replay):
    pr = load("pagerank_bulk")
    result, reference = pr.main(
        session,
        nodes=3000,
        max_iter=25 if not replay else 6,
        tol=1e-9,
        replay=replay,
        progress=False,
    )
    np.testing.assert_allclose(result.variables["rank"], reference, rtol=0, atol=1e-15)
    assert abs(result.variables["rank"].sum() - 1.0) < 1e-12
    assert (result.replay.rounds if result.replay else result.epochs) == result.epochs


def test_pagerank_stops_when_converged(session):
    pr = load("pagerank_bulk")
    result, _ = pr.main(session, nodes=2000, max_iter=200, tol=1e-6, progress=False)
    assert result.terminated_by == "criteria" and result.epochs < 200
    assert result.outputs["converged"][-1] is True and not any(result.outputs["converged"][:-1])


@pytest.mark.parametrize("replay", [False, True])
def test_connected_components_delta_iteration_matches_union_find(session, replay):
    cc = load("connected_components_delta")
    result, reference = cc.main(session, nodes=2000, components=6, replay=replay, progress=False)
    assert result.variables["solution"].tolist() == reference
    sizes = result.outputs["workset_size"]
    assert sizes[-1] == 0 and all(s > 0 for s in sizes[:-1])  # ends when the workset empties
    assert result.terminated_by == "criteria" and result.epochs == len(sizes)


class Sum(hi.BulkStep):
    def partial(self, data, solution, ctx):
        return sum(b.num_rows for b in data)

    def next_solution(self, solution, combined, round_):
        return {"x": np.asarray(float(combined))}


def test_bulk_and_delta_arguments(spark):
    df = spark.range(10)
    with pytest.raises(hi.IterationConfigError, match="max_iter"):
        hi.iterate_bulk({"x": 0.0}, df, Sum(), max_iter=0)
    with pytest.raises(hi.IterationConfigError, match="BulkStep"):
        hi.iterate_bulk({"x": 0.0}, df, object(), max_iter=3)  # type: ignore[arg-type]
    with pytest.raises(hi.IterationConfigError, match="as a DataFrame"):
        hi.iterate_bulk({"x": 0.0}, hi.ReplayableDataStreamList.replay(df), Sum(), max_iter=3)
    cc = load("connected_components_delta")
    with pytest.raises(hi.IterationConfigError, match=r"workset keys must be in \[0, 5\)"):
        hi.iterate_delta(np.arange(5), [7], df, cc.MinLabel(), max_iter=3)
    with pytest.raises(hi.IterationConfigError, match="1-D numeric"):
        hi.iterate_delta(np.zeros((2, 2)), [0], df, cc.MinLabel(), max_iter=3)

    class NotUfunc(cc.MinLabel):
        combine = min

    with pytest.raises(hi.IterationConfigError, match="ufunc"):
        hi.iterate_delta(np.arange(5), [0], df, NotUfunc(), max_iter=3)
    result = hi.iterate_bulk({"x": 0.0}, df, Sum(), max_iter=3)
    assert (float(result.variables["x"]), result.epochs) == (10.0, 3)
