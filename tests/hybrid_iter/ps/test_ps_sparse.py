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
ZEROS = Init()


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

    def __init__(self, dim, init=ZEROS):
        self.dim, self.init = dim, init
        self.rows: dict[int, np.ndarray] = {}
        self.state: dict[int, dict[str, np.ndarray]] = {}

    def get(self, keys):
        for k in keys:
            if int(k) not in self.rows:
                self.rows[int(k)] = init_rows(self.init, np.array([k]), self.dim)[0]
        return np.array([self.rows[int(k)] for k in keys]).reshape(len(keys), self.dim)


def numpy_sync(bags, y, x, *, epochs, batch, update, dim=1, init=ZEROS, steps=None):
    """The sync reference: each step's global batch is every partition's next local batch;
    per partition, the gradient of its batch (sums in entry order, as np.bincount); the
    step's gradient of each key is the partitions' row-weighted sum in partition order;
    ``update(kind, key_or_name, value, grad)`` applies the optimizer."""
    table = NumpyTable(dim, init)
    dense = {"a": np.zeros(1), "b": np.zeros(1)}
    parts = np.array_split(np.arange(N), PARTS)
    per_epoch = max(math.ceil(len(p) / batch) for p in parts)
    for _ in range(epochs):
        for s in range(per_epoch if steps is None else steps):
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
                    dsum[name] = dsum[name] + (
                        part[name] * scale if len(chunks) > 1 else part[name]
                    )
            for name in dense:
                dense[name] = update("dense", name, dense[name], dsum[name])
            for k, gk in gsum.items():
                table.rows[k] = update("row", k, table.rows[k], np.array([gk]))
    return table, dense


@pytest.mark.spark_lines  # the compatibility set every CI environment runs
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


def test_the_dense_and_the_table_path_of_one_model_agree(spark):
    """The same logistic regression on ids in [0, 64): a dense (64,) weight vector with
    ps.Sparse pushes, and a table; sync SGD gives the same numbers, and the dense entries
    no batch touched stay 0."""
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(200):
        bag = rng.choice(48, size=int(rng.integers(1, 5)), replace=False)
        rows.append(([int(b) for b in bag], float(rng.random() < 0.5)))
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS), "ids array<long>, label double"
    )

    def dense_grad(params, batch):
        x, y = batch["ids"], batch["label"]
        z = x.dot(params["w"]) + params["b"][0]
        r = (1 / (1 + np.exp(-z)) - y) / len(y)
        loss = float(np.mean(np.logaddexp(0, z) - y * z))
        return loss, {"w": x.t_dot(r, like=params["w"]), "b": np.array([r.sum()])}

    def table_grad(params, batch):
        x, y = batch["ids"], batch["label"]
        z = x.dot(params["w"])[:, 0] + params["b"][0]
        r = (1 / (1 + np.exp(-z)) - y) / len(y)
        loss = float(np.mean(np.logaddexp(0, z) - y * z))
        return loss, {"w": x.t_dot(r), "b": np.array([r.sum()])}

    kw = {"optimizer": ps.SGD(0.8), "epochs": 3, "batch_size": 30, "parallelism": PARTS}
    dense = ps.train(
        df, dense_grad, {"w": np.zeros(64), "b": np.zeros(1)}, sparse_columns=["ids"], **kw
    )
    table = ps.train(
        df, table_grad, {"w": ps.Table(), "b": np.zeros(1)}, keys={"w": "ids"}, num_shards=3, **kw
    )
    try:
        touched = np.unique(np.concatenate([r[0] for r in rows]))
        np.testing.assert_array_equal(table.lookup("w", touched)[:, 0], dense.params["w"][touched])
        np.testing.assert_array_equal(table.params["b"], dense.params["b"])
        untouched = np.setdiff1d(np.arange(64), touched)
        assert (dense.params["w"][untouched] == 0).all()
        assert table.params["w"].num_keys == len(touched)
        assert table.loss == dense.loss
    finally:
        table.close()


def _fm_grad(params, batch):
    """A factorization machine (k factors) on a bag of ids, squared loss."""
    x, y = batch["ids"], batch["label"]
    v = params["v"]
    s = x.dot(v)  # (n, k)
    s2 = x.square().dot(ps.Rows("v", v.ids, v.values * v.values))
    z = x.dot(params["w"])[:, 0] + 0.5 * (s * s - s2).sum(axis=1)
    r = (z - y) / len(y)
    gv = x.t_dot(r[:, None] * s) - v.values * x.square().t_dot(r)
    return float(np.mean((z - y) ** 2) / 2), {"w": x.t_dot(r), "v": gv}


