"""Bounded tables in ``ps.train`` on real Spark + Ray: admission after N sightings, expiry
after a number of steps and a row cap give, in sync mode, the table a numpy loop with
exact counts gives over the same batches, bit for bit, on two shards (each keeping its
share of the cap); the table never holds more rows than its cap; ids never admitted
read as their initial value; bad bounds are refused naming the argument before any
job."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from test_ps_sparse import lr_grad  # the same logistic regression on a bag of ids

import hybrid_iter as hi
from coordinator._tables import shard_of
from hybrid_iter import ps

N, PARTS, SHARDS = 240, 2, 2
LR = 0.5


@pytest.fixture(scope="module")
def clicks(spark):
    """N rows in 2 partitions in order: a bag of ids (a few hot, many seen once or
    twice), a label, a dense feature."""
    rng = np.random.default_rng(8)
    hot = np.arange(8)
    bags = []
    for _ in range(N):
        cold = rng.integers(1000, 1000 + 3 * N, int(rng.integers(0, 3)))
        mine = rng.choice(hot, size=int(rng.integers(0, 3)), replace=False)
        bags.append(np.unique(np.concatenate([mine, cold])).astype(np.int64))
    x = rng.normal(size=N)
    y = (rng.random(N) < 0.4).astype(float)
    rows = [([int(k) for k in bags[i]], float(y[i]), float(x[i])) for i in range(N)]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS), "ids array<long>, label double, x double"
    ).cache()
    df.count()
    yield df, bags, y, x
    df.unpersist()


def numpy_bounded(bags, y, x, *, epochs, batch, min_count, ttl, cap):
    """The bounds' meaning over ps.train's sync steps (each step: every partition's next
    local batch), with exact counts: per step, ids without a row count their entries;
    those with ``min_count`` in all take a row (0); the step's row-weighted gradient,
    partitions in order, updates every row it touches; then rows not updated for
    ``ttl`` steps go, and on each shard the least recently updated beyond its share of
    ``cap`` (ties: the smaller id)."""
    rows: dict[int, float] = {}
    last: dict[int, int] = {}
    seen: Counter[int] = Counter()
    dense = {"a": 0.0, "b": 0.0}
    parts = np.array_split(np.arange(N), PARTS)
    per_epoch = max(math.ceil(len(p) / batch) for p in parts)
    share = None if cap is None else cap // SHARDS
    step = 0
    for _ in range(epochs):
        for s in range(per_epoch):
            chunks = [c for c in (p[s * batch : (s + 1) * batch] for p in parts) if len(c)]
            total = float(sum(len(c) for c in chunks))
            grads, counts = [], Counter()
            dsum = {"a": 0.0, "b": 0.0}
            for c in chunks:
                ids = np.concatenate([bags[i] for i in c])
                lengths = np.array([len(bags[i]) for i in c])
                row_of = np.repeat(np.arange(len(c)), lengths)
                uniq, inv, n = np.unique(ids, return_inverse=True, return_counts=True)
                w = np.array([rows.get(int(k), 0.0) for k in uniq])
                z = np.bincount(row_of, weights=w[inv], minlength=len(c))
                z = z + dense["a"] * x[c] + dense["b"]
                r = (1.0 / (1.0 + np.exp(-z)) - y[c]) / len(c)
                g = np.bincount(inv, weights=r[row_of], minlength=len(uniq))
                scale = len(c) / total
                grads.append(
                    {int(k): (v * scale if len(chunks) > 1 else v) for k, v in zip(uniq, g)}
                )
                for k, m in zip(uniq, n):
                    if int(k) not in rows:
                        counts[int(k)] += int(m)
                for name, v in (("a", r @ x[c]), ("b", r.sum())):
                    dsum[name] = dsum[name] + (v * scale if len(chunks) > 1 else v)
            for k in sorted(counts):
                seen[k] += counts[k]
                if seen[k] >= min_count:
                    rows[k], last[k] = 0.0, step
            acc: dict[int, float] = {}
            for g in grads:
                for k, v in g.items():
                    if k in rows:
                        acc[k] = acc.get(k, 0.0) + v
            for k, v in acc.items():
                rows[k] = rows[k] - LR * v
                last[k] = step
            for name in dense:
                dense[name] = dense[name] - LR * dsum[name]
            if ttl is not None:
                for k in [k for k in rows if last[k] <= step - ttl]:
                    del rows[k], last[k]
            if share is not None:
                keys = np.array(sorted(rows), dtype=np.int64)
                for j in range(SHARDS):
                    mine = [int(k) for k in keys[shard_of(keys, SHARDS) == j]]
                    for k in sorted(mine, key=lambda k: (last[k], k))[: max(0, len(mine) - share)]:
                        del rows[k], last[k]
            step += 1
    return rows


@pytest.mark.parametrize(
    ("min_count", "ttl", "cap"),
    [(3, None, None), (1, 2, None), (2, 6, 24)],
    ids=["admission", "expiry", "admission-expiry-cap"],
)
def test_sync_training_of_a_bounded_table_equals_the_loop_over_exact_counts(
    clicks, min_count, ttl, cap
):
    df, bags, y, x = clicks
    table = ps.Table(dim=1, min_count=min_count, ttl_steps=ttl, max_rows=cap)
    out = ps.train(
        df,
        lr_grad,
        {"w": table, "a": np.zeros(1), "b": np.zeros(1)},
        keys={"w": "ids"},
        optimizer=ps.SGD(LR),
        epochs=2,
        batch_size=30,
        num_shards=SHARDS,
        parallelism=PARTS,
    )
    try:
        want = numpy_bounded(bags, y, x, epochs=2, batch=30, min_count=min_count, ttl=ttl, cap=cap)
        everything = np.unique(np.concatenate(bags))
        got = out.lookup("w", everything)[:, 0]
        # rows held are the loop's; every other id reads as its initial value, 0
        assert dict(zip(everything.tolist(), got.tolist())) == {
            int(k): want.get(int(k), 0.0) for k in everything
        }
        assert out.params["w"].num_keys == len(want)
        assert len(want) < len(everything)  # the bounds held rows back
        if cap is not None:
            assert out.params["w"].num_keys <= cap
    finally:
        out.close()


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"min_count": 0}, "Table(min_count=...) must be an int >= 1, got 0"),
        ({"min_count": True}, "Table(min_count=...) must be an int >= 1, got True"),
        ({"min_count": 70000}, "must be at most 65535"),
        ({"ttl_steps": 0}, "Table(ttl_steps=...) must be None or an int >= 1, got 0"),
        ({"max_rows": 2.5}, "Table(max_rows=...) must be None or an int >= 1, got 2.5"),
    ],
)
def test_bad_bounds_are_refused_naming_the_argument(kwargs, says):
    with pytest.raises(hi.IterationConfigError) as got:
        ps.Table(dim=1, **kwargs)
    assert says in str(got.value)
