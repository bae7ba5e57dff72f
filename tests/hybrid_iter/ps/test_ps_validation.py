"""What reaches the parameter server is checked: the finiteness rule (property-tested),
the layout's exact-shape rule for gradients (property-tested), where a bad value is named,
the rising-loss rule, a shard refusing a sparse push with NaN (on its own and as a real Ray
actor), and NaN initial values refused before any Spark job or streaming query starts
(``ps.train``'s ``init`` and both iteration entries, one check)."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from online_ops import SCHEMA, Grad, Step, write_file

import hybrid_iter as hi
from coordinator._finite import first_nonfinite
from coordinator._ps import FreeShard, ParameterShard, ShardSpec
from hybrid_iter import ps
from hybrid_iter.ml._sgd import DIVERGENCE_PATIENCE, LossWatch
from hybrid_iter.ps._layout import Layout

# -- the finiteness rule --------------------------------------------------------------------


def _reference_first_bad(a: np.ndarray) -> int | None:
    bad = np.flatnonzero(~np.isfinite(np.asarray(a).reshape(-1)))
    return int(bad[0]) if len(bad) else None


@settings(max_examples=300, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float16, np.float32, np.float64, np.complex128]),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
        elements={"allow_nan": True, "allow_infinity": True},
    ),
    st.sampled_from(["C", "F", "strided"]),
)
def test_first_nonfinite_finds_the_first_bad_value_in_c_order(arr, layout):
    """Any dtype, shape (0-d to 4-d, empty), memory order or stride; huge finite values
    whose sum overflows are not taken for NaN/inf."""
    if layout == "F":
        arr = np.asfortranarray(arr)
    elif layout == "strided" and arr.ndim:
        arr = arr[..., ::2]
    assert first_nonfinite(arr) == _reference_first_bad(arr)


def test_first_nonfinite_of_values_whose_sum_overflows_and_of_integers():
    big = np.full(10, np.finfo(np.float64).max)
    with np.errstate(over="ignore"):
        assert not math.isfinite(float(np.sum(big)))  # the fast path is fooled ...
    assert first_nonfinite(big) is None  # ... and the exact scan clears it
    assert first_nonfinite(np.arange(5)) is None
    many = np.zeros(300_000)  # more than one chunk of the exact scan
    many[-1] = -np.inf
    assert first_nonfinite(many) == 299_999


# -- the layout: exact shapes, bad values named ---------------------------------------------


@st.composite
def shape_and_other_of_the_same_size(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4))
    size = int(np.prod(shape, dtype=np.int64))
    # another factorisation of the same size (possibly the same shape)
    dims, left = [], size
    for _ in range(draw(st.integers(0, 3))):
        divisors = [d for d in range(1, left + 1) if left % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        left //= d
    other = (*dims, left) if left != 1 or not dims else tuple(dims)
    if draw(st.booleans()):
        other = (*other, 1)
    if draw(st.integers(0, 3)) == 0:
        other = tuple(shape)  # the parameter's own shape, 0-d included
    return tuple(shape), other


@settings(max_examples=300, deadline=None)
@given(shape_and_other_of_the_same_size(), st.booleans())
def test_a_gradient_is_taken_only_in_its_parameters_exact_shape(shapes, named):
    """Same size is not enough: a gradient of another shape has its values in other
    places, so only the parameter's own shape is accepted, and then the flat gradient is
    the values in C order."""
    shape, other = shapes
    init = {"p": np.zeros(shape), "q": np.zeros(2)} if named else np.zeros(shape)
    layout, _ = Layout.of(init)
    g = np.arange(int(np.prod(other, dtype=np.int64)), dtype=float).reshape(other)
    grad = {"p": g, "q": np.ones(2)} if named else g
    if other == shape:
        flat = layout.flatten_grad(grad)
        np.testing.assert_array_equal(flat[: g.size], g.reshape(-1))
    else:
        name = "grad['p']" if named else "grad"
        param = "init['p']" if named else "init"
        with pytest.raises(hi.ConfigTypeError) as info:
            layout.flatten_grad(grad)
        message = str(info.value)
        assert f"{name} of shape {other}" in message
        assert f"parameter {param} has shape {shape}" in message


def test_the_first_bad_gradient_value_is_named_in_the_parameters_shape():
    layout, _ = Layout.of({"w": np.zeros(3), "M": np.zeros((2, 3)), "b": 0.0})
    g = layout.flatten_grad({"w": np.ones(3), "M": np.array([[0, 0, 0], [0, 0, np.inf]]), "b": 1})
    assert layout.nonfinite_grad(g) == (
        "grad['M'][1, 2] (flat index 5 of its 6) is inf; 1 of the step's 10 gradient "
        "values are NaN/inf"
    )
    g = layout.flatten_grad({"b": np.nan})
    assert layout.nonfinite_grad(g).startswith("grad['b'] is nan;")
    sparse = layout.flatten_grad({"M": ps.Sparse([1, 0], [[0.0, 0.0, 0.0], [np.nan, 1.0, 2.0]])})
    assert layout.nonfinite_grad(sparse).startswith(
        "grad['M'][0, 0] (flat index 0 of its 6) is nan (a Sparse entry)"
    )
    assert layout.nonfinite_grad(layout.flatten_grad({"w": np.ones(3)})) is None


def test_nan_or_inf_in_init_is_refused_naming_the_parameter_and_index():
    with pytest.raises(hi.IterationConfigError) as info:
        Layout.of({"w": np.zeros(3), "M": np.array([[0.0, 1.0], [2.0, np.nan], [np.inf, 0.0]])})
    assert "init['M'][1, 1] is nan (flat index 3; 2 of its 6 values are NaN/inf)" in str(info.value)
    with pytest.raises(hi.IterationConfigError, match=r"init\[2\] is -inf \(flat index 2"):
        Layout.of(np.array([0.0, 1.0, -np.inf]))


def test_a_failed_trainings_error_keeps_its_parameters_through_pickling():
    import pickle

    err = ps.TrainFailedError("m", {1: ValueError("x")}, {"w": np.arange(3.0)})
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, hi.IterationFailedError) and str(back) == str(err)
    np.testing.assert_array_equal(back.params["w"], np.arange(3.0))
    assert isinstance(ps.NonFiniteGradient("m"), hi.VariablesMismatchError)
    assert isinstance(ps.NonFiniteGradient("m"), FloatingPointError)


# -- the rising-loss rule -------------------------------------------------------------------


def _stops_at(losses, *, above_first, margin=2.0):
    watch = LossWatch(above_first=above_first)
    for i, loss in enumerate(losses):
        if watch.rising(loss, patience=DIVERGENCE_PATIENCE, margin=margin):
            return i
    return None


def test_the_rising_loss_rule():
    diverging = [2.6, 2e12, 1.3e11, 4.3e11, 1.2e12, 9e11, 2.7e11]  # Adam(1e6), full batch
    assert _stops_at(diverging, above_first=True) == 5
    # momentum that still converges: far above its best for many epochs, never above
    # where it started (ps.train's SGD(0.1, momentum=0.9) on the test regression)
    ringing = [2.61, 2.12, 1.37, 0.639, 0.158, 0.0177, 0.171, 0.475, 0.762, 0.911, 0.875]
    ringing += [0.689, 0.437, 0.21, 0.0726, 0.0426, 0.0966, 0.187, 0.264, 0.296]
    assert _stops_at(ringing, above_first=False) is not None  # the best alone would stop it
    assert _stops_at(ringing, above_first=True) is None
    # noise around a floor, and a spike that recovers within the patience
    rng = np.random.default_rng(0)
    noisy = list(1.0 / np.arange(1, 40) + 0.3 * rng.random(39))
    assert _stops_at(noisy, above_first=True) is None
    spike = [5.0, 1.0, 0.5, 3.0, 3.0, 3.0, 3.0, 0.9, 3.0, 3.0]
    assert _stops_at(spike, above_first=True) is None
    assert _stops_at([5.0, 1.0] + [6.0] * 5, above_first=True) == 6


# -- a shard refuses a sparse push holding NaN, whole ---------------------------------------


@pytest.mark.parametrize("shell", [ParameterShard, FreeShard], ids=["sync", "async"])
def test_a_shard_refuses_a_sparse_push_with_nan_and_applies_nothing_of_it(shell):
    import asyncio

    spec = ShardSpec(
        3, 10, 14, np.arange(4.0), "sgd", {"learning_rate": 1.0}, 1, shell is ParameterShard
    )
    shard = shell(spec, put=None)

    def push(grad, step):
        msg = (0, 0, step, grad, 1.0, False, True)
        got = shard.push_packed(msg)
        return asyncio.run(got) if asyncio.iscoroutine(got) else got

    with pytest.raises(ps.NonFiniteGradient) as info:
        push((np.array([0, 2]), np.array([1.0, np.nan])), 0)
    assert str(info.value) == (
        "parameter shard 3 (keys [10, 14)) refused the sparse push of partition 0 at "
        "epoch 0, step 0: the value for key 12 is nan; nothing of the push was applied"
    )
    assert shard.version == 0 and shard.stats["updates"] == 0
    np.testing.assert_array_equal(shard.w, np.arange(4.0))
    version, values, _ = push((np.array([0, 2]), np.array([1.0, 1.0])), 0)  # then a good one
    assert version == 1
    np.testing.assert_array_equal(values, [-1.0, 1.0, 1.0, 3.0])


def test_a_real_shard_actors_refusal_reaches_the_pusher_as_itself(spark):
    """Through Ray: the pusher gets ``NonFiniteGradient`` (not a Ray wrapper) and the
    shards keep their values."""
    import ray

    from hybrid_iter.ps._client import Shards as _Shards
    from hybrid_iter.ps._shards import launch_shards, stop_shards

    names, handles = launch_shards(np.zeros(6), [0, 3, 6], ps.SGD(0.5), num_workers=1, sync=False)
    try:
        client = _Shards(names, [0, 3, 6], "<f8", sync=False)
        with pytest.raises(ps.NonFiniteGradient, match=r"shard 1 \(keys \[3, 6\)\).*key 4 is inf"):
            client.push(0, 0, 0, (np.array([4]), np.array([np.inf])), 1.0, False)
        values = ray.get([h.values.remote() for h in handles])
        np.testing.assert_array_equal(np.concatenate(values), np.zeros(6))
    finally:
        stop_shards(handles)


# -- NaN initial values are refused before any job or query --------------------------------


def _last_job_id(sc) -> int:
    """The id of a probe job run now: job ids grow by one per job, whatever its group, so
    two probes one id apart prove that no job ran between them (an iteration sets its own
    job group, which a check scoped to the caller's group would miss)."""
    group = f"probe-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "job probe")
    try:
        sc.parallelize([0], 1).count()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return max(sc.statusTracker().getJobIdsForGroup(group))


def test_ps_train_refuses_a_nan_init_before_any_spark_job(spark):
    df = spark.createDataFrame([(float(i), 1.0) for i in range(8)], "x double, y double")

    def grad_fn(w, batch):
        return 0.0, {k: np.zeros_like(v) for k, v in w.items()}

    sc = spark.sparkContext
    before = _last_job_id(sc)
    with pytest.raises(
        hi.IterationConfigError,
        match=r"init\['w'\] has NaN/inf values: init\['w'\]\[0, 1\] is nan \(flat index 1",
    ):
        ps.train(df, grad_fn, {"b": 0.0, "w": np.array([[0.0, np.nan], [1.0, 2.0]])}, epochs=1)
    assert _last_job_id(sc) == before + 1


def test_an_online_iteration_refuses_nan_initial_variables_before_its_query_starts(spark, tmp_path):
    write_file(tmp_path, 0)
    stream = spark.readStream.schema(SCHEMA).csv(str(tmp_path))
    sc = spark.sparkContext
    queries = {q.id for q in spark.streams.active}
    before = _last_job_id(sc)
    with pytest.raises(
        hi.IterationConfigError,
        match=r"init_variables\['w'\] has NaN/inf values: init_variables\['w'\]\[2\] is inf "
        r"\(flat index 2; 1 of its 3 values",
    ):
        it = hi.iterate_unbounded_streams(
            {"w": np.array([0.0, 0.0, np.inf])},
            hi.ReplayableDataStreamList.not_replay(hi.DataStream(stream, ["x0", "x1", "x2", "y"])),
            hi.IterationBody(Grad(), Step()),
            hi.OnlineConfig(trigger={"availableNow": True}),
        )
        it.stop()  # reached only when the refusal comes late: leave no query running
    assert _last_job_id(sc) == before + 1
    assert {q.id for q in spark.streams.active} == queries
