"""The pure pieces of the sparse parameter server, without Spark or Ray: the hash index
(against a dict), the routing hash, the per-key initializer (Philox against numpy's, the
same value whatever the batching or order), the update rules (FTRL and Adagrad against a
per-coordinate reference formula; dense, sparse and table paths giving the same bits),
the CSR reader (against Arrow's own rows, any width), the CSR helpers (against dense
numpy), a shard's table protocol (rows created once, pushes aligned with what was sent,
NaN refused naming the key, fencing, snapshot and restore), the evaluation metrics
(against scikit-learn)."""

from __future__ import annotations

import asyncio
import math
import tracemalloc

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_iter as hi
from coordinator._errors import StaleShardCall
from coordinator._ps import FreeShard, ParameterShard, ShardSpec
from coordinator._rules import AdagradRule, FTRLRule, SGDRule, ftrl_step
from coordinator._tables import (
    Init,
    KeyIndex,
    TableSpec,
    init_rows,
    mix64,
    philox4x64,
    shard_of,
)
from hybrid_iter import ps
from hybrid_iter.ml._features import read_csr
from hybrid_iter.ps._client import TablePlan, step_keys
from hybrid_iter.ps._epochs import auc, hot_keys, log_loss

int64s = st.integers(-(2**63), 2**63 - 1)
ZEROS = Init()

# -- the index --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(int64s, max_size=40), max_size=12), st.lists(int64s, max_size=30))
def test_the_index_maps_keys_to_rows_like_a_dict(batches, probes):
    """Batches of keys (duplicates across batches, any int64) inserted with
    find_or_insert: rows are numbered in first-touch order and found again, through
    every growth of the index; absent keys are -1."""
    index = KeyIndex(capacity=16)
    ref: dict[int, int] = {}
    for batch in batches:
        keys = np.array(list(dict.fromkeys(batch)), dtype=np.int64)
        unseen = [i for i, k in enumerate(keys) if int(k) not in ref]
        rows, new = index.find_or_insert(keys)
        for k in keys:
            ref.setdefault(int(k), len(ref))
        assert [ref[int(k)] for k in keys] == rows.tolist()
        assert new.tolist() == unseen
    everything = np.array(list(ref), dtype=np.int64)
    assert index.find(everything).tolist() == list(range(len(ref)))
    absent = np.array([p for p in probes if p not in ref], dtype=np.int64)
    assert (index.find(absent) == -1).all()
    assert index.keys().tolist() == list(ref)
    rebuilt = KeyIndex.of(index.keys())
    assert rebuilt.find(everything).tolist() == list(range(len(ref)))


def test_the_index_at_full_load_and_with_colliding_homes():
    """Keys whose home slots collide (a cluster), and an index grown to its load limit,
    are still found exactly."""
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64))
    index = KeyIndex(capacity=16)
    for part in np.array_split(keys, 7):
        index.insert_new(part)
    assert index.n / index.cap <= 0.5
    np.testing.assert_array_equal(index.find(keys), np.arange(len(keys)))
    # keys sharing one home slot: a long probe sequence
    small = KeyIndex(capacity=1024)
    home = small._home(keys)
    same = keys[home == home[0]]
    more = keys[home == (home[0] + 1) % small.cap]
    small.insert_new(np.concatenate([same, more]))
    np.testing.assert_array_equal(small.find(same), np.arange(len(same)))


def test_routing_spreads_sequential_and_hashed_keys_evenly():
    for keys in (np.arange(300_000), np.arange(300_000) * 4096, -np.arange(300_000)):
        for n in (2, 3, 7):
            counts = np.bincount(shard_of(keys, n), minlength=n)
            assert counts.min() > 0.97 * len(keys) / n, (n, counts)
    assert (shard_of(np.arange(10), 1) == 0).all()
    # the slot hash is not the shard hash: a shard's keys use all of its slots
    keys = np.arange(100_000)[shard_of(np.arange(100_000), 2) == 0]
    index = KeyIndex.of(keys)
    assert len(np.unique(index._home(keys) % 2)) == 2
    assert mix64(np.array([0]))[0] != 0


