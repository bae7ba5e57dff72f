"""A factorization machine (Rendle 2010) with k factors per id, on a parameter server.

    python examples/ps_factorization_machine.py --rows 200000 --k 8

    z = bias + sum_i w_i x_i + 1/2 sum_f [(sum_i v_if x_i)^2 - sum_i v_if^2 x_i^2]

``w`` and ``v`` are tables keyed by the same ids (a bag of ids per row, or a
SparseVector's indices and values), ``v``'s rows start from a seeded normal (per id, the
same whatever the shard count). The data here is a recommendation-like toy where the
label depends only on the interaction of a user and an item (their hidden factors), so
a linear model on the same ids cannot fit it and an FM can.
"""

from __future__ import annotations

import argparse

import numpy as np

import hybrid_iter as hi
from hybrid_iter import ps


def interactions(spark, rows, *, users=200, items=200, seed=0, partitions=2):
    """(train, test): ``ids`` = [user id, item id + 10^6], ``label`` = 1 with probability
    sigmoid(4 a_user . b_item) for hidden 3-d factors a, b."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(users, 3)), rng.normal(size=(items, 3))
    u, i = rng.integers(0, users, rows), rng.integers(0, items, rows)
    p = 1 / (1 + np.exp(-4 * np.einsum("nf,nf->n", a[u], b[i]) / np.sqrt(3)))
    y = (rng.random(rows) < p).astype(float)
    data = [([int(uu), int(ii) + 1_000_000], float(yy)) for uu, ii, yy in zip(u, i, y)]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(data, partitions), "ids array<long>, label double"
    )
    return df.randomSplit([0.8, 0.2], seed=seed)


def fm_terms(params, x):
    v = params["v"]
    s = x.dot(v)  # (rows, k): sum_i v_if x_i
    s2 = x.square().dot(v.with_values(v.values**2))
    z = params["bias"][0] + x.dot(params["w"])[:, 0] + 0.5 * (s * s - s2).sum(axis=1)
    return z, s


def grad_fn(params, batch):
    """Runs in the Spark tasks: logistic loss of the FM and its gradient."""
    x, y = batch["ids"], batch["label"]
    z, s = fm_terms(params, x)
    r = 1.0 / (1.0 + np.exp(-z)) - y  # summed over the batch: Adagrad's steps are per id
    grad_v = x.t_dot(r[:, None] * s) - params["v"].values * x.square().t_dot(r)
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return loss, {"bias": np.array([r.sum()]), "w": x.t_dot(r), "v": grad_v}


def predict_fn(params, batch):
    z, _ = fm_terms(params, batch["ids"])
    return 1.0 / (1.0 + np.exp(-z))


def main(
    session, df=None, test=None, *, k=8, rows=100_000, epochs=10, batch_size=1024, progress=None
):
    if df is None:
        df, test = interactions(session.spark, rows)
    return ps.train(
        df.cache(),
        grad_fn,
        {
            "bias": np.zeros(1),
            "w": ps.Table(dim=1),
            "v": ps.Table(dim=k, init=ps.Normal(0.1, seed=7)),
        },
        keys={"w": "ids", "v": "ids"},
        optimizer=ps.Adagrad(learning_rate=0.2),
        epochs=epochs,
        batch_size=batch_size,
        eval_df=test.cache() if test is not None else None,
        predict_fn=predict_fn if test is not None else None,
        progress=progress,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    with hi.Session.local(2) as session:
        out = main(session, k=args.k, rows=args.rows, epochs=args.epochs, progress=True)
        for e in out.eval:
            print(
                f"epoch {int(e['epoch'])}: held-out log loss {e['log_loss']:.4f}, AUC {e['auc']:.4f}"
            )
        out.close()