@pytest.mark.parametrize("shuffle", [False, True])
def test_lazy_rows_do_not_depend_on_the_shard_count_or_the_order(clicks, shuffle):
    """An FM whose factors start from a seeded normal: sync runs on 1, 2 and 3 shards (and
    with the rows in another order) give the same bits; a key never touched reads as its
    initializer's value (and is not created)."""
    df = clicks[0]
    runs = []
    for shards in (1, 2, 3):
        out = ps.train(
            df,
            _fm_grad,
            {"w": ps.Table(), "v": ps.Table(dim=4, init=ps.Normal(0.1, seed=11))},
            keys={"w": "ids", "v": "ids"},
            optimizer=ps.Adagrad(0.05),
            epochs=2,
            batch_size=40,
            num_shards=shards,
            shuffle=shuffle,
            parallelism=PARTS,
        )
        runs.append(out)
    try:
        keys = np.unique(np.concatenate(clicks[1]))
        first = runs[0].lookup("v", keys)
        for out in runs[1:]:
            np.testing.assert_array_equal(out.lookup("v", keys), first)
            np.testing.assert_array_equal(out.lookup("w", keys), runs[0].lookup("w", keys))
            assert out.loss == runs[0].loss
        fresh = np.array([123456789012345, -987654321])
        want = init_rows(Init("normal", {"std": 0.1, "mean": 0.0}, 11), fresh, 4)
        np.testing.assert_array_equal(runs[2].lookup("v", fresh), want)
        assert runs[2].params["v"].num_keys == len(keys)
        assert sum(s["tables"]["v"]["keys"] for s in runs[2].shards) == len(keys)
        assert all(s["tables"]["v"]["keys"] > 0 for s in runs[2].shards)
    finally:
        for out in runs:
            out.close()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def test_a_2_pow_30_wide_sparse_vector_column_trains_in_bounded_memory(spark):
    """Hashed features in a 2^30-wide SparseVector column (one row densified would be
    8 GiB): training reads its indices and values as CSR. Asserted: the Python memory the
    training steps allocate (traced from the first step on) stays under 16 MB, and the
    peak resident set of the Spark task's process stays far under one dense row."""
    from pyspark.ml.linalg import SparseVector, VectorUDT
    from pyspark.sql.types import DoubleType, StructField, StructType

    rng = np.random.default_rng(7)
    width = 2**30
    rows = []
    for _ in range(400):
        idx = np.unique(rng.integers(0, width, 12))
        rows.append(
            (
                SparseVector(width, idx.tolist(), rng.normal(size=len(idx)).tolist()),
                float(rng.random() < 0.3),
            )
        )
    schema = StructType([StructField("features", VectorUDT()), StructField("label", DoubleType())])
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, PARTS), schema)

    def grad(params, batch):
        x, y = batch["features"], batch["label"]
        if not tracemalloc.is_tracing():
            tracemalloc.start()
        z = x.dot(params["w"])[:, 0] + params["b"][0]
        r = (1 / (1 + np.exp(-z)) - y) / len(y)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 16 * 2**20, f"steps allocated {peak} bytes"
        assert _peak_rss() < 2 * 2**30, f"peak RSS {_peak_rss()}"
        loss = float(np.mean(np.logaddexp(0, z) - y * z))
        return loss, {"w": x.t_dot(r), "b": np.array([r.sum()])}

    out = ps.train(
        df,
        grad,
        {"w": ps.Table(), "b": np.zeros(1)},
        keys={"w": "features"},
        optimizer=ps.FTRL(alpha=0.1, l1=0.01),
        epochs=3,
        batch_size=64,
        parallelism=PARTS,
    )
    try:
        keys = np.unique(np.concatenate([r[0].indices for r in rows]))
        assert out.params["w"].num_keys == len(keys)
        assert out.loss[-1] < out.loss[0]

        def margin(params, batch):
            return batch["features"].dot(params["w"])[:, 0] + params["b"][0]

        # transform keeps the vector column (a UDT) and adds the score
        scored = out.transform(df, margin).limit(20).collect()
        for row in scored:
            v = row.features
            want = float(out.lookup("w", v.indices)[:, 0] @ v.values) + out.params["b"][0]
            assert row.prediction == pytest.approx(want, rel=1e-12, abs=1e-15)
    finally:
        out.close()


