"""benchmarks/bench_ps_sparse.py, reduced: its numpy floor is the same computation as a
``ps.train`` sync run on the hashed flights (the benchmark's 1e-12 check rests on it),
with the training rows laid out in partitions the way Spark really cut them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from hybrid_iter import ps

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ps_sparse.py"


def _bench():
    mod = sys.modules.get("bench_ps_sparse")
    if mod is None:
        spec = importlib.util.spec_from_file_location("bench_ps_sparse", BENCH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_ps_sparse"] = mod  # grad_fn pickles by value from here
        spec.loader.exec_module(mod)
    return mod


def test_the_numpy_floor_is_the_sync_run_and_the_layout_is_sparks(session):
    bench = _bench()
    data = bench.hashed_flights(3000, seed=3)
    assert data.h_tr.shape == (2400, 24) and len(data.y_te) == 600
    frames = bench.Frames(session.spark, data)
    try:
        # as Spark cut them (parallelize cuts at its pickling batches, not at n / 2)
        assert len(data.part_sizes) == 2 and sum(data.part_sizes) == 2400
        dim = 1 << 12  # narrow: ids of a row collide, as they may at any D
        floor = bench.NumpyFloor(dim)
        for _ in range(2):
            floor.epoch(data.ids(dim), data.y_tr, data.parts())
        train, _ = frames.ids(dim)
        spec = bench.lr_spec("sync")
        with bench.ProcWatch(every=0.1) as watch:
            out = ps.train(train, spec.grad_fn, epochs=2, **spec.kwargs())
        try:
            keys = np.unique(data.ids(dim))
            got = bench._compare_with_floor(floor, keys, {})(out)
            assert got == {"max_abs_diff_vs_numpy": 0.0, "keys_held_equal_keys_trained": True}
            assert np.count_nonzero(floor.w[keys]) > 0  # it learned something
            report = watch.report([s["cpu_seconds"] for s in out.shards])
            assert report["by_role"]["ps_shards"]["cpu_s"] > 0
            assert report["by_role"]["driver"]["processes"] == 1
        finally:
            out.close()
    finally:
        frames.release()
        frames.raw_tr.unpersist()
        frames.raw_te.unpersist()