# -- the initializer ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=4, max_size=4), st.integers(0, 2**64 - 1))
def test_philox_is_numpys_philox4x64(counter, key):
    """numpy's Philox increments its counter before each block: our block of counter c is
    its first block from counter c - 1."""
    if counter[0] == 0:
        counter[0] = 1
    start = np.array([counter[0] - 1, *counter[1:]], dtype=np.uint64)
    want = np.random.Philox(counter=start, key=np.array([key, 0], dtype=np.uint64)).random_raw(4)
    got = philox4x64([np.array([c], dtype=np.uint64) for c in counter], (key, 0))
    assert [int(g[0]) for g in got] == [int(w) for w in want]


def test_philox_known_answer():
    """Random123's known-answer vector of philox4x64-10 for a zero counter and key."""
    got = philox4x64([np.zeros(1, dtype=np.uint64)] * 4, (0, 0))
    assert [int(g[0]) for g in got] == [
        0x16554D9ECA36314C,
        0xDB20FE9D672D0FDC,
        0xD7E772CEE186176B,
        0x7E68B68AEC7BA23B,
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(int64s, min_size=1, max_size=60, unique=True),
    st.integers(1, 9),
    st.integers(0, 2**63),
    st.randoms(use_true_random=False),
)
def test_a_rows_initial_value_depends_on_its_seed_and_key_only(keys, dim, seed, rnd):
    """Any batching and order give each key the same row."""
    for init in (
        Init("normal", {"std": 0.1, "mean": 0.5}, seed),
        Init("uniform", {"low": -1, "high": 2}, seed),
    ):
        whole = init_rows(init, np.array(keys, dtype=np.int64), dim)
        order = list(range(len(keys)))
        rnd.shuffle(order)
        cut = rnd.randint(0, len(keys))
        parts = [order[:cut], order[cut:]]
        for part in parts:
            got = init_rows(init, np.array([keys[i] for i in part], dtype=np.int64), dim)
            np.testing.assert_array_equal(got, whole[part])
        assert np.isfinite(whole).all()
    assert not np.array_equal(
        init_rows(Init("normal", {"std": 1.0}, 1), np.array([5]), 4),
        init_rows(Init("normal", {"std": 1.0}, 2), np.array([5]), 4),
    )


def test_the_normal_initializer_is_normal():
    z = init_rows(Init("normal", {"std": 2.0, "mean": 1.0}, 3), np.arange(100_000), 8)
    assert abs(z.mean() - 1.0) < 0.02 and abs(z.std() - 2.0) < 0.02
    # the columns of a row are not copies of each other
    assert abs(np.corrcoef(z[:, 0], z[:, 1])[0, 1]) < 0.02
    u = init_rows(Init("uniform", {"low": -1.0, "high": 1.0}, 3), np.arange(50_000), 3)
    assert u.min() >= -1 and u.max() < 1 and abs(u.mean()) < 0.02


# -- update rules -------------------------------------------------------------------------------


def _ftrl_reference(w, z, n, g, alpha, beta, l1, l2):
    """McMahan et al. 2013, Algorithm 1, one coordinate at a time in plain floats."""
    sigma = (math.sqrt(n + g * g) - math.sqrt(n)) / alpha
    z = z + (g - sigma * w)
    n = n + g * g
    if abs(z) <= l1:
        return 0.0, z, n
    sign = 1.0 if z > 0 else -1.0
    return -(z - sign * l1) / ((beta + math.sqrt(n)) / alpha + l2), z, n


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-5, 5), min_size=1, max_size=8),
    st.floats(0.01, 2),
    st.floats(0.01, 2),
    st.floats(0, 1),
    st.floats(0, 1),
)
def test_ftrl_is_the_reference_formula(grads, alpha, beta, l1, l2):
    w, z, n = np.array([0.3]), np.zeros(1), np.zeros(1)
    rw, rz, rn = 0.3, 0.0, 0.0
    for g in grads:
        w, z, n = ftrl_step(w, z, n, np.array([g]), alpha, beta, l1, l2)
        rw, rz, rn = _ftrl_reference(rw, rz, rn, g, alpha, beta, l1, l2)
        assert abs(w[0] - rw) <= 1e-12 * max(1.0, abs(rw))
        assert abs(z[0] - rz) <= 1e-12 * max(1.0, abs(rz)) and n[0] == pytest.approx(rn, rel=1e-15)


