"""hybrid_iter.ps with sparse tables on real Spark + Ray: a sync run equals a numpy loop
doing the same steps (SGD, FTRL, Adagrad, bit for bit), the dense and the table paths of
the same model agree, rows created on first touch do not depend on the shard count or
order, ragged id arrays and a 2^30-wide SparseVector column train without densifying,
save -> load -> transform round-trips, evaluation and early stopping, and every bad
input is refused naming the argument."""

from __future__ import annotations

import math
import re
import tracemalloc

import numpy as np
import pytest

import hybrid_iter as hi
from coordinator._rules import ftrl_step
from coordinator._tables import Init, init_rows
from hybrid_iter import ps

N, PARTS = 240, 2


def _ids(rng, n):
    """Ragged bags of ids from everywhere in int64: small, negative, hashed 64-bit."""
    pool = np.concatenate(
        [
            np.arange(-20, 20),
            rng.integers(-(2**63), 2**63 - 1, 40, dtype=np.int64),
            np.array([-(2**63), 2**63 - 1]),
        ]
    )
    out = []
    for _ in range(n):
        k = int(rng.integers(0, 7))  # 0 .. 6 ids, empty rows included
        out.append(rng.choice(pool, size=k, replace=False).astype(np.int64))
    return out


@pytest.fixture(scope="module")
def clicks(spark):
    """N rows in 2 partitions in order (partition p: rows [120 p, 120 p + 120)): a bag of
    ids, a label, a dense feature."""
    rng = np.random.default_rng(31)
    bags = _ids(rng, N)
    truth = {int(k): float(rng.normal()) for bag in bags for k in bag}
    x = rng.normal(size=N)
    z = np.array([sum(truth[int(k)] for k in bag) for bag in bags]) + 0.5 * x
    y = (rng.random(N) < 1 / (1 + np.exp(-z))).astype(float)
    rows = [([int(k) for k in bags[i]], float(y[i]), float(x[i])) for i in range(N)]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS), "ids array<long>, label double, x double"
    ).cache()
    df.count()
    yield df, bags, y, x
    df.unpersist()


def lr_grad(params, batch):
    """Logistic regression on a bag of ids plus a dense feature: z = sum_w(ids) + a x + b."""
    ids, y, x = batch["ids"], batch["label"], batch["x"]
    z = ids.dot(params["w"])[:, 0] + params["a"][0] * x + params["b"][0]
    p = 1.0 / (1.0 + np.exp(-z))
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    r = (p - y) / len(y)
    return loss, {"w": ids.t_dot(r), "a": np.array([r @ x]), "b": np.array([r.sum()])}


def lr_predict(params, batch):
    ids, x = batch["ids"], batch["x"]
    z = ids.dot(params["w"])[:, 0] + params["a"][0] * x + params["b"][0]
    return 1.0 / (1.0 + np.exp(-z))


class NumpyTable:
    """The reference: a table as a dict of rows, updated by a numpy loop."""

    def __init__(self, dim, init=Init()):
        self.dim, self.init = dim, init
        self.rows: dict[int, np.ndarray] = {}
        self.state: dict[int, dict[str, np.ndarray]] = {}

    def get(self, keys):
        for k in keys:
            if int(k) not in self.rows:
                self.rows[int(k)] = init_rows(self.init, np.array([k]), self.dim)[0]
        return np.array([self.rows[int(k)] for k in keys]).reshape(len(keys), self.dim)