def test_save_load_and_transform_round_trip(clicks, tmp_path, spark):
    """save writes each shard's rows (Parquet: key, values) and the dense parameters;
    load brings them into new shards (another shard count: rows re-hashed); transform
    scores a DataFrame by looking rows up, equal to predict_fn on the trained params; an
    unknown id reads as the initializer's value; to_dataframe exports (key, vector)."""
    df, bags, y, x = clicks
    out = ps.train(
        df,
        lr_grad,
        {"w": ps.Table(init=ps.Normal(0.01, seed=3)), "a": np.zeros(1), "b": np.zeros(1)},
        keys={"w": "ids"},
        optimizer=ps.FTRL(alpha=0.3, l1=0.01),
        epochs=2,
        batch_size=40,
        num_shards=2,
        parallelism=PARTS,
        predict_fn=lr_predict,
    )
    uri = str(tmp_path / "model")
    try:
        out.save(uri)
        scored = out.transform(df).toPandas()
        keys = np.unique(np.concatenate(bags))
        trained = out.lookup("w", keys)
        exported = out.to_dataframe(spark, "w").toPandas()
    finally:
        out.close()
    import pyarrow.parquet as pq

    parts = pq.read_table(str(tmp_path / "model" / "tables" / "w")).to_pydict()
    assert sorted(parts["key"]) == keys.tolist()
    assert sorted(exported["key"]) == keys.tolist()
    got = dict(zip(exported["key"], (v.toArray()[0] for v in exported["vector"])))
    assert [got[int(k)] for k in keys] == trained[:, 0].tolist()
    # the scores are predict_fn on the trained rows
    table = dict(zip(keys.tolist(), trained[:, 0]))
    want = []
    for ids_, xi in zip(scored["ids"], scored["x"]):
        z = sum(table[int(k)] for k in ids_) + out.params["a"][0] * xi + out.params["b"][0]
        want.append(1 / (1 + math.exp(-z)))
    np.testing.assert_allclose(scored["prediction"], want, rtol=1e-12)
    loaded = ps.load(uri, num_shards=3, predict_fn=lr_predict)
    try:
        np.testing.assert_array_equal(loaded.lookup("w", keys), trained)
        unknown = np.array([2**62 + 1])
        np.testing.assert_array_equal(
            loaded.lookup("w", unknown), init_rows(Init("normal", {"std": 0.01}, 3), unknown, 1)
        )
        again = loaded.transform(df).toPandas()
        np.testing.assert_array_equal(again["prediction"], scored["prediction"])
        np.testing.assert_array_equal(loaded.params["b"], out.params["b"])
    finally:
        loaded.close()
    with pytest.raises(hi.UsageError, match="closed"):
        loaded.lookup("w", keys)


def test_evaluation_per_epoch_and_early_stopping(clicks):
    """eval_df is scored after every epoch (log loss and AUC, equal to scikit-learn's on
    the model of that epoch's end); early_stopping stops after that many epochs without
    a better log loss; the per-shard counters are in the result. The evaluation rows are
    the training rows with their labels flipped: the better the fit, the worse it does
    there, so the run stops 2 epochs after its first."""
    from pyspark.sql import functions as F
    from sklearn.metrics import log_loss as sk_log_loss
    from sklearn.metrics import roc_auc_score

    df, bags, y, x = clicks
    flipped = df.withColumn("label", 1.0 - F.col("label"))
    y = 1.0 - y
    out = ps.train(
        df,
        lr_grad,
        {"w": ps.Table(), "a": np.zeros(1), "b": np.zeros(1)},
        keys={"w": "ids"},
        optimizer=ps.SGD(0.5),
        epochs=30,
        batch_size=40,
        parallelism=PARTS,
        eval_df=flipped,
        predict_fn=lr_predict,
        early_stopping=2,
    )
    try:
        ev = out.eval
        assert len(ev) == out.result.epochs == 3
        losses = [e["log_loss"] for e in ev]
        assert losses[0] < losses[1] < losses[2]  # the best first, then 2 without a better
        assert out.best == {"epoch": 0, "log_loss": losses[0]}
        assert all(0 <= e["auc"] <= 1 and e["rows"] == N for e in ev)
        # the last epoch's metrics are the final model's
        keys = np.unique(np.concatenate(bags))
        table = dict(zip(keys.tolist(), out.lookup("w", keys)[:, 0]))
        z = np.array([sum(table[int(k)] for k in bag) for bag in bags])
        p = 1 / (1 + np.exp(-(z + out.params["a"][0] * x + out.params["b"][0])))
        assert ev[-1]["log_loss"] == pytest.approx(sk_log_loss(y, p), rel=1e-9)
        assert ev[-1]["auc"] == pytest.approx(roc_auc_score(y, p), rel=1e-9)
        shards = out.shards
        assert sum(s["tables"]["w"]["keys"] for s in shards) == len(keys)
        assert all(s["bytes_in"] > 0 and s["bytes_out"] > 0 and s["calls"] > 0 for s in shards)
        for s in shards:
            t = s["tables"]["w"]
            assert 0 < t["hottest_share"] <= 1 and len(t["hottest"]) == 10
        # the hottest keys over every shard, in the result: the global top 10 by touches
        hot = out.hot_keys["w"]
        every = sorted(
            (kn for s in shards for kn in s["tables"]["w"]["hottest"]), key=lambda kn: -kn[1]
        )
        assert [n for _, n in hot["hottest"]] == [n for _, n in every[:10]]
        assert hot["touches"] == sum(s["tables"]["w"]["touches"] for s in shards)
        assert hot["share"] == pytest.approx(sum(n for _, n in hot["hottest"]) / hot["touches"])
        per_epoch = out.result.outputs["shards"]
        assert len(per_epoch) == len(ev) and per_epoch[0]["keys"] == len(keys)
        assert per_epoch[-1]["hot_share"]["w"] == pytest.approx(hot["share"])
    finally:
        out.close()