@pytest.mark.parametrize(
    "rule, kwargs",
    [
        (SGDRule, {"learning_rate": 0.3, "momentum": 0.5, "l2": 0.1}),
        (AdagradRule, {"learning_rate": 0.3, "initial_accumulator": 0.1, "l2": 0.01}),
        (FTRLRule, {"alpha": 0.2, "beta": 1.0, "l1": 0.05, "l2": 0.1}),
    ],
)
def test_dense_sparse_and_table_paths_of_a_rule_give_the_same_bits(rule, kwargs):
    rng = np.random.default_rng(1)
    size = 12
    dense = rule(size, np.dtype(np.float64), **kwargs)
    sparse = rule(size, np.dtype(np.float64), **kwargs)
    table = rule(0, np.dtype(np.float64), **kwargs)
    w_dense, w_sparse = np.full(size, 0.2), np.full(size, 0.2)
    values = np.full((size, 1), 0.2)
    state = {k: np.full((size, 1), v) for k, v in table.row_state().items()}
    for _ in range(6):
        g = rng.normal(size=size)
        dense.dense(w_dense, g)
        sparse.sparse(w_sparse, np.arange(size), g)
        table.rows(values, state, np.arange(size), g[:, None])
    np.testing.assert_array_equal(w_dense, w_sparse)
    np.testing.assert_array_equal(w_dense, values[:, 0])
    # a sparse update leaves other keys (and their state) alone
    before = w_sparse.copy()
    sparse.sparse(w_sparse, np.array([3]), np.array([1.0]))
    assert (w_sparse[np.arange(size) != 3] == before[np.arange(size) != 3]).all()


def test_adagrad_is_the_reference_formula():
    rule = AdagradRule(1, np.dtype(np.float64), learning_rate=0.5, initial_accumulator=0.1)
    w = np.array([1.0])
    ref_w, acc = 1.0, 0.1
    for g in (0.3, -1.2, 2.0):
        rule.dense(w, np.array([g]))
        acc += g * g
        ref_w -= 0.5 * g / (math.sqrt(acc) + 1e-10)
        assert w[0] == pytest.approx(ref_w, rel=1e-15)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ps.FTRL(alpha=0), r"FTRL\(alpha=...\) must be a number > 0"),
        (lambda: ps.FTRL(l1=-1), r"FTRL\(l1=...\) must be a number >= 0"),
        (lambda: ps.FTRL(beta=math.nan), r"FTRL\(beta=...\)"),
        (lambda: ps.FTRL(beta=0), r"FTRL\(beta=...\) must be a number > 0"),
        (lambda: ps.Adagrad(learning_rate=-0.1), r"Adagrad\(learning_rate=...\)"),
        (lambda: ps.Adagrad(initial_accumulator=-1), "initial_accumulator"),
        (lambda: ps.SGD(l2=-1), r"SGD\(l2=...\)"),
        (lambda: ps.Normal(std=0), r"Normal\(std=...\) must be a finite number > 0"),
        (lambda: ps.Uniform(1, 0), "needs low < high"),
        (lambda: ps.Normal(seed=-1), "seed"),
        (lambda: ps.Table(dim=0), r"Table\(dim=...\) must be an int >= 1"),
        (lambda: ps.Table(init="normal"), r"Table\(init=...\)"),
        (lambda: ps.Table(optimizer="ftrl"), r"Table\(optimizer=...\)"),
    ],
)
def test_bad_optimizer_and_table_parameters_name_themselves(make, message):
    with pytest.raises(hi.IterationConfigError, match=message):
        make()


# -- the CSR reader ---------------------------------------------------------------------------

VECTOR = pa.struct(
    [
        ("type", pa.int8()),
        ("size", pa.int32()),
        ("indices", pa.list_(pa.int32())),
        ("values", pa.list_(pa.float64())),
    ]
)


@st.composite
def vector_rows(draw):
    rows = []
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            idx = sorted(draw(st.sets(st.integers(0, 2**31 - 2), max_size=6)))
            vals = draw(st.lists(st.floats(-1e3, 1e3), min_size=len(idx), max_size=len(idx)))
            rows.append({"type": 0, "size": 2**31 - 1, "indices": idx, "values": vals})
        else:
            vals = draw(st.lists(st.floats(-1e3, 1e3), max_size=5))
            rows.append({"type": 1, "size": None, "indices": None, "values": vals})
    return rows


