"""benchmarks/bench_ps_sparse.py, reduced: its numpy floor is the same computation as a
``ps.train`` sync run on the hashed flights (the benchmark's 1e-12 check rests on it),
with the training rows laid out in partitions the way Spark really cut them; and the
benchmarks' process watch it reports CPU and memory by: a peak between two samples is
held, a peak before the watch is not, a process started from any thread is seen."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from paths import BENCHMARKS

from hybrid_iter import ps

# how bench_ps_sparse.py finds its package and the harness: the benchmarks' folder
if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))

from _harness import Watch, reset_peak, role, tree
from ps_sparse.data import Frames, hashed_flights
from ps_sparse.floor import NumpyFloor
from ps_sparse.models import lr_spec
from ps_sparse.runs import compare_with_floor

MIB = 2**20

#: a process that, per line read, takes that many MiB (touched), gives them back, says so
ALLOCATOR = """
import sys
for line in sys.stdin:
    block = b"x" * (int(line) << 20)
    del block
    print("done", flush=True)
"""

#: a process that starts a child from a thread other than its main one (the thread stays:
#: the kernel lists the child under that thread, not under the process), prints its pid
#: and waits for its stdin to close
STARTS_FROM_A_THREAD = """
import subprocess, sys, threading
done = threading.Event()
def start():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    print(child.pid, flush=True)
    done.wait()
    child.stdin.close()
    child.wait()
thread = threading.Thread(target=start)
thread.start()
sys.stdin.read()
done.set()
thread.join()
"""


def _take(child: subprocess.Popen, mib: int) -> None:
    child.stdin.write(f"{mib}\n")
    child.stdin.flush()
    assert child.stdout.readline() == "done\n"


def test_a_watch_holds_a_peak_between_samples_and_not_one_before_it():
    child = subprocess.Popen(
        [sys.executable, "-c", ALLOCATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        if not reset_peak(child.pid):
            pytest.skip("this kernel does not let a process reset another's peak memory")
        _take(child, 160)  # before the watch
        # no sample between the start and the end: the peak is the kernel's high-water mark
        with Watch(pids=[child.pid], interval=3600) as watch:
            _take(child, 60)
        start, peak = watch.start[child.pid], watch.peak_one()
        assert start + 55 * MIB <= peak < start + 100 * MIB, (start / MIB, peak / MIB)
        assert max(watch.samples[-1].rss.values()) < start + 30 * MIB  # given back
        assert watch.report()["by_role"]["other"]["processes"] == 1
    finally:
        child.stdin.close()
        child.wait()


def test_a_tree_holds_the_children_a_thread_started():
    child = subprocess.Popen(
        [sys.executable, "-c", STARTS_FROM_A_THREAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= set(tree(child.pid))
        assert role(grandchild, driver=child.pid) == "other"
        assert role(child.pid, driver=child.pid) == "driver"
    finally:
        child.stdin.close()
        child.wait()


def test_the_numpy_floor_is_the_sync_run_and_the_layout_is_sparks(session):
    data = hashed_flights(3000, seed=3)
    assert data.h_tr.shape == (2400, 24) and len(data.y_te) == 600
    frames = Frames(session.spark, data)
    try:
        # as Spark cut them (parallelize cuts at its pickling batches, not at n / 2)
        assert len(data.part_sizes) == 2 and sum(data.part_sizes) == 2400
        dim = 1 << 12  # narrow: ids of a row collide, as they may at any D
        floor = NumpyFloor(dim)
        for _ in range(2):
            floor.epoch(data.ids(dim), data.y_tr, data.parts())
        train, _ = frames.ids(dim)
        spec = lr_spec("sync")
        with Watch(interval=0.1) as watch:
            out = ps.train(train, spec.grad_fn, epochs=2, **spec.kwargs())
        try:
            keys = np.unique(data.ids(dim))
            got = compare_with_floor(floor, keys, {})(out)
            assert got == {"max_abs_diff_vs_numpy": 0.0, "keys_held_equal_keys_trained": True}
            assert np.count_nonzero(floor.w[keys]) > 0  # it learned something
            report = watch.report({"ps_shards": [s["cpu_seconds"] for s in out.shards]})
            assert report["by_role"]["ps_shards"]["cpu_s"] > 0
            assert report["by_role"]["driver"]["processes"] == 1
        finally:
            out.close()
    finally:
        frames.release()
        frames.raw_tr.unpersist()
        frames.raw_te.unpersist()
