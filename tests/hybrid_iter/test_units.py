"""Pure pieces without Spark or Ray: variables store, numpy cache, progress line."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_iter as hi
from coordinator import Progress, VariablesMismatchError, VariablesStore
from hybrid_iter._runtime.progress import ProgressPrinter

# -- variables store ------------------------------------------------------------------------


def test_small_versions_travel_inline_and_large_ones_are_put_once():
    puts = []
    store = VariablesStore(
        {"w": np.zeros(10), "big": np.zeros(10_000)},
        put=lambda v: puts.append(v) or f"ref{len(puts)}",
        inline_limit=1_000,
    )
    a = store.payload()
    assert a is store.payload()  # built once per version
    assert a.inline is None and a.ref == "ref1" and store.puts == 1
    store.publish({"w": np.ones(10)})
    b = store.payload()
    store.payload()
    assert (b.version, b.ref, store.puts) == (1, "ref2", 2)
    small = VariablesStore({"w": np.zeros(3)}, put=lambda v: pytest.fail("put"), inline_limit=1_000)
    assert small.payload().inline["w"].shape == (3,)


def test_one_payload_path_puts_once_per_version_and_one_reader_fetches_in_one_round_trip():
    from coordinator._variables import OncePerVersion, fetch_all

    puts = []
    refs = OncePerVersion(lambda v: puts.append(v) or f"ref{len(puts)}", limit=100)
    assert refs.ref(0, "small", 10) is None and not puts  # inline
    assert refs.ref(0, "big", 800) == "ref1" and refs.ref(0, "big", 800) == "ref1"
    assert refs.ref(1, "big1", 800) == "ref2" and refs.puts == 2
    refs.forget()  # a restore: versions restart
    assert refs.ref(1, "again", 800) == "ref3"
    assert OncePerVersion(None).ref(0, "x", 10**9) is None  # no Ray: always inline

    calls = []
    store = {"r1": np.arange(3.0), "r2": {"w": np.ones(2)}}

    def get(keys):
        calls.append(list(keys))
        return [store[k] for k in keys]

    inline = np.zeros(2)
    got = fetch_all([(inline, None), (None, "r1"), (None, "r2")], get)
    assert calls == [["r1", "r2"]]  # every reference in one round trip
    assert got[0] is inline and list(got[1]) == [0.0, 1.0, 2.0]
    assert not got[0].flags.writeable and not got[2]["w"].flags.writeable
    assert fetch_all([(inline, None)], get) == [inline] and len(calls) == 1  # no get at all


def test_published_versions_are_immutable_snapshots():
    store = VariablesStore({"w": np.zeros(3)})
    w = np.ones(3)
    store.publish({"w": w})
    w[:] = 7  # the operator keeps updating its own array in place
    snap = store.payload().inline["w"]
    np.testing.assert_array_equal(snap, np.ones(3))
    assert not snap.flags.writeable


def test_a_large_version_is_copied_once_by_its_put_and_stays_immutable():
    import pickle

    puts, gets = [], []

    def put(value):  # as Ray's put: the values are serialised (copied) at once
        puts.append(pickle.dumps(value, protocol=5))
        return len(puts) - 1

    def get(ref):  # read-only views of the stored copy
        gets.append(ref)
        out = pickle.loads(puts[ref])
        for arr in out.values():
            arr.flags.writeable = False
        return out

    store = VariablesStore({"w": np.zeros(1000), "n": 0}, put=put, get=get, inline_limit=1_000)
    w = np.ones(1000)
    store.publish({"w": w})
    assert (len(puts), gets) == (1, [0])  # put at the publish, read back once
    w[:] = 7  # the operator keeps updating its own array in place
    assert store.values["w"][0] == 1.0 and not np.shares_memory(store.values["w"], w)
    assert not store.values["w"].flags.writeable and store.values["n"] == 0
    payload = store.payload()
    assert payload.ref == 0 and payload.inline is None and payload.version == 1
    assert len(puts) == 1  # the payload is that put: no second copy
    store.publish({"n": 3})
    assert store.payload().ref == 1 and pickle.loads(puts[1])["w"][0] == 1.0
    small = VariablesStore({"w": np.zeros(3)}, put=put, get=get, inline_limit=1_000)
    small.publish({"w": np.ones(3)})
    assert len(puts) == 2 and small.payload().inline["w"][0] == 1.0  # inline: copied


def test_publish_validation():
    store = VariablesStore({"w": np.zeros(3), "n": 0})
    with pytest.raises(VariablesMismatchError, match=r"unknown variable 'x'.*\['n', 'w'\]"):
        store.publish({"x": 1.0})
    with pytest.raises(VariablesMismatchError, match=r"shape \(2,\).*shape \(3,\)"):
        store.publish({"w": np.zeros(2)})
    with pytest.raises(VariablesMismatchError, match="does not cast safely"):
        store.publish({"n": 1.5})  # float into an int variable
    with pytest.raises(VariablesMismatchError, match="at least one"):
        store.publish({})
    store.publish({"w": [1, 2, 3]})  # ints cast into float64
    assert store.values["w"].dtype == np.float64 and store.version == 1


# -- numpy cache ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300),
    cuts=st.lists(st.integers(0, 300), max_size=6),
    seed=st.integers(0, 1000),
)
def test_numpy_cache_is_independent_of_batching(rows, cuts, seed):
    rng = np.random.default_rng(seed)
    a, b, y = rng.standard_normal(rows), rng.integers(0, 9, rows), rng.random(rows)
    vec = rng.standard_normal((rows, 2))
    table = pa.table(
        {"a": a, "b": b, "v": pa.array(list(vec), type=pa.list_(pa.float64(), 2)), "y": y}
    )
    bounds = sorted({0, rows, *[c for c in cuts if c <= rows]})
    cache = hi.NumpyCache(["a", "v", "b"], extra=["y"])
    for lo, hi_ in itertools.pairwise(bounds):
        for batch in table.slice(lo, hi_ - lo).to_batches():
            cache.add(batch)
    m = cache.matrix()
    assert m.shape == (rows, 4) and m.flags.f_contiguous
    np.testing.assert_array_equal(m, np.column_stack([a, vec, b]).reshape(rows, 4))
    np.testing.assert_array_equal(cache.column("y"), y)


def test_an_empty_cache_has_zero_rows_of_its_scalar_columns():
    cache = hi.NumpyCache(["a", "b"], extra=["y"])  # an empty partition: no batch at all
    assert cache.matrix().shape == (0, 2) and cache.column("y").shape == (0,)


def test_numpy_cache_errors_name_the_column():
    batch = pa.RecordBatch.from_pydict({"x": [1.0, None], "s": ["a", "b"]})
    with pytest.raises(ValueError, match="'x' has 1 null"):
        hi.NumpyCache(["x"]).add(batch)
    with pytest.raises(TypeError, match="'s' has type string"):
        hi.NumpyCache(["s"]).add(batch)
    with pytest.raises(KeyError, match="'nope' is not in the data"):
        hi.NumpyCache(["nope"]).add(batch)


# -- progress line --------------------------------------------------------------------------


def test_progress_line_off_a_terminal_prints_epoch_loss_and_speed():
    out = io.StringIO()
    p = ProgressPrinter(True, label="sync", stream=out)
    p.update(
        Progress(
            aligned=3,
            epochs=2,
            last_epoch_seconds=0.0123,
            loss=0.5,
            terminated_by=None,
            done=False,
            failed=False,
        )
    )
    p.update(
        Progress(
            aligned=4,
            epochs=3,
            last_epoch_seconds=0.01,
            loss=0.25,
            terminated_by="criteria",
            done=True,
            failed=False,
        ),
        final=True,
    )
    lines = out.getvalue().splitlines()
    assert "epoch     2" in lines[0] and "0.5" in lines[0] and "12.3 ms/epoch" in lines[0]
    assert lines[-1].endswith("done: criteria") and "0.25" in lines[-1]
    quiet = io.StringIO()
    ProgressPrinter(None, label="x", stream=quiet).update(
        Progress(1, 1, None, None, None, False, False)
    )
    assert quiet.getvalue() == ""  # None: only on a terminal


# -- shipping operators ---------------------------------------------------------------------


def test_dumps_is_thread_safe_and_keeps_the_users_own_registrations():
    import threading

    import cloudpickle
    import ops  # a user-local module (tests/ops.py)

    from hybrid_iter._runtime.shipping import dumps

    errors = []

    def work():
        try:
            for _ in range(200):
                blob = dumps(ops.Recorder(), "op")
                assert b"Recorder" in blob
        except Exception as ex:  # collected: asserted below
            errors.append(ex)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert "ops" not in cloudpickle.list_registry_pickle_by_value()
    cloudpickle.register_pickle_by_value(ops)
    try:
        dumps(ops.Recorder(), "op")
        assert "ops" in cloudpickle.list_registry_pickle_by_value()  # left as the user set it
    finally:
        cloudpickle.unregister_pickle_by_value(ops)