@settings(max_examples=150, deadline=None)
@given(vector_rows(), st.integers(0, 3))
def test_read_csr_of_vectors_is_arrows_rows(rows, offset):
    col = pa.array(rows, VECTOR).slice(min(offset, len(rows)))
    offsets, ids, values = read_csr(col, "v")
    for i, row in enumerate(col.to_pylist()):
        a, b = offsets[i], offsets[i + 1]
        want_ids = row["indices"] if row["type"] == 0 else list(range(len(row["values"])))
        assert ids[a:b].tolist() == want_ids
        assert values[a:b].tolist() == row["values"]
    assert offsets[-1] == len(ids) == len(values)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.lists(int64s, max_size=6)), max_size=15),
    st.sampled_from([pa.int64(), pa.int32()]),
    st.integers(0, 3),
)
def test_read_csr_of_ragged_id_arrays_is_arrows_rows(rows, dtype, offset):
    if dtype == pa.int32():
        rows = [None if r is None else [v % 2**31 for v in r] for r in rows]
    col = pa.array(rows, pa.list_(dtype)).slice(min(offset, len(rows)))
    offsets, ids, values = read_csr(col, "ids")
    assert values is None and ids.dtype == np.int64
    for i, row in enumerate(col.to_pylist()):
        assert ids[offsets[i] : offsets[i + 1]].tolist() == (row or [])


def test_read_csr_refuses_nulls_it_cannot_read_as_no_ids():
    with pytest.raises(hi.DataValidationError, match="null id"):
        read_csr(pa.array([[1, None]], pa.list_(pa.int64())), "ids")
    with pytest.raises(hi.DataValidationError, match="null row"):
        read_csr(pa.array([None], VECTOR), "v")
    with pytest.raises(hi.DataValidationError, match="null value"):
        read_csr(pa.array([1, None], pa.int64()), "id")
    with pytest.raises(hi.DataValidationError, match="not of integer ids"):
        read_csr(pa.array([[1.5]], pa.list_(pa.float64())), "x")


def test_a_2_pow_30_wide_sparse_vector_column_is_read_in_memory_of_its_entries():
    """Densifying one row of it would take 8 GiB; reading 10,000 rows of 20 entries must
    take memory of the order of the entries (under 20 MB traced)."""
    rng = np.random.default_rng(0)
    n, k = 10_000, 20
    idx = np.sort(rng.integers(0, 2**30, (n, k)), axis=1).astype(np.int32)
    vals = rng.normal(size=(n, k))
    offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
    col = pa.StructArray.from_arrays(
        [
            pa.array(np.zeros(n, np.int8)),
            pa.array(np.full(n, 2**30, np.int32)),
            pa.ListArray.from_arrays(offsets, pa.array(idx.reshape(-1))),
            pa.ListArray.from_arrays(offsets, pa.array(vals.reshape(-1))),
        ],
        names=["type", "size", "indices", "values"],
    )
    tracemalloc.start()
    try:
        offs, ids, values = read_csr(col, "features")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak
    assert ids.max() < 2**30 and len(ids) == n * k
    np.testing.assert_array_equal(values, vals.reshape(-1))


# -- CSR helpers --------------------------------------------------------------------------------