# -- bad input --------------------------------------------------------------------------------


def _last_job_id(sc) -> int:
    """The id of a probe job run now (job ids grow by one per job, whatever its group):
    two probes one id apart prove that no job ran between them."""
    import uuid

    group = f"probe-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "job probe")
    try:
        sc.parallelize([0], 1).count()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return max(sc.statusTracker().getJobIdsForGroup(group))


SHARED = ps.Table(dim=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"keys": {"w": "label"}},
            "ps.train(keys=...): the id column 'label' has type double, which is not integral; "
            "ids are read from integer columns",
        ),
        ({"keys": {"w": "floats"}}, "Cast it (F.col('floats').cast('array<long>'))"),
        ({"keys": {"w": "name"}}, "the id column 'name' has type string"),
        ({"keys": {"w": "nope"}}, "column 'nope' is not in the DataFrame"),
        ({"keys": {}}, "gives no id column for the table 'w'"),
        ({"keys": {"w": "ids", "b": "ids"}}, "names 'b', which is a dense parameter"),
        ({"keys": {"w": "ids", "z": "ids"}}, "names 'z', which is not in init"),
        ({"keys": {"w": ["ids", "ids"]}}, "lists a column twice"),
        ({"keys": "ids"}, "must map each table's name to its id column(s)"),
        (
            {"init": {"u": SHARED, "v": SHARED}, "keys": {"u": "ids", "v": "ids"}},
            "declares the table 'u' twice",
        ),
        ({"init": ps.Table()}, "a ps.Table must be named"),
        (
            {"sparse_columns": ["x"]},
            "ps.train(sparse_columns=...): the id column 'x' has type double",
        ),
        ({"mode": "sync", "staleness_steps": 2}, "staleness_steps=...) bounds how far async"),
        ({"mode": "async", "staleness_steps": -1}, "staleness_steps"),
        ({"eval_df": "DF"}, "needs predict_fn"),
        ({"early_stopping": 2}, "early_stopping=...) stops on an evaluation metric"),
        (
            {"eval_df": "DF", "predict_fn": lr_predict, "eval_metrics": ("accuracy",)},
            "eval_metrics",
        ),
        ({"eval_df": "DF", "predict_fn": lr_predict, "label_col": "y"}, "label_col='y'"),
        ({"checkpoint": "/tmp/x"}, "CheckpointConfig"),
        ({"optimizer": ps.FTRL}, "ps.FTRL(...)"),
    ],
)
def test_bad_input_is_refused_before_any_spark_job(spark, clicks, kwargs, message):
    from pyspark.sql import functions as F

    df = clicks[0].withColumn("floats", F.array(F.col("x"))).withColumn("name", F.lit("a"))
    kwargs = dict(kwargs)
    if kwargs.get("eval_df") == "DF":
        kwargs["eval_df"] = df
    init = kwargs.pop("init", {"w": ps.Table(), "b": np.zeros(1)})
    kwargs.setdefault("keys", {"w": "ids"})
    sc = spark.sparkContext
    before = _last_job_id(sc)
    with pytest.raises(hi.IterationConfigError, match=re.escape(message)):
        ps.train(df, lr_grad, init, columns=["ids", "label", "x"], parallelism=PARTS, **kwargs)
    assert _last_job_id(sc) == before + 1


