"""hybrid_iter.ps on real Spark + Ray: sync equals a numpy loop (SGD and Adam), shards do
not change a sync result, sparse pushes, async/SSP with a slowed subtask, a model of a
few million parameters, the shard actor's protocol on its own, and every bad argument."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time

import numpy as np
import pytest

import hybrid_iter as hi
from coordinator._ps import ParameterShard, ShardSpec
from hybrid_iter import ps

N, D, PARTS = 400, 3, 2


@pytest.fixture(scope="module")
def regression(spark):
    """Rows split evenly in 2 partitions in order: partition p holds rows [200 p, 200 p + 200);
    ``slow`` is 1 in partition 1 (a grad_fn may sleep there: a simulated straggler)."""
    rng = np.random.default_rng(9)
    X = rng.standard_normal((N, D))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.3 + 0.01 * rng.standard_normal(N)
    slow = (np.arange(N) >= N // 2).astype(np.int64)
    ids = rng.integers(0, 50, N)
    rows = [([float(v) for v in X[i]], float(y[i]), int(slow[i]), int(ids[i])) for i in range(N)]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS), "x array<double>, y double, slow long, id long"
    ).cache()
    df.count()
    yield df, X, y, ids
    df.unpersist()


def linreg_grad(params, batch):
    """Mean squared error / 2 of y ~ X w + b; params {"w": (3,), "b": ()}."""
    X, y = batch["x"], batch["y"]
    r = X @ params["w"] + params["b"] - y
    return float(r @ r) / (2 * len(y)), {"w": X.T @ r / len(y), "b": r.mean()}


def numpy_sync(X, y, *, epochs, batch, update, stop=None):
    """The sync reference: each step's global batch is every partition's next local batch,
    the gradient their row-weighted mean, summed in partition order. ``stop=(e, s)``: the
    parameters before step ``s`` of epoch ``e``."""
    w, b = np.zeros(D), 0.0
    parts = np.array_split(np.arange(N), PARTS)
    steps = max(math.ceil(len(p) / batch) for p in parts)
    for e in range(epochs):
        for s in range(steps):
            if (e, s) == stop:
                return w, b
            chunks = [p[s * batch : (s + 1) * batch] for p in parts]
            chunks = [c for c in chunks if len(c)]
            total = float(sum(len(c) for c in chunks))
            gw, gb = np.zeros(D), 0.0
            for c in chunks:
                _, g = linreg_grad({"w": w, "b": b}, {"x": X[c], "y": y[c]})
                gw = gw + g["w"] * (len(c) / total)
                gb = gb + g["b"] * (len(c) / total)
            flat = update(np.concatenate([w, [b]]), np.concatenate([gw, [gb]]))
            w, b = flat[:D], flat[D]
    return w, b


def test_sync_sgd_equals_the_numpy_loop_and_shards_change_nothing(regression):
    df, X, y, _ = regression
    init = {"w": np.zeros(D), "b": 0.0}
    kw = {
        "optimizer": ps.SGD(0.2),
        "epochs": 3,
        "batch_size": 60,
        "columns": ["x", "y"],
        "parallelism": PARTS,
    }
    one = ps.train(df, linreg_grad, init, num_shards=1, **kw)
    three = ps.train(df, linreg_grad, init, num_shards=3, **kw)
    w, b = numpy_sync(X, y, epochs=3, batch=60, update=lambda p, g: p - 0.2 * g)
    # bit for bit: the checks of what reaches the shards change no value of a good run
    np.testing.assert_array_equal(one.params["w"], w)
    assert float(one.params["b"]) == b
    assert np.array_equal(one.params["w"], three.params["w"])
    assert one.params["b"] == three.params["b"]
    assert [s["keys"] for s in three.shards] == [[0, 1], [1, 3], [3, 4]]
    assert all(s["updates"] == 3 * 4 for s in three.shards)  # 4 steps per epoch
    assert one.result.epochs == 3 and len(one.loss) == 3 and one.loss[-1] < one.loss[0]


def test_sync_adam_equals_the_numpy_adam_loop(regression):
    df, X, y, _ = regression
    state = {"m": np.zeros(D + 1), "v": np.zeros(D + 1), "t": 0}

    def adam(p, g, lr=0.05, b1=0.9, b2=0.999, eps=1e-8):
        state["t"] += 1
        t = state["t"]
        state["m"] = b1 * state["m"] + (1 - b1) * g
        state["v"] = b2 * state["v"] + (1 - b2) * g * g
        a = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        return p - a * state["m"] / (np.sqrt(state["v"]) + eps)

    out = ps.train(
        df,
        linreg_grad,
        {"w": np.zeros(D), "b": 0.0},
        optimizer=ps.Adam(0.05),
        epochs=2,
        batch_size=100,
        columns=["x", "y"],
        num_shards=2,
        parallelism=PARTS,
    )
    w, b = numpy_sync(X, y, epochs=2, batch=100, update=adam)
    np.testing.assert_allclose(out.params["w"], w, rtol=1e-10)
    assert float(out.params["b"]) == pytest.approx(b, rel=1e-10)


def test_sparse_pushes_equal_dense_ones_and_touch_only_their_keys(regression):
    df, X, y, ids = regression
    rng = np.random.default_rng(0)
    init = {"emb": rng.standard_normal((60, 2)) * 0.1, "scale": np.ones(1)}

    def grad(sparse):
        def fn(params, batch):
            rows, target = batch["id"], batch["y"]
            e = params["emb"][rows]  # (n, 2)
            pred = params["scale"][0] * e.sum(axis=1)
            r = pred - target
            g_rows = (params["scale"][0] * r)[:, None] * np.ones((1, 2)) / len(r)
            g_scale = np.array([float(r @ e.sum(axis=1)) / len(r)])
            if sparse:
                g_emb = ps.Sparse(rows, g_rows)  # repeated ids are summed
                g_scale = ps.Sparse(np.array([0]), g_scale)
            else:
                g_emb = np.zeros_like(params["emb"])
                np.add.at(g_emb, rows, g_rows)
            return float(r @ r) / (2 * len(r)), {"emb": g_emb, "scale": g_scale}

        return fn

    kw = {
        "optimizer": ps.SGD(0.1),
        "epochs": 2,
        "batch_size": 50,
        "columns": ["id", "y"],
        "parallelism": PARTS,
    }
    sparse = ps.train(df, grad(True), init, num_shards=3, **kw)
    dense = ps.train(df, grad(False), init, num_shards=1, **kw)
    np.testing.assert_allclose(sparse.params["emb"], dense.params["emb"], rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(sparse.params["scale"], dense.params["scale"], rtol=1e-10)
    untouched = np.setdiff1d(np.arange(60), ids)  # ids are < 50: rows 50..59 never move
    assert len(untouched) >= 10
    assert np.array_equal(sparse.params["emb"][untouched], init["emb"][untouched])

    def only_sparse(params, batch):  # a whole model as one Sparse: 1-D indices
        idx = batch["id"]
        r = params[idx] - batch["y"]
        return float(r @ r) / 2 / len(r), ps.Sparse(idx, r / len(r))

    one_d = ps.train(
        df,
        only_sparse,
        np.zeros(80),
        optimizer=ps.SGD(0.5),
        epochs=2,
        columns=["id", "y"],
        parallelism=PARTS,
    )
    assert np.array_equal(one_d.params[50:], np.zeros(30))
    assert np.count_nonzero(one_d.params[:50]) == len(np.unique(ids))


def test_async_and_ssp_with_a_slowed_subtask_converge(regression):
    df, X, y, _ = regression

    def slowed(params, batch):
        if batch["slow"][0] == 1:
            time.sleep(0.004)  # a simulated straggler: this subtask computes slower
        return linreg_grad(params, batch)

    best = np.linalg.lstsq(np.c_[X, np.ones(N)], y, rcond=None)[0]
    for mode, staleness in (("async", None), ("ssp", 1)):
        out = ps.train(
            df,
            slowed,
            {"w": np.zeros(D), "b": 0.0},
            optimizer=ps.SGD(0.1),
            mode=mode,
            staleness=staleness,
            epochs=8,
            batch_size=20,
            num_shards=2,
            columns=["x", "y", "slow"],
            shuffle=True,
            parallelism=PARTS,
        )
        np.testing.assert_allclose(out.params["w"], best[:D], atol=0.02)
        assert float(out.params["b"]) == pytest.approx(best[D], abs=0.02)
        # every push was applied on arrival: 2 subtasks x 8 epochs x 10 steps
        assert all(s["updates"] == 160 for s in out.shards)
        assert out.result.mode == mode and out.loss[-1] < 0.01


def test_a_model_of_millions_of_parameters_is_sharded(regression):
    df, X, y, _ = regression
    size = 3_000_000

    def fn(w, batch):
        Xb, yb = batch["x"], batch["y"]
        r = Xb @ w[:D] - yb
        g = 1e-3 * w  # a dense gradient over every parameter (weight decay)
        g[:D] += Xb.T @ r / len(yb)
        return float(r @ r) / (2 * len(yb)), g

    init = np.full(size, 1.0)
    out = ps.train(
        df, fn, init, optimizer=ps.SGD(0.5), epochs=2, columns=["x", "y"], parallelism=PARTS
    )
    assert len(out.shards) == 2  # one shard per 2.5 million parameters
    assert out.params.shape == (size,)
    np.testing.assert_allclose(out.params[D:], (1 - 0.5e-3) ** 2, rtol=1e-12)
    assert all(s["puts"] >= 1 for s in out.shards)  # large slices go through the store
    assert out.loss[-1] < out.loss[0]


def test_the_shard_protocol_on_its_own():
    """Sync steps wait for every worker that takes part; epochs end when all are done."""
    spec = ShardSpec(
        shard_id=0,
        lo=0,
        hi=2,
        init=np.zeros(2),
        rule="sgd",
        rule_params={"learning_rate": 1.0},
        num_workers=2,
        sync=True,
    )
    shard = ParameterShard(spec, put=None)

    async def scenario():
        # worker 0 has 2 steps, worker 1 one step in epoch 0
        a = asyncio.ensure_future(shard.push(0, 0, 0, np.array([1.0, 0.0]), 1.0, False, True))
        await asyncio.sleep(0)
        assert not a.done() and shard.version == 0  # waits for worker 1's step 0
        b = await shard.push(1, 0, 0, np.array([0.0, 3.0]), 3.0, True, False)
        assert b is None
        version, values, ref = await a
        assert version == 1 and ref is None
        np.testing.assert_allclose(values, [-0.25, -2.25])
        nxt = asyncio.ensure_future(shard.pull(1, 0))
        await asyncio.sleep(0)
        assert not nxt.done()  # epoch 0 is not over: worker 0 owes its last step
        await shard.push(0, 0, 1, np.array([1.0, 1.0]), 1.0, True, False)
        version, values, _ = await nxt
        assert version == 2 and (shard.epoch, shard.step) == (1, 0)
        np.testing.assert_allclose(values, [-1.25, -3.25])
        await shard.push(0, 1, 0, None, 0.0, True, False)  # no rows: no step
        await shard.push(1, 1, 0, None, 0.0, True, False)
        assert (shard.epoch, shard.version) == (2, 2)

    asyncio.run(scenario())


# -- bad arguments -----------------------------------------------------------------------------


def _ok(params, batch):
    return 0.0, np.zeros_like(params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grad_fn": 3}, "grad_fn=...) must be a function"),
        ({"init": {}}, "at least one parameter"),
        ({"init": np.zeros(0)}, "no parameters"),
        ({"init": np.array(["a"])}, "must be a numeric array"),
        ({"init": {1: np.zeros(2)}}, "parameter names"),
        ({"optimizer": "sgd"}, "ps.SGD"),
        ({"mode": "fast"}, "mode=...) must be 'sync'"),
        ({"mode": "sync", "staleness": 1}, "staleness"),
        ({"mode": "ssp"}, "staleness"),
        ({"epochs": 0}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_shards": 0}, "num_shards"),
        ({"num_shards": 5}, "exceeds the 4 parameters"),
        ({"tol": "low"}, "tol"),
        ({"shuffle": 1}, "shuffle"),
        ({"seed": -2}, "seed"),
        ({"columns": "x"}, "list of column names"),
        ({"columns": ["nope"]}, "'nope' is not in the DataFrame"),
        ({"columns": ["name"]}, "not numeric"),
        ({"progress": 1}, "progress"),
        ({"df": [1]}, "pyspark.sql.DataFrame"),
        ({"transport": "grpc"}, "ps.train(transport=...) must be one of"),
        ({"endpoint": "host:1"}, "ps.train(endpoint=...) must be a hybrid_iter.EndpointConfig"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(spark, regression, kwargs, message):
    from pyspark.sql import functions as F

    kwargs = dict(kwargs)
    df = regression[0].withColumn("name", F.lit("a"))
    args = {"df": df, "grad_fn": _ok, "init": np.zeros(4)}
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(hi.IterationConfigError, match=re.escape(message)):
        ps.train(args["df"], args["grad_fn"], args["init"], **kwargs)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ps.SGD(learning_rate=0), "SGD\\(learning_rate"),
        (lambda: ps.SGD(momentum=1.0), "momentum"),
        (lambda: ps.Adam(beta1=1.0), "beta1"),
        (lambda: ps.Adam(epsilon=0), "epsilon"),
    ],
)
def test_bad_optimizers(make, message):
    with pytest.raises(hi.IterationConfigError, match=message):
        make()


def test_a_bad_gradient_fails_naming_grad_fn(regression):
    df = regression[0]

    def wrong_shape(params, batch):
        return 0.0, np.zeros(7)

    with pytest.raises(hi.IterationFailedError, match="grad_fn returned grad of shape"):
        ps.train(df, wrong_shape, np.zeros(4), epochs=1, columns=["x", "y"], parallelism=PARTS)
    with pytest.raises(TypeError, match="one entry"):
        ps.Sparse([0, 1], [1.0])
    with pytest.raises(TypeError, match="integers"):
        ps.Sparse([0.5], [1.0])


def test_an_async_shard_sends_a_version_as_an_array_once_then_shares_one_put():
    """Async mode (``FreeShard``, a plain one-thread actor): the first pull of a large
    version gets the array itself, as a hand-rolled actor would send it; a version pulled
    again is put into the object store once; updates reuse their work arrays."""
    from coordinator._ps import FreeShard, shard_class

    assert shard_class(False) is FreeShard and shard_class(True) is ParameterShard
    n = 20_000  # 160 kB: over the inline limit
    spec = ShardSpec(0, 0, n, np.zeros(n), "sgd", {"learning_rate": 0.5}, 2, False)
    puts = []
    shard = FreeShard(spec, put=lambda v: puts.append(np.array(v)) or len(puts))
    version, values, ref = shard.pull(0, 0)
    assert (version, ref, puts) == (0, None, []) and values is shard.w
    assert shard.pull(0, 0) == (0, None, 1) and len(puts) == 1  # pulled again: one put
    assert shard.pull(0, 0) == (0, None, 1) and len(puts) == 1
    scratch = None
    for step in range(2):
        assert shard.push_packed((0, 0, step, np.full(n, 2.0), 1.0, True, False)) is None
        scratch = scratch if scratch is not None else shard.rule._tmp.get()
        assert shard.rule._tmp.get() is scratch  # no fresh temporary per step
    version, values, ref = shard.push(1, 0, 2, np.full(n, 2.0), 1.0, False, True)
    assert version == 3 and ref is None
    np.testing.assert_array_equal(values, np.full(n, -3.0))
    assert "cpu_seconds" in shard.info()


def test_a_shard_that_forgot_its_run_refuses_its_calls_and_serves_the_next_as_a_new_one():
    """A dense run's shards go back to the spare pool emptied (``forget``): a late call of
    the ended run is refused with nothing applied, a waiting sync pull is released with
    the refusal, and the next run's ``configure`` gives exactly a new shard's behaviour."""
    from coordinator._errors import StaleShardCall
    from coordinator._ps import FreeShard

    def steps(shard, token):
        for step in range(3):
            shard.push(0, 0, step, np.arange(4.0) + step, 1.0, False, False, token=token)
        return shard.pull(0, 0, token=token)[:2], shard.info()

    first = ShardSpec(0, 0, 4, np.ones(4), "sgd", {"learning_rate": 0.5}, 1, False, token="a")
    shard = FreeShard(first, put=None)
    steps(shard, "a")
    assert shard.forget() is True
    with pytest.raises(StaleShardCall, match="serves no run"):
        shard.push(0, 0, 3, np.ones(4), 1.0, False, False, token="a")
    second = dataclasses.replace(first, init=np.full(4, 2.0), token="b")
    assert shard.configure(second)[0] == "b"
    with pytest.raises(StaleShardCall):  # the first run's token is not the second's
        shard.pull(0, 0, token="a")
    got, info = steps(shard, "b")
    want, fresh_info = steps(FreeShard(second, put=None), "b")
    assert got[0] == want[0] and got[1].tobytes() == want[1].tobytes()
    volatile = ("cpu_seconds", "pid", "apply_seconds")
    assert {k: v for k, v in info.items() if k not in volatile} == {
        k: v for k, v in fresh_info.items() if k not in volatile
    }
    with pytest.raises(hi.UsageError, match="configured already"):
        shard.configure(second)

    sync = ParameterShard(dataclasses.replace(first, sync=True, num_workers=2), put=None)

    async def waiting_pull_released():
        waiting = asyncio.ensure_future(sync.pull(0, 1, token="a"))  # step 1 never comes
        await asyncio.sleep(0)  # the pull reaches its wait (one turn of the loop)
        assert not waiting.done()
        assert sync.forget() is True
        with pytest.raises(StaleShardCall, match="run ended"):
            await waiting

    asyncio.run(waiting_pull_released())


def test_a_shards_bytes_out_count_the_dense_values_each_reply_hands_out():
    """``bytes_out`` (the progress line's kB/call, the benchmarks' bytes per step) counts
    the dense range a reply carries, inline or as a reference into the object store
    (each caller reads the whole range), not only the table rows."""
    from coordinator._ps import FreeShard

    n = 20_000
    spec = ShardSpec(0, 0, n, np.zeros(n), "sgd", {"learning_rate": 0.5}, 1, False)
    puts = []
    shard = FreeShard(spec, put=lambda v: puts.append(v) or len(puts))
    assert shard.pull(0, 0)[2] is None  # inline
    assert shard.pull(0, 0)[2] == 1  # by reference
    shard.push(0, 0, 0, np.ones(n), 1.0, True, True)  # the reply carries the next values
    shard.lookup_at(None, ())  # evaluation: the dense values and no table
    assert shard.info()["bytes_out"] == 4 * n * 8

    sync = ParameterShard(dataclasses.replace(spec, sync=True), put=None)

    async def scenario():
        await sync.pull(0, 0)
        await sync.push(0, 0, 0, np.ones(n), 1.0, False, True)
        await sync.lookup_at(None, ())

    asyncio.run(scenario())
    assert sync.info()["bytes_out"] == 3 * n * 8
    assert sync.info()["bytes_in"] == n * 8  # the one gradient


# -- what reaches the shards is validated ---------------------------------------------------


class BadAt:
    """``linreg_grad`` (plus a zero gradient for an optional matrix "M"), except that the
    ``call``-th call in partition 1 (counted in its task) puts ``value`` at ``where`` of
    the gradient of ``key``."""

    def __init__(self, call, value, key="w", where=(2,)):
        self.call, self.value, self.key, self.where = call, value, key, where
        self.calls = 0

    def __call__(self, params, batch):
        loss, g = linreg_grad(params, batch)
        if "M" in params:
            g["M"] = np.zeros_like(params["M"])
        if batch["slow"][0] == 1:
            self.calls += 1
            if self.calls == self.call:
                bad = np.array(g[self.key], dtype=float)
                bad[self.where] = self.value
                g[self.key] = bad
        return loss, g


def test_a_nan_gradient_fails_at_its_step_and_the_shards_keep_every_earlier_update(regression):
    """Partition 1's gradient of epoch 1, step 2 has a NaN in w[2] (shard 2's key range of
    3): the error names the parameter, index, partition, epoch and step, and the shards
    hold exactly the 6 steps before it, none of the bad step (no shard applied a slice)."""
    df, X, y, _ = regression
    with pytest.raises(ps.TrainFailedError) as info:
        ps.train(
            df,
            BadAt(call=4 + 2 + 1, value=np.nan),  # 4 steps per epoch
            {"w": np.zeros(D), "b": 0.0},
            optimizer=ps.SGD(0.2),
            epochs=3,
            batch_size=60,
            num_shards=3,
            columns=["x", "y", "slow"],
            parallelism=PARTS,
        )
    err = info.value
    assert isinstance(err, hi.IterationFailedError)
    assert isinstance(err.failures[1].cause, ps.NonFiniteGradient)
    assert (
        "grad_fn returned a gradient with grad['w'][2] (flat index 2 of its 3) is nan; 1 of "
        "the step's 4 gradient values are NaN/inf in partition 1 at epoch 1, step 2; nothing "
        "of this step was sent to the parameter server" in str(err)
    )
    w, b = numpy_sync(X, y, epochs=3, batch=60, update=lambda p, g: p - 0.2 * g, stop=(1, 2))
    np.testing.assert_array_equal(err.params["w"], w)
    assert float(err.params["b"]) == b


def test_an_inf_gradient_of_a_matrix_is_named_by_its_index_in_async_mode(regression):
    df = regression[0]
    init = {"w": np.zeros(D), "b": 0.0, "M": np.zeros((2, 3))}
    with pytest.raises(ps.TrainFailedError) as info:
        ps.train(
            df,
            BadAt(call=3, value=-np.inf, key="M", where=(1, 2)),
            init,
            optimizer=ps.SGD(0.1),
            mode="async",
            epochs=2,
            batch_size=50,
            num_shards=2,
            columns=["x", "y", "slow"],
            parallelism=PARTS,
        )
    assert "grad['M'][1, 2] (flat index 5 of its 6) is -inf" in str(info.value)
    assert "in partition 1 at epoch 0, step 2" in str(info.value)
    # M's gradient is zero but for the refused step: no shard applied any of it
    np.testing.assert_array_equal(info.value.params["M"], np.zeros((2, 3)))


def test_a_nan_in_a_sparse_push_is_refused_naming_the_row(regression):
    df, _, _, ids = regression
    init = {"emb": np.zeros((60, 2)), "scale": np.ones(1)}

    def fn(params, batch):
        rows = batch["id"]
        values = np.ones((len(rows), 2))
        if batch["slow"][0] == 1:
            values[0, 1] = np.nan
        return 0.0, {"emb": ps.Sparse(rows, values)}

    with pytest.raises(ps.TrainFailedError) as info:
        ps.train(
            df,
            fn,
            init,
            epochs=1,
            batch_size=40,
            num_shards=2,
            columns=["id", "slow"],
            parallelism=PARTS,
        )
    row = int(ids[N // 2])  # partition 1's first row
    assert (
        f"grad['emb'][{row}, 1] (flat index {2 * row + 1} of its 120) is nan (a Sparse entry)"
        in str(info.value)
    )
    assert "in partition 1 at epoch 0, step 0" in str(info.value)
    assert isinstance(info.value.failures[1].cause, ps.NonFiniteGradient)


@pytest.mark.parametrize("shape", [(2, 3), (6, 1), (6,), (3, 2, 1)])
def test_a_gradient_of_another_shape_but_the_same_size_is_refused(regression, shape):
    """Reshaped, a (2, 3) or (6, 1) gradient of a (3, 2) parameter would put its values in
    other places and scramble the update."""
    df = regression[0]

    def fn(params, batch):
        return 0.0, {"W": np.ones(shape), "b": 0.0}

    with pytest.raises(
        hi.IterationFailedError,
        match=re.escape(
            f"grad_fn returned grad['W'] of shape {shape} (float64); the parameter init['W'] "
            f"has shape (3, 2)"
        ),
    ):
        ps.train(
            df,
            fn,
            {"W": np.zeros((3, 2)), "b": 0.0},
            epochs=1,
            columns=["x", "y"],
            parallelism=PARTS,
        )


def test_a_rising_loss_stops_naming_the_optimizer_and_its_learning_rate(regression):
    df = regression[0]
    with pytest.raises(ps.TrainFailedError) as info:
        ps.train(
            df,
            linreg_grad,
            {"w": np.zeros(D), "b": 0.0},
            optimizer=ps.Adam(1e6),
            epochs=30,
            columns=["x", "y"],
            parallelism=PARTS,
        )
    message = str(info.value)
    assert "the loss is rising" in message and "at epoch 5," in message
    assert "for 5 epochs in a row" in message
    assert "Adam(learning_rate=1e+06) overshoots: lower its learning rate" in message
    assert "learning_rate=100000" in message
    assert isinstance(info.value.failures["coordinator"].cause, FloatingPointError)


def test_a_converging_run_whose_loss_swings_is_not_stopped(regression):
    """Full-batch momentum rings: its loss climbs far above its best for many epochs in a
    row (the best alone would stop it) but never back above where it started."""
    df = regression[0]
    out = ps.train(
        df,
        linreg_grad,
        {"w": np.zeros(D), "b": 0.0},
        optimizer=ps.SGD(0.1, momentum=0.9),
        epochs=30,
        columns=["x", "y"],
        parallelism=PARTS,
    )
    from hybrid_iter.ml._sgd import DIVERGENCE_PATIENCE, LossWatch

    best_only = LossWatch()
    assert any(best_only.rising(v, patience=DIVERGENCE_PATIENCE, margin=2.0) for v in out.loss)
    assert out.result.epochs == 30 and out.loss[-1] < out.loss[0]


def test_a_shard_that_cannot_start_fails_the_run_naming_why(regression, monkeypatch):
    """The shards' processes start while the Spark stage starts, so the tasks see only a
    shard gone; the run's error is the shard's own (its constructor refused its spec),
    not a lost actor. A spec whose initial values do not fit its key range stands for
    any failure to start."""
    from hybrid_iter.ps import _shards

    df, _, _, _ = regression

    def misfit(**kw):
        kw["init"] = np.zeros(len(kw["init"]) + 1)
        return ShardSpec(**kw)

    monkeypatch.setattr(_shards, "ShardSpec", misfit)
    with pytest.raises(hi.IterationConfigError, match=r"could not start.*initial values"):
        ps.train(
            df,
            linreg_grad,
            {"w": np.zeros(D), "b": 0.0},
            epochs=1,
            batch_size=60,
            columns=["x", "y"],
            parallelism=PARTS,
            num_shards=2,
        )