def numpy_sync(bags, y, x, *, epochs, batch, update, dim=1, init=Init()):
    """The sync reference: each step's global batch is every partition's next local batch;
    per partition, the gradient of its batch (sums in entry order, as np.bincount); the
    step's gradient of each key is the partitions' row-weighted sum in partition order;
    ``update(kind, key_or_name, value, grad)`` applies the optimizer."""
    table = NumpyTable(dim, init)
    dense = {"a": np.zeros(1), "b": np.zeros(1)}
    parts = np.array_split(np.arange(N), PARTS)
    steps = max(math.ceil(len(p) / batch) for p in parts)
    for _ in range(epochs):
        for s in range(steps):
            chunks = [p[s * batch : (s + 1) * batch] for p in parts]
            chunks = [c for c in chunks if len(c)]
            total = float(sum(len(c) for c in chunks))
            gsum: dict[int, np.ndarray] = {}
            dsum = {"a": np.zeros(1), "b": np.zeros(1)}
            for c in chunks:
                ids = np.concatenate([bags[i] for i in c]) if len(c) else np.zeros(0, np.int64)
                lengths = np.array([len(bags[i]) for i in c])
                row_of = np.repeat(np.arange(len(c)), lengths)
                uniq, inv = np.unique(ids, return_inverse=True)
                w = table.get(uniq)[:, 0]
                z = np.bincount(row_of, weights=w[inv], minlength=len(c))
                z = z + dense["a"][0] * x[c] + dense["b"][0]
                p = 1.0 / (1.0 + np.exp(-z))
                r = (p - y[c]) / len(c)
                g = np.bincount(inv, weights=r[row_of], minlength=len(uniq))
                scale = len(c) / total
                for k, v in zip(uniq, g):
                    gsum[int(k)] = gsum.get(int(k), 0.0) + (v * scale if len(chunks) > 1 else v)
                part = {"a": np.array([r @ x[c]]), "b": np.array([r.sum()])}
                for name in dsum:
                    dsum[name] = dsum[name] + (part[name] * scale if len(chunks) > 1 else part[name])
            for name in dense:
                dense[name] = update("dense", name, dense[name], dsum[name])
            for k, gk in gsum.items():
                table.rows[k] = update("row", k, table.rows[k], np.array([gk]))
    return table, dense


def test_sync_sgd_on_a_table_equals_the_numpy_loop_bit_for_bit(clicks):
    df, bags, y, x = clicks
    init = {"w": ps.Table(dim=1), "a": np.zeros(1), "b": np.zeros(1)}
    out = ps.train(
        df,
        lr_grad,
        init,
        keys={"w": "ids"},
        optimizer=ps.SGD(0.5),
        epochs=3,
        batch_size=50,
        num_shards=2,
        parallelism=PARTS,
    )
    try:
        table, dense = numpy_sync(
            bags, y, x, epochs=3, batch=50, update=lambda kind, k, v, g: v - 0.5 * g
        )
        keys = np.array(sorted(table.rows))
        got = out.lookup("w", keys)
        want = np.array([table.rows[int(k)] for k in keys])
        np.testing.assert_array_equal(got, want)
        assert out.params["w"].num_keys == len(keys)  # every touched key, nothing else
        np.testing.assert_array_equal(out.params["a"], dense["a"])
        np.testing.assert_array_equal(out.params["b"], dense["b"])
        assert out.loss[-1] < out.loss[0]
    finally:
        out.close()


def test_sync_ftrl_on_a_table_equals_the_numpy_loop(clicks):
    df, bags, y, x = clicks
    opt = ps.FTRL(alpha=0.3, beta=1.0, l1=0.05, l2=0.1)
    state: dict = {}

    def ftrl(kind, k, v, g):
        z, n = state.get((kind, k), (np.zeros_like(v), np.zeros_like(v)))
        w, z, n = ftrl_step(v, z, n, g, opt.alpha, opt.beta, opt.l1, opt.l2)
        state[(kind, k)] = (z, n)
        return w

    out = ps.train(
        df,
        lr_grad,
        {"w": ps.Table(dim=1), "a": np.zeros(1), "b": np.zeros(1)},
        keys={"w": "ids"},
        optimizer=opt,
        epochs=2,
        batch_size=40,
        num_shards=3,
        parallelism=PARTS,
    )
    try:
        table, dense = numpy_sync(bags, y, x, epochs=2, batch=40, update=ftrl)
        keys = np.array(sorted(table.rows))
        np.testing.assert_array_equal(
            out.lookup("w", keys), np.array([table.rows[int(k)] for k in keys])
        )
        np.testing.assert_array_equal(out.params["b"], dense["b"])
        assert (out.lookup("w", keys) == 0).any()  # l1 keeps weak keys exactly 0
    finally:
        out.close()