def test_csr_helpers_are_dense_numpy():
    rng = np.random.default_rng(2)
    n, d = 30, 50
    X = (rng.random((n, d)) < 0.1) * rng.normal(size=(n, d))
    rows, cols = np.nonzero(X)
    offsets = np.searchsorted(rows, np.arange(n + 1))
    x = ps.CSR("x", offsets, cols.astype(np.int64), X[rows, cols])
    plan = TablePlan.of([("w", 3, ("x",))])
    keys = step_keys(plan, {"x": x.ids}, 2)
    table = rng.normal(size=(d, 3))
    w = ps.Rows("w", keys.uniq[0], table[keys.uniq[0]])
    xl = x.with_locals({"w": (keys.positions[0]["x"], len(keys.uniq[0]))})
    np.testing.assert_allclose(xl.dot(w), X @ table, rtol=1e-12, atol=1e-12)
    r = rng.normal(size=(n, 3))
    grad = xl.t_dot(r)
    np.testing.assert_allclose(grad, (X.T @ r)[keys.uniq[0]], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(xl.t_dot(r[:, 0]), (X.T @ r[:, :1])[keys.uniq[0]], atol=1e-12)
    np.testing.assert_allclose(xl.square().dot(w), (X * X) @ table, atol=1e-12)
    dense = rng.normal(size=d)
    np.testing.assert_allclose(x.dot(dense), X @ dense, atol=1e-12)
    sparse = x.t_dot(r[:, 0], like=dense)
    full = np.zeros(d)
    full[sparse.indices] = sparse.values
    np.testing.assert_allclose(full, X.T @ r[:, 0], atol=1e-12)
    perm = rng.permutation(n)[:12]
    np.testing.assert_allclose(x.take(perm).dot(dense), X[perm] @ dense, atol=1e-12)
    np.testing.assert_allclose(x.slice(5, 17).dot(dense), X[5:17] @ dense, atol=1e-12)
    with pytest.raises(hi.UsageError, match="does not key table 'v'"):
        xl.dot(ps.Rows("v", keys.uniq[0], table[keys.uniq[0]]))


# -- a shard's table protocol -------------------------------------------------------------------


def _table_shard(shell, *, sync=True, num_workers=1, rule="sgd", params=None, init=ZEROS):
    spec = ShardSpec(
        shard_id=0,
        lo=0,
        hi=0,
        init=np.zeros(0),
        rule="sgd",
        rule_params={"learning_rate": 1.0},
        num_workers=num_workers,
        sync=sync,
        tables=(TableSpec("w", 2, init, rule, params or {"learning_rate": 0.5}),),
        token="t0",
    )
    return shell(spec, put=None)


def _run(got):
    return asyncio.run(got) if asyncio.iscoroutine(got) else got


@pytest.mark.parametrize("shell", [ParameterShard, FreeShard], ids=["sync", "async"])
def test_a_shard_creates_rows_once_and_applies_pushes_to_the_rows_it_sent(shell):
    init = Init("normal", {"std": 1.0}, 5)
    shard = _table_shard(shell, sync=shell is ParameterShard, init=init)
    keys = np.array([7, -3, 2**62])
    version, _, _, (rows,) = _run(shard.pull(0, 0, "t0", 0, (keys,)))
    np.testing.assert_array_equal(rows, init_rows(init, keys, 2))
    g = np.ones((3, 2))
    nxt = np.array([-3, 11])
    reply = _run(shard.push(0, 0, 0, None, 1.0, False, True, "t0", (g,), (nxt,), 2))
    (after,) = reply[3]
    np.testing.assert_array_equal(
        after, np.r_[init_rows(init, nxt[:1], 2) - 0.5, init_rows(init, nxt[1:], 2)]
    )
    assert len(shard.tables[0]) == 4  # 7, -3, 2**62, 11: each created once
    # a push whose rows do not match what was sent, or NaN: refused whole
    with pytest.raises(hi.UsageError, match="rows of shape"):
        _run(shard.push(0, 0, 1, None, 1.0, False, True, "t0", (np.ones((3, 2)),), (nxt,), 2))
    bad = np.ones((2, 2))
    bad[1, 1] = np.nan
    with pytest.raises(ps.NonFiniteGradient, match="table 'w' for key 11 is nan"):
        _run(shard.push(0, 0, 1, None, 1.0, False, True, "t0", (bad,), (nxt,), 2))
    assert shard.stats["updates"] == 1
    # an unknown key reads as its initializer's value, and is not created
    (looked,) = shard.lookup("t0", (np.array([99]),))
    np.testing.assert_array_equal(looked, init_rows(init, np.array([99]), 2))
    assert len(shard.tables[0]) == 4
    # a stale token (a task of an earlier launch) is refused
    with pytest.raises(StaleShardCall, match="earlier launch"):
        _run(shard.pull(0, 0, "old", 0, (keys,)))


def test_a_batch_without_ids_is_a_step_of_no_rows():
    shard = _table_shard(FreeShard, sync=False)
    empty = np.zeros(0, dtype=np.int64)
    _, _, _, (rows,) = shard.pull(0, 0, "t0", 0, (empty,))
    assert rows.shape == (0, 2)
    reply = shard.push(0, 0, 0, None, 1.0, False, True, "t0", (np.zeros((0, 2)),), (empty,), 1)
    assert reply[3][0].shape == (0, 2) and shard.stats["updates"] == 1
    plan = TablePlan.of([("w", 2, ("x",))])
    keys = step_keys(plan, {"x": empty}, 3)
    assert len(keys.uniq[0]) == 0 and all(len(k) == 0 for k in keys.for_shard(plan, 1))


def test_a_shard_snapshot_restores_exactly(tmp_path):
    shard = _table_shard(FreeShard, sync=False, rule="ftrl", params={"alpha": 0.5, "l1": 0.1})
    shard.spec = ShardSpec(**{**shard.spec.__dict__, "key": b"k" * 32, "run_id": "r"})
    rng = np.random.default_rng(0)
    for s in range(5):
        keys = rng.integers(-50, 50, 12)
        keys = np.unique(keys)
        shard.pull(0, s, "t0", 0, (keys,))
        shard.push(
            0, 0, s, None, 1.0, False, False, "t0", (rng.normal(size=(len(keys), 2)),), None, 5
        )
    saved = shard.save_checkpoint(str(tmp_path), "part-x.ckpt", "cut1")
    assert saved["rows"] == len(shard.tables[0])
    before = shard.tables[0].items()
    keys = np.unique(rng.integers(-50, 80, 20))
    shard.pull(0, 9, "t0", 0, (keys,))
    shard.push(0, 0, 9, None, 1.0, False, False, "t0", (np.ones((len(keys), 2)),), None, 5)
    got = shard.restore_checkpoint(str(tmp_path), "part-x.ckpt", "cut1", "t1")
    assert got["discarded_updates"] == 1
    after = shard.tables[0].items()
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    assert shard.token == "t1"
    with pytest.raises(hi.CheckpointError, match="another checkpoint"):
        shard.restore_checkpoint(str(tmp_path), "part-x.ckpt", "cut2", "t2")


# -- metrics ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=40))
def test_auc_and_log_loss_are_scikit_learns(pairs):
    from sklearn.metrics import log_loss as sk_log_loss
    from sklearn.metrics import roc_auc_score

    score = np.array([p[0] / 5.0 for p in pairs])  # ties on purpose
    y = np.array([float(p[1]) for p in pairs])
    if 0 < y.sum() < len(y):
        assert auc(score, y) == pytest.approx(roc_auc_score(y, score), abs=1e-12)
        assert log_loss(score, y) == pytest.approx(sk_log_loss(y, score), rel=1e-9)
    else:
        assert math.isnan(auc(score, y))


def test_hot_keys_merges_the_shards_top_keys_into_the_global_top():
    """A key lives on one shard, so the global top k are among the shards' own top k:
    merged by touches (ties by key), and their share of every shard's touches."""
    infos = [
        {"tables": {"w": {"hottest": [(5, 9), (1, 4)], "touches": 20}}},
        {"tables": {"w": {"hottest": [(-3, 7), (8, 4)], "touches": 30}}},
        {"tables": {}},
    ]
    got = hot_keys(infos, top=3)["w"]
    assert got["hottest"] == [(5, 9), (-3, 7), (1, 4)]
    assert got["touches"] == 50 and got["share"] == pytest.approx(20 / 50)
    assert hot_keys([{"tables": {"w": {"hottest": [], "touches": 0}}}])["w"]["share"] == 0.0


def test_a_model_with_tables_gets_a_second_shard_only_with_cpus_to_spare():
    from hybrid_iter.ps._shards import TABLE_SHARDS, table_shards

    # 2 tasks on a 2-core cluster: the second shard's round trip and process cost more
    # than the apply work it takes over
    assert table_shards(2, 2.0) == 1
    assert table_shards(2, 5.0) == 1
    assert table_shards(2, 6.0) == TABLE_SHARDS == 2
    assert table_shards(8, 64.0) == TABLE_SHARDS
    assert table_shards(1, 0.0) == 1  # a cluster whose CPUs Ray cannot count


@pytest.mark.parametrize("shell", [ParameterShard, FreeShard], ids=["sync", "async"])
def test_a_configured_spare_shard_is_the_shard_its_constructor_makes(shell):
    sync = shell is ParameterShard
    made = _table_shard(shell, sync=sync)
    spare = shell(None, warm=("json",))
    assert not hasattr(spare, "spec")  # idle: holds nothing of a run
    assert spare.configure(made.spec) == made.hello()
    keys = np.array([7, -3, 2**62])
    for shard in (made, spare):
        _run(shard.pull(0, 0, "t0", 0, (keys,)))
        _run(shard.push(0, 0, 0, None, 3.0, True, False, "t0", (np.ones((3, 2)),), None))
    np.testing.assert_array_equal(spare.lookup("t0", (keys,))[0], made.lookup("t0", (keys,))[0])
    assert spare.info()["updates"] == made.info()["updates"] == 1
    with pytest.raises(hi.UsageError, match="configured already"):
        spare.configure(made.spec)  # a used shard never takes another run
