"""KMeans (Lloyd's algorithm) on Spark + Ray: deterministic for a seed, no NaN centres.

    python examples/kmeans.py --rows 1000000 --features 20 --k 10

Initial centres: k distinct rows drawn by Spark with a seeded ``rand`` order (the same
rows for the same seed and data). Each epoch every subtask assigns its cached points to
the nearest centre (vectorised: ||x||^2 - 2 x.c + ||c||^2) and feeds back per-centre sums
and counts; the coordinator averages them in partition order and publishes the centres.
A centre that lost all its points keeps its position (as Spark MLlib does) instead of
becoming 0/0 = NaN. Stops when no centre moved more than --tol, or at --max-iter.
"""

from __future__ import annotations

import argparse

import numpy as np

import hybrid_iter as hi


class Assign(hi.PartitionOperator):
    """Runs in a Spark task."""

    def __init__(self, features: list[str]) -> None:
        self.features = features

    def open(self, ctx):
        self.cache = hi.NumpyCache(self.features)

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.centres = variables["centres"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X = self.cache.matrix()
        if not hasattr(self, "sq"):
            self.sq = np.einsum("ij,ij->i", X, X)
        c = self.centres
        k, d = c.shape
        if len(X) == 0:
            out.feedback((np.zeros((k, d)), np.zeros(k), 0.0))
            return
        dist = self.sq[:, None] - 2.0 * (X @ c.T) + np.einsum("ij,ij->i", c, c)[None, :]
        nearest = np.argmin(dist, axis=1)
        counts = np.bincount(nearest, minlength=k).astype(float)
        # per-centre sums, one bincount per (contiguous, column-major) feature column
        sums = np.empty((k, d))
        for j in range(d):
            sums[:, j] = np.bincount(nearest, weights=X[:, j], minlength=k)
        cost = float(np.maximum(dist[np.arange(len(X)), nearest], 0.0).sum())
        out.feedback((sums, counts, cost))


class Centres(hi.CoordinatorOperator):
    """Runs in the Ray coordinator actor."""

    def open(self, init_variables, ctx):
        self.centres = np.array(init_variables["centres"])
        self.acc = None

    def process_feedback(self, value, ctx, out):
        if self.acc is None:
            self.acc = [np.array(value[0]), np.array(value[1]), value[2]]
        else:
            self.acc[0] += value[0]
            self.acc[1] += value[1]
            self.acc[2] += value[2]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        sums, counts, cost = self.acc
        self.acc = None
        new = self.centres.copy()
        filled = counts > 0
        new[filled] = sums[filled] / counts[filled, None]  # empty clusters keep their centre
        shift = float(np.max(np.linalg.norm(new - self.centres, axis=1)))
        self.centres = new
        out.output("cost", cost)
        out.output("shift", shift)
        out.output("empty_clusters", int((~filled).sum()))
        out.publish_variables(centres=new)


def initial_centres(df, features: list[str], k: int, seed: int) -> np.ndarray:
    """k distinct rows in a seeded random order (deterministic for a seed)."""
    from pyspark.sql import functions as F

    rows = (
        df.select(*features)
        .dropDuplicates()
        .withColumn("_r", F.rand(seed))
        .orderBy("_r")
        .limit(k)
        .drop("_r")
        .collect()
    )
    if len(rows) < k:
        raise hi.IterationConfigError(f"k={k} but the data has only {len(rows)} distinct points")
    return np.array([[float(v) for v in r] for r in rows])


def generate(spark, rows: int, features: int, centres: int, partitions: int, seed: int):
    """Points around `centres` well separated blobs, built in Spark."""
    from pyspark.sql import functions as F

    rng = np.random.default_rng(seed)
    means = rng.uniform(-10, 10, (centres, features))
    blob = (F.rand(seed) * centres).cast("int")
    df = spark.range(rows, numPartitions=partitions).withColumn("blob", blob)
    cols = []
    for j in range(features):
        mean = F.lit(0.0)
        for c in range(centres):
            mean = F.when(F.col("blob") == c, float(means[c, j])).otherwise(mean)
        cols.append((mean + F.randn(seed + 1 + j)).alias(f"x{j}"))
    return df.select(*cols), means


def fit(
    df, features: list[str], k: int, *, seed: int, max_iter: int, tol: float, progress: bool = True
) -> hi.IterationResult:
    init = initial_centres(df, features, k, seed)
    return hi.iterate_bounded_streams_until_termination(
        init_variables={"centres": init},
        data_streams=hi.ReplayableDataStreamList.not_replay(hi.DataStream(df, features)),
        config=hi.IterationConfig(
            staleness=0, progress=progress, progress_tag="cost", name="kmeans"
        ),
        body=hi.IterationBody(
            partition=Assign(features),
            coordinator=Centres(),
            criteria=hi.TerminateOnMaxIterOrTol(max_iter, tol, loss_tag="shift"),
            # the coordinator only adds the feedback up: merge it in a tree on the way
            feedback_combine="sum",
        ),
    )


def main(
    session: hi.Session,
    *,
    rows: int = 200_000,
    features: int = 20,
    k: int = 10,
    partitions: int = 2,
    seed: int = 1,
    max_iter: int = 50,
    tol: float = 1e-4,
    progress: bool = True,
) -> hi.IterationResult:
    df, means = generate(session.spark, rows, features, k, partitions, seed)
    df = df.cache()
    df.count()
    cols = [f"x{j}" for j in range(features)]
    result = fit(df, cols, k, seed=seed, max_iter=max_iter, tol=tol, progress=progress)
    centres = result.variables["centres"]
    # distance from each true blob mean to the nearest found centre
    miss = max(float(np.min(np.linalg.norm(centres - m, axis=1))) for m in means)
    print(result.summary())
    print(
        f"cost {result.outputs['cost'][-1]:.4g}; worst blob-to-centre distance {miss:.3f}; "
        f"NaN in centres: {bool(np.isnan(centres).any())}"
    )
    df.unpersist()
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--features", type=int, default=20)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-iter", type=int, default=50)
    args = ap.parse_args()
    with hi.Session.local(parallelism=args.partitions) as session:
        main(
            session,
            rows=args.rows,
            features=args.features,
            k=args.k,
            partitions=args.partitions,
            seed=args.seed,
            max_iter=args.max_iter,
        )