def test_a_gradient_of_the_wrong_dim_fails_naming_the_table_and_the_shape(clicks):
    df = clicks[0]

    def wrong(params, batch):
        loss, g = lr_grad(params, batch)
        g["v"] = np.zeros((len(params["v"].ids), 3))  # the table has dim 4
        return loss, g

    with pytest.raises(ps.TrainFailedError) as info:
        ps.train(
            df,
            wrong,
            {"w": ps.Table(), "v": ps.Table(dim=4), "a": np.zeros(1), "b": np.zeros(1)},
            keys={"w": "ids", "v": "ids"},
            epochs=1,
            batch_size=50,
            parallelism=PARTS,
        )
    message = str(info.value)
    assert re.search(
        r"grad_fn returned grad\['v'\] of shape \((\d+), 3\) \(float64\); the table 'v' has "
        r"dim 4 and this batch references \1 of its keys: return an array of shape \(\1, 4\)",
        message,
    ), message
    if info.value.params is not None:
        info.value.params["w"].model.close()


def test_a_nan_in_a_tables_gradient_names_the_table_and_the_key_and_loses_nothing(clicks):
    """Partition 1's third step puts NaN in the gradient row of one key: the error names the
    table, the key, the partition, epoch and step; the shards hold every earlier update
    and nothing of that step (TrainFailedError.params reads them)."""
    df, bags, y, x = clicks
    lo = N // 2 + 60  # partition 1's step 2: its rows [60, 90)
    bad_key = int(bags[next(i for i in range(lo, lo + 30) if len(bags[i]))][0])

    class Bad:
        calls = 0

        def __call__(self, params, batch):
            loss, g = lr_grad(params, batch)
            if batch["x"][0] == x[N // 2 + 60]:  # partition 1's step 2 (3rd batch of 30)
                g["w"] = g["w"].copy()
                g["w"][np.flatnonzero(params["w"].ids == bad_key)[0], 0] = np.nan
            return loss, g

    with pytest.raises(ps.TrainFailedError) as info:
        ps.train(
            df,
            Bad(),
            {"w": ps.Table(), "a": np.zeros(1), "b": np.zeros(1)},
            keys={"w": "ids"},
            optimizer=ps.SGD(0.5),
            epochs=2,
            batch_size=30,
            parallelism=PARTS,
        )
    err = info.value
    assert f"grad['w'] for key {bad_key} (row" in str(err)
    assert "in partition 1 at epoch 0, step 2; nothing of this step was sent" in str(err)
    assert isinstance(err.failures[1].cause, ps.NonFiniteGradient)
    try:
        # what the shards hold: exactly the 2 steps before (the numpy loop stopped there)
        table, dense = numpy_sync(
            bags, y, x, epochs=1, batch=30, update=lambda k, n, v, g: v - 0.5 * g, steps=2
        )
        keys = np.array(sorted(table.rows))
        np.testing.assert_array_equal(
            err.params["w"].lookup(keys), np.array([table.rows[int(k)] for k in keys])
        )
        np.testing.assert_array_equal(err.params["b"], dense["b"])
    finally:
        err.params["w"].model.close()


def test_staleness_steps_bounds_how_far_async_workers_run_apart(clicks, capsys):
    """Async with staleness_steps=1 and a simulated straggler (partition 1 computes
    slower): no worker starts a step more than 1 step ahead of the slowest (the shards
    measure the lead of every step they release), the fast one waited for it, and the
    run converges. The progress line shows the loss, the keys held, the bytes per call and
    the share of touches that the 10 hottest keys took."""
    import time

    df, _, _, x = clicks
    slow = set(x[N // 2 :].tolist())  # partition 1's rows

    def slowed(params, batch):
        if batch["x"][0] in slow:
            time.sleep(0.01)  # a simulated straggler: this partition computes slower
        return lr_grad(params, batch)

    out = ps.train(
        df,
        slowed,
        {"w": ps.Table(), "a": np.zeros(1), "b": np.zeros(1)},
        keys={"w": "ids"},
        optimizer=ps.Adagrad(0.2),
        mode="async",
        staleness_steps=1,
        epochs=3,
        batch_size=20,
        num_shards=2,
        parallelism=PARTS,
        progress=True,
    )
    try:
        assert all(s["max_lead"] <= 1 for s in out.shards)
        assert sum(s["gate_waits"] for s in out.shards) > 0
        assert all(s["updates"] == 2 * 6 * 3 for s in out.shards)
        assert out.loss[-1] < out.loss[0]
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert re.search(r"epoch +3 +loss [\d.]+ +keys \d+ +kB/call [\d.]+ +top10% [\d.]+", line), (
            line
        )
    finally:
        out.close()
