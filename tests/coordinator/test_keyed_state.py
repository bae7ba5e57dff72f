"""Local keyed state: stable key groups, snapshots by key group, and rescaling restore
(the local aggregation design's rules: local key groups spread evenly over the new
subtasks, instances of one key merged with the aggregate's merge). No Spark needed."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
from collections import defaultdict

import cloudpickle
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_ops import (
    AggregateFunction,
    KeyedStateSnapshot,
    KeyGroupRange,
    LocalKeyedState,
    key_group_of,
    key_group_range,
    redistribute,
)
from spark_ops.local_agg.keyed_state import key_groups_of, stable_hash, subtask_for_key_group


class Mean(AggregateFunction):
    """A mergeable mean; counts its calls so tests can tell the vectorized path ran."""

    def __init__(self):
        self.add_calls = 0
        self.batch_calls = 0

    def create_accumulator(self):
        return (0.0, 0)

    def add(self, value, acc):
        self.add_calls += 1
        return (acc[0] + value, acc[1] + 1)

    def add_batch(self, values, acc):
        self.batch_calls += 1
        return (acc[0] + float(values.sum()), acc[1] + len(values))

    def merge(self, a, b):
        return (a[0] + b[0], a[1] + b[1])

    def get_result(self, acc):
        return acc[0] / acc[1]


class Sum(AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + value

    def merge(self, a, b):
        return a + b

    def get_result(self, acc):
        return acc


class NoMerge(AggregateFunction):
    def create_accumulator(self):
        return set()

    def add(self, value, acc):
        acc.add(value)
        return acc

    def get_result(self, acc):
        return len(acc)


# -- key groups ----------------------------------------------------------------------------

KEYS = [0, 1, -1, 2**40, -(2**63), "", "a", "é", b"a", 2.5, None, ("a", 1), (1, (2, "x"))]


def test_stable_hash_is_the_same_in_another_process_with_another_hash_seed():
    code = f"from spark_ops.local_agg.keyed_state import stable_hash\nprint([stable_hash(k) for k in {KEYS!r}])"
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        outs.add(proc.stdout.strip())
    assert outs == {str([stable_hash(k) for k in KEYS])}


def test_keys_equal_in_python_share_a_key_group():
    assert len({stable_hash(k) for k in (1, 1.0, True, np.int64(1), np.float32(1.0))}) == 1
    assert stable_hash("a") != stable_hash(b"a")
    assert stable_hash((1, 2)) != stable_hash((2, 1))
    with pytest.raises(TypeError, match="state key"):
        stable_hash(object())
    with pytest.raises(TypeError, match="state key"):
        stable_hash([1, 2])


def test_key_groups_spread_keys_and_vectorized_matches_scalar():
    keys = np.array([-5, 0, 1, 7, 2**40, -(2**63), 2**63 - 1], dtype=np.int64)
    assert key_groups_of(keys, 128).tolist() == [key_group_of(int(k), 128) for k in keys]
    assert key_groups_of(["a", 2.0, None], 16).tolist() == [
        key_group_of(k, 16) for k in ["a", 2.0, None]
    ]
    groups = key_groups_of(np.arange(100_000), 128)
    counts = np.bincount(groups, minlength=128)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()


@pytest.mark.parametrize("maxp", [1, 7, 12, 128])
def test_key_group_ranges_tile_the_key_groups_and_match_the_owner_function(maxp):
    for p in range(1, min(maxp, 9) + 1):
        ranges = [key_group_range(i, p, maxp) for i in range(p)]
        assert ranges[0].start == 0 and ranges[-1].end == maxp
        assert all(a.end == b.start for a, b in itertools.pairwise(ranges))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
        for i, r in enumerate(ranges):
            assert all(subtask_for_key_group(g, p, maxp) == i for g in r)


def test_key_group_arguments_are_checked():
    with pytest.raises(ValueError, match="max_parallelism"):
        key_group_of(1, 0)
    with pytest.raises(ValueError, match="exceeds max_parallelism"):
        key_group_range(0, 5, 4)
    with pytest.raises(ValueError, match="subtask_index"):
        key_group_range(3, 3, 12)
    with pytest.raises(ValueError, match="start <= end"):
        KeyGroupRange(3, 2)
    assert 3 in KeyGroupRange(2, 4) and 4 not in KeyGroupRange(2, 4)


# -- the state -----------------------------------------------------------------------------


def test_add_batch_is_one_vectorized_call_per_key_and_equals_add():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 20, 1000)
    values = rng.random(1000)
    agg = Mean()
    batched = LocalKeyedState(agg)
    batched.add_batch(keys, values)
    assert agg.batch_calls == len(set(keys.tolist())) and agg.add_calls == 0
    one_by_one = LocalKeyedState(Mean())
    for k, v in zip(keys.tolist(), values.tolist()):
        one_by_one.add(k, v)
    assert batched.keys() and set(batched.keys()) == set(one_by_one.keys())
    for k in one_by_one.keys():
        assert batched.get(k) == pytest.approx(one_by_one.get(k))
        assert batched.accumulator(k)[1] == one_by_one.accumulator(k)[1]
    assert batched.get("missing", default=-1) == -1


def test_add_batch_with_string_keys_and_several_value_columns():
    class Dot(AggregateFunction):
        def create_accumulator(self):
            return 0.0

        def add(self, value, acc):
            return acc + value[0] * value[1]

        def merge(self, a, b):
            return a + b

        def get_result(self, acc):
            return acc

    state = LocalKeyedState(Dot())
    state.add_batch(np.array(["a", "b", "a"]), (np.array([1.0, 2.0, 3.0]), np.array([2, 2, 2])))
    assert state.results() == {"a": 8.0, "b": 4.0}
    with pytest.raises(ValueError, match="same length"):
        state.add_batch([1, 2], np.array([1.0]))


def test_state_needs_a_mergeable_aggregate_and_valid_subtask():
    with pytest.raises(TypeError, match="merge"):
        LocalKeyedState(NoMerge())
    with pytest.raises(TypeError, match="AggregateFunction"):
        LocalKeyedState(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Sum\(\)"):
        LocalKeyedState(Sum)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="subtask_index"):
        LocalKeyedState(Sum(), subtask_index=2, parallelism=2)


def test_drain_hands_out_partials_and_empties_the_state():
    state = LocalKeyedState(Sum())
    for k, v in [(1, 2), (2, 3), (1, 4)]:
        state.add(k, v)
    assert sorted(state.drain()) == [(1, 6), (2, 3)]
    assert len(state) == 0 and 1 not in state


# -- snapshots and rescaling ---------------------------------------------------------------


def fill(p: int, maxp: int, rows: list[tuple[int, int, float]]) -> list[LocalKeyedState]:
    """One state per old subtask; rows are (subtask, key, value): the same key in many."""
    states = [
        LocalKeyedState(Mean(), subtask_index=i, parallelism=p, max_parallelism=maxp)
        for i in range(p)
    ]
    for sub, key, value in rows:
        states[sub].add(key, value)
    return states


def random_rows(p: int, n: int = 2000, keys: int = 150, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [
        (int(s), int(k), float(v))
        for s, k, v in zip(rng.integers(0, p, n), rng.zipf(1.3, n) % keys, rng.random(n))
    ]


def reference(rows):
    acc: dict = defaultdict(lambda: (0.0, 0))
    for _, k, v in rows:
        s, c = acc[k]
        acc[k] = (s + v, c + 1)
    return dict(acc)


def test_snapshot_is_by_key_group_and_restores_to_the_same_state():
    maxp = 12
    (state,) = fill(1, maxp, random_rows(1))
    snap = state.snapshot()
    assert isinstance(snap, KeyedStateSnapshot)
    assert len({g.key_group for g in snap.key_groups}) == len(snap.key_groups)
    for g in snap.key_groups:
        assert all(key_group_of(k, maxp) == g.key_group for k in g.keys)
    assert snap.num_entries == len(state)
    # a checkpoint pickles it; a restore needs nothing but the aggregate
    back = LocalKeyedState.restore(Mean(), pickle.loads(pickle.dumps(snap)))
    assert back.results() == state.results()
    assert back.snapshot() == snap


@pytest.mark.parametrize("new_p", [2, 5])
def test_rescale_by_key_group_puts_every_key_in_one_subtask_with_its_full_value(new_p):
    maxp, rows = 12, random_rows(3)
    snaps = [s.snapshot() for s in fill(3, maxp, rows)]
    parts = redistribute(snaps, new_p, strategy="key_group")
    restored = [LocalKeyedState.restore(Mean(), part) for part in parts]
    expected = reference(rows)
    owners = defaultdict(list)
    for i, state in enumerate(restored):
        assert (state.subtask_index, state.parallelism) == (i, new_p)
        for k in state.keys():
            owners[k].append(i)
            assert key_group_of(k, maxp) in key_group_range(i, new_p, maxp)
    assert set(owners) == set(expected)
    for k, (s, c) in expected.items():
        (owner,) = owners[k]
        acc = restored[owner].accumulator(k)
        assert acc[1] == c and acc[0] == pytest.approx(s)


@pytest.mark.parametrize("new_p", [2, 5])
def test_rescale_even_follows_the_design_and_merges_instances_of_a_key(new_p):
    """Section 2.1: the 3 x 12 local key groups, in (old subtask, key group) order, are
    cut into new_p runs of nearly equal length; section 2.2: instances of one key that
    land in one new subtask are merged."""
    p, maxp, rows = 3, 12, random_rows(3)
    old = fill(p, maxp, rows)
    parts = redistribute([s.snapshot() for s in old], new_p)
    restored = [LocalKeyedState.restore(Mean(), part) for part in parts]

    total = p * maxp
    runs = [range(-(-i * total // new_p), -(-(i + 1) * total // new_p)) for i in range(new_p)]
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    for i, state in enumerate(restored):
        # the expected value of each key in new subtask i: merge of the old instances whose
        # (old subtask, key group) slot falls in run i
        want: dict = {}
        for sub, o in enumerate(old):
            for k in o.keys():
                if sub * maxp + key_group_of(k, maxp) in runs[i]:
                    a = o.accumulator(k)
                    w = want.get(k, (0.0, 0))
                    want[k] = (w[0] + a[0], w[1] + a[1])
        assert set(state.keys()) == set(want)
        for k, (s, c) in want.items():
            assert state.accumulator(k)[1] == c
            assert state.accumulator(k)[0] == pytest.approx(s)
    # nothing lost, nothing counted twice
    merged: dict = defaultdict(lambda: (0.0, 0))
    for state in restored:
        for k, (s, c) in state.items():
            merged[k] = (merged[k][0] + s, merged[k][1] + c)
    expected = reference(rows)
    assert {k: c for k, (_, c) in merged.items()} == {k: c for k, (_, c) in expected.items()}
    if new_p == 2:
        # run 0 = old subtask 0 + the first half of old subtask 1: keys of those key
        # groups held by both old subtasks were merged into one accumulator
        both = [k for k in old[0].keys() if k in old[1] and key_group_of(k, maxp) < maxp // 2]
        assert both
        for k in both:
            assert restored[0].accumulator(k)[1] == (
                old[0].accumulator(k)[1] + old[1].accumulator(k)[1]
            )


@settings(max_examples=25, deadline=None)
@given(
    old_p=st.integers(1, 4),
    new_p=st.integers(1, 6),
    maxp=st.sampled_from([6, 8, 16]),
    strategy=st.sampled_from(["even", "key_group"]),
    rows=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.one_of(st.integers(-5, 30), st.text(max_size=2)),
            st.integers(-9, 9),
        ),
        max_size=60,
    ),
)
def test_any_rescale_keeps_every_keys_total(old_p, new_p, maxp, strategy, rows):
    states = [
        LocalKeyedState(Sum(), subtask_index=i, parallelism=old_p, max_parallelism=maxp)
        for i in range(old_p)
    ]
    expected: dict = defaultdict(int)
    for sub, key, value in rows:
        states[sub % old_p].add(key, value)
        expected[key] += value
    parts = redistribute([s.snapshot() for s in states], new_p, strategy=strategy)
    got: dict = defaultdict(int)
    for part in parts:
        restored = LocalKeyedState.restore(Sum(), part)
        assert len(restored) == len(set(restored.keys()))
        for k, v in restored.results().items():
            got[k] += v
    assert dict(got) == dict(expected)


def test_restore_continues_and_snapshots_again_without_duplicates():
    snaps = [s.snapshot() for s in fill(3, 12, random_rows(3))]
    state = LocalKeyedState.restore_rescaled(Mean(), snaps, subtask_index=0, parallelism=2)
    before = {k: state.accumulator(k)[1] for k in state.keys()}
    key = next(iter(before))
    state.add(key, 1.0)
    again = state.snapshot()
    assert len({g.key_group for g in again.key_groups}) == len(again.key_groups)
    assert LocalKeyedState.restore(Mean(), again).accumulator(key)[1] == before[key] + 1


class CountingOperator:
    """What an iteration PartitionOperator does: hold the state, snapshot/restore it."""

    def __init__(self):
        self.state = None

    def open(self, partition_id, num_partitions):
        self.state = LocalKeyedState(
            Mean(), subtask_index=partition_id, parallelism=num_partitions, max_parallelism=16
        )

    def process(self, keys, values):
        self.state.add_batch(keys, values)

    def snapshot_state(self):
        return self.state.snapshot()

    def restore_state(self, state):
        self.state = LocalKeyedState.restore(Mean(), state)


def test_a_partition_operator_checkpoints_and_rescales_its_state():
    rng = np.random.default_rng(3)
    ops = []
    for i in range(3):
        op = CountingOperator()
        op.open(i, 3)
        op.process(rng.integers(0, 40, 500), rng.random(500))
        ops.append(op)
    blobs = [cloudpickle.dumps(op.snapshot_state()) for op in ops]  # the checkpoint
    parts = redistribute([pickle.loads(b) for b in blobs], 2)
    new_ops = []
    for part in parts:
        op = CountingOperator()
        op.restore_state(part)
        new_ops.append(op)
    count = lambda states: sum(s.accumulator(k)[1] for s in states for k in s.keys())  # noqa: E731
    assert count([o.state for o in new_ops]) == count([o.state for o in ops]) == 1500


def test_redistribute_and_restore_arguments_are_checked():
    snaps = [s.snapshot() for s in fill(3, 12, random_rows(3, n=50))]
    with pytest.raises(ValueError, match="every old subtask"):
        redistribute(snaps[:2], 2)
    with pytest.raises(ValueError, match="same subtask"):
        redistribute([snaps[0], snaps[0], snaps[1]], 2)
    with pytest.raises(ValueError, match="exceeds max_parallelism"):
        redistribute(snaps, 13)
    with pytest.raises(ValueError, match="strategy"):
        redistribute(snaps, 2, strategy="random")
    with pytest.raises(ValueError, match="empty"):
        redistribute([], 2)
    with pytest.raises(TypeError, match="KeyedStateSnapshot"):
        redistribute([{"not": "a snapshot"}], 1)  # type: ignore[list-item]
    other = fill(1, 8, [(0, 1, 1.0)])[0].snapshot()
    with pytest.raises(ValueError, match="max_parallelism"):
        redistribute([snaps[0], other], 2)
    with pytest.raises(TypeError, match="redistribute"):
        LocalKeyedState.restore(Mean(), snaps)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        KeyedStateSnapshot(0, 1, 4, (), version=99)
