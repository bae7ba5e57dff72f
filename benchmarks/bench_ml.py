"""Issue 10 benchmark: hybrid_iter.ml vs Spark MLlib vs a single-process numpy loop.

    python benchmarks/bench_ml.py                     # 1,000,000 x 50 LR; 1,000,000 x 20 KMeans, k=10
    python benchmarks/bench_ml.py --rows 200000 --km-rows 200000 --repeats 2   # quicker

On generated data with a fixed seed (the examples' generators, built inside Spark and
cached), 2 partitions, measured side by side in one run, medians of ``--repeats`` runs:

* ``LogisticRegression`` (full batch, ``--epochs`` epochs): seconds per epoch of ours
  (between global alignments, the first epoch, which builds the matrix, left out), of a
  numpy loop over the same arrays collected to the driver (the faster of ours' kernel,
  ``hybrid_iter.ml.linear.linear_gradient``, and the textbook ``X @ w``, ``X.T @ r``
  with numpy's BLAS threads: the machine's limit for one process), and of MLlib's
  ``LogisticRegression`` (L-BFGS): its marginal cost per extra iteration and its
  amortised cost per iteration of a 10-iteration fit (``bench_iteration.py``'s method).
  End to end (from the cached DataFrame): our ``fit``; numpy's collect + loop; MLlib's
  VectorAssembler + cache + fit to convergence. Final log loss and accuracy of each.
* ``KMeans`` (k-means||, ``--km-iter`` Lloyd iterations): seconds per Lloyd pass of ours,
  of numpy (the same kernel, ``hybrid_iter.ml.kmeans.nearest_centres``), and of MLlib's
  ``KMeans`` (marginal and amortised); end to end as above; final cost of each on the
  same points, numpy's Lloyd starting from the blobs' true means (the optimum).

Prints medians and ratios; writes JSON to benchmarks/results/ml.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

import kmeans as km_example  # noqa: E402
import logistic_regression as lr_example  # noqa: E402

import hybrid_iter as hi  # noqa: E402
from hybrid_iter import ml  # noqa: E402
from hybrid_iter.ml.kmeans import nearest_centres  # noqa: E402
from hybrid_iter.ml.linear import linear_gradient, logistic_terms  # noqa: E402

med = statistics.median


# -- numpy references ---------------------------------------------------------------------


def numpy_lr(X, y, epochs, lr, *, blocked):
    """Full-batch gradient descent; per-epoch seconds and the model. ``blocked``: ours'
    kernel (``linear_gradient``: one pass over X in cache-sized row blocks), else the
    textbook ``X @ w`` then ``X.T @ r`` over the whole matrix (numpy's BLAS threads on
    both); the faster is the machine's limit."""
    w, b = np.zeros(X.shape[1]), 0.0
    n, d = X.shape
    times = []
    for _ in range(epochs):
        t = time.perf_counter()
        if blocked:
            g = linear_gradient(X, y, w, b, None, logistic=True)
            gw, gb = g[:d], g[d]
        else:
            r, _ = logistic_terms(X @ w + b, y)
            gw, gb = X.T @ r, float(r.sum())
        w = w - lr * gw / n
        b -= lr * gb / n
        times.append(time.perf_counter() - t)
    return times, w, b


def numpy_kmeans(X, C, iters):
    sq = np.einsum("ij,ij->i", X, X)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        sums = np.zeros(C.shape)
        idx, _ = nearest_centres(X, sq, C, sums=sums)
        counts = np.bincount(idx, minlength=len(C)).astype(float)
        new = C.copy()
        filled = counts > 0
        new[filled] = sums[filled] / counts[filled, None]
        C = new
        times.append(time.perf_counter() - t)
    return times, C


def log_loss(X, y, w, b):
    _, loss = logistic_terms(X @ w + b, y)
    return float(loss.mean())


def accuracy(X, y, w, b):
    return float(np.mean(((X @ w + b) > 0) == (y == 1)))


def kmeans_cost(X, C):
    return float(nearest_centres(X, np.einsum("ij,ij->i", X, X), C)[1].sum())


# -- MLlib ----------------------------------------------------------------------------------


def mllib_slope(fit, sizes, repeats):
    """(marginal s/iteration: slope of fit time over iterations, amortised s/iteration of
    the largest fits, the fits) for ``fit(max_iter) -> (seconds, iterations)``."""
    fit(2)  # warm-up: JIT, caches
    fits = []
    for _ in range(repeats):
        for m in sizes:
            t, n = fit(m)
            fits.append({"max_iter": m, "iterations": n, "seconds": t})
    n = np.array([f["iterations"] for f in fits], dtype=float)
    t = np.array([f["seconds"] for f in fits])
    marginal = float(np.polyfit(n, t, 1)[0]) if len(set(n)) > 1 else float("nan")
    top = max(sizes)
    amortised = med(f["seconds"] / f["iterations"] for f in fits if f["max_iter"] == top)
    return marginal, amortised, fits


def assemble(df, cols):
    from pyspark.ml.feature import VectorAssembler

    return VectorAssembler(inputCols=cols, outputCol="features").transform(df)


# -- the two benchmarks ---------------------------------------------------------------------


def bench_lr(spark, args):
    from pyspark.ml.classification import LogisticRegression as MLlibLR

    cols = [f"x{j}" for j in range(args.features)]
    t = time.perf_counter()
    df, _, _ = lr_example.generate(spark, args.rows, args.features, args.partitions, seed=42)
    df = df.cache()
    df.count()
    generate_s = time.perf_counter() - t
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "numpy",
            "numpy_plain",
            "numpy_blocked",
            "ours",
            "numpy_e2e",
            "ours_e2e",
            "ours_load",
        )
    }
    for r in range(args.repeats):
        t = time.perf_counter()
        pdf = df.toPandas()
        X = np.asfortranarray(pdf[cols].to_numpy(dtype=np.float64))
        y = pdf["label"].to_numpy(dtype=np.float64)
        del pdf
        collect_s = time.perf_counter() - t
        plain, _, _ = numpy_lr(X, y, args.epochs, args.lr, blocked=False)
        times, w_np, b_np = numpy_lr(X, y, args.epochs, args.lr, blocked=True)
        runs["numpy_plain"].append(med(plain[1:]))
        runs["numpy_blocked"].append(med(times[1:]))
        runs["numpy"].append(min(runs["numpy_plain"][-1], runs["numpy_blocked"][-1]))
        runs["numpy_e2e"].append(collect_s + min(sum(plain), sum(times)))
        if r < args.repeats - 1:
            del X, y
        t = time.perf_counter()
        model = ml.LogisticRegression(
            features_col=cols,
            max_iter=args.epochs,
            learning_rate=args.lr,
            tol=0.0,
            parallelism=args.partitions,
            progress=False,
        ).fit(df)
        runs["ours_e2e"].append(time.perf_counter() - t)
        runs["ours"].append(med(model.result.epoch_seconds[1:]))
        runs["ours_load"].append(model.result.load_seconds)
        print(
            f"LR run {r + 1}/{args.repeats}: numpy {runs['numpy'][-1] * 1e3:.1f} ms/epoch (plain "
            f"{runs['numpy_plain'][-1] * 1e3:.1f}, blocked {runs['numpy_blocked'][-1] * 1e3:.1f}) | ours "
            f"{runs['ours'][-1] * 1e3:.1f} ms/epoch | e2e numpy {runs['numpy_e2e'][-1]:.2f} s, "
            f"ours {runs['ours_e2e'][-1]:.2f} s",
            flush=True,
        )
    report = {
        "rows": args.rows,
        "features": args.features,
        "epochs": args.epochs,
        "learning_rate": args.lr,
        "generate_and_cache_s": generate_s,
        "numpy_s_per_epoch": med(runs["numpy"]),
        "numpy_plain_s_per_epoch": med(runs["numpy_plain"]),
        "numpy_blocked_s_per_epoch": med(runs["numpy_blocked"]),
        "ours_s_per_epoch": med(runs["ours"]),
        "numpy_e2e_s": med(runs["numpy_e2e"]),
        "ours_e2e_s": med(runs["ours_e2e"]),
        "ours_load_s": med(runs["ours_load"]),
        "runs": runs,
        "numpy": {"log_loss": log_loss(X, y, w_np, b_np), "accuracy": accuracy(X, y, w_np, b_np)},
        "ours": {
            "log_loss": log_loss(X, y, model.coefficients, model.intercept),
            "accuracy": accuracy(X, y, model.coefficients, model.intercept),
            "max_abs_diff_w_vs_numpy": float(np.max(np.abs(model.coefficients - w_np))),
        },
    }
    if not args.skip_mllib:
        t = time.perf_counter()
        vec = assemble(df, cols).select("features", "label").cache()
        vec.count()
        cache_s = time.perf_counter() - t

        def fit(iters, tol=0.0):
            est = MLlibLR(maxIter=iters, regParam=0.0, tol=tol, standardization=False)
            t = time.perf_counter()
            m = est.fit(vec)
            return time.perf_counter() - t, m

        marginal, amortised, fits = mllib_slope(
            lambda m: (lambda s, mod: (s, mod.summary.totalIterations))(*fit(m)),
            (1, 4, 7, 10),
            args.repeats,
        )
        e2e = []
        for _ in range(args.repeats):
            s, ref = fit(100, tol=1e-6)  # MLlib's defaults: to convergence
            e2e.append(cache_s + s)
        w_ref, b_ref = ref.coefficients.toArray(), ref.intercept
        vec.unpersist()
        report["mllib"] = {
            "marginal_s_per_iteration": marginal,
            "amortised_s_per_iteration": amortised,
            "assemble_and_cache_s": cache_s,
            "e2e_s": med(e2e),
            "e2e_iterations": ref.summary.totalIterations,
            "log_loss": log_loss(X, y, w_ref, b_ref),
            "accuracy": accuracy(X, y, w_ref, b_ref),
            "fits": fits,
        }
        print(
            f"LR mllib: {marginal * 1e3:.1f} ms per extra iteration, {amortised * 1e3:.1f} ms "
            f"per iteration of a 10-iteration fit; to convergence {med(e2e):.2f} s "
            f"({ref.summary.totalIterations} iterations)",
            flush=True,
        )
    df.unpersist()
    return report


def bench_kmeans(spark, args):
    from pyspark.ml.clustering import KMeans as MLlibKMeans

    cols = [f"x{j}" for j in range(args.km_features)]
    t = time.perf_counter()
    df, means = km_example.generate(
        spark, args.km_rows, args.km_features, args.k, args.partitions, args.seed
    )
    df = df.cache()
    df.count()
    generate_s = time.perf_counter() - t
    runs = {"numpy": [], "ours": [], "numpy_e2e": [], "ours_e2e": []}
    for r in range(args.repeats):
        t = time.perf_counter()
        X = np.ascontiguousarray(df.toPandas()[cols].to_numpy(dtype=np.float64))
        X = np.asfortranarray(X)
        collect_s = time.perf_counter() - t
        # Lloyd from the blobs' true means: the per-pass cost is the machine's limit and
        # the final cost the optimum the inits are judged by
        times, C_np = numpy_kmeans(X, np.array(means, dtype=np.float64), args.km_iter)
        runs["numpy"].append(med(times))
        runs["numpy_e2e"].append(collect_s + sum(times))
        t = time.perf_counter()
        model = ml.KMeans(
            features_col=cols,
            k=args.k,
            max_iter=args.km_iter,
            tol=0.0,
            seed=args.seed,
            parallelism=args.partitions,
            progress=False,
        ).fit(df)
        runs["ours_e2e"].append(time.perf_counter() - t)
        lloyd = model.result.epoch_seconds[-model.params["iterations"] :]
        runs["ours"].append(med(lloyd))
        print(
            f"KMeans run {r + 1}/{args.repeats}: numpy {runs['numpy'][-1] * 1e3:.1f} ms/pass | "
            f"ours {runs['ours'][-1] * 1e3:.1f} ms/pass | e2e numpy "
            f"{runs['numpy_e2e'][-1]:.2f} s, ours {runs['ours_e2e'][-1]:.2f} s",
            flush=True,
        )
    report = {
        "rows": args.km_rows,
        "features": args.km_features,
        "k": args.k,
        "lloyd_iterations": args.km_iter,
        "generate_and_cache_s": generate_s,
        "numpy_s_per_pass": med(runs["numpy"]),
        "ours_s_per_pass": med(runs["ours"]),
        "numpy_e2e_s": med(runs["numpy_e2e"]),
        "ours_e2e_s": med(runs["ours_e2e"]),
        "ours_init_epochs": model.result.epochs - model.params["iterations"],
        "runs": runs,
        "numpy": {"cost": kmeans_cost(X, C_np), "init": "the true blob means (the optimum)"},
        "ours": {"cost": kmeans_cost(X, model.cluster_centers), "init": "k-means||"},
    }
    if not args.skip_mllib:
        t = time.perf_counter()
        vec = assemble(df, cols).select("features").cache()
        vec.count()
        cache_s = time.perf_counter() - t

        def fit(iters):
            est = MLlibKMeans(k=args.k, maxIter=iters, tol=0.0, seed=args.seed)
            t = time.perf_counter()
            m = est.fit(vec)
            return time.perf_counter() - t, m

        marginal, amortised, fits = mllib_slope(
            lambda m: (lambda s, mod: (s, mod.summary.numIter))(*fit(m)),
            (2, 6, 10, args.km_iter),
            args.repeats,
        )
        e2e = []
        for _ in range(args.repeats):
            s, ref = fit(args.km_iter)
            e2e.append(cache_s + s)
        vec.unpersist()
        C_ref = np.array([c for c in ref.clusterCenters()])
        report["mllib"] = {
            "marginal_s_per_iteration": marginal,
            "amortised_s_per_iteration": amortised,
            "assemble_and_cache_s": cache_s,
            "e2e_s": med(e2e),
            "e2e_iterations": ref.summary.numIter,
            "cost": kmeans_cost(X, C_ref),
            "fits": fits,
        }
        print(
            f"KMeans mllib: {marginal * 1e3:.1f} ms per extra iteration, {amortised * 1e3:.1f} "
            f"ms per iteration of a {args.km_iter}-iteration fit; e2e {med(e2e):.2f} s",
            flush=True,
        )
    df.unpersist()
    return report


def _ratios(report):
    out = {}
    lr, km = report.get("lr"), report.get("kmeans")
    if lr:
        out["lr_ours_over_numpy"] = lr["ours_s_per_epoch"] / lr["numpy_s_per_epoch"]
        if "mllib" in lr:
            out["lr_mllib_marginal_over_ours"] = (
                lr["mllib"]["marginal_s_per_iteration"] / lr["ours_s_per_epoch"]
            )
            out["lr_mllib_amortised_over_ours"] = (
                lr["mllib"]["amortised_s_per_iteration"] / lr["ours_s_per_epoch"]
            )
    if km:
        out["kmeans_ours_over_numpy"] = km["ours_s_per_pass"] / km["numpy_s_per_pass"]
        if "mllib" in km:
            out["kmeans_mllib_marginal_over_ours"] = (
                km["mllib"]["marginal_s_per_iteration"] / km["ours_s_per_pass"]
            )
            out["kmeans_mllib_amortised_over_ours"] = (
                km["mllib"]["amortised_s_per_iteration"] / km["ours_s_per_pass"]
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--features", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=4.0, help="learning rate of the GD runs")
    ap.add_argument("--km-rows", type=int, default=1_000_000)
    ap.add_argument("--km-features", type=int, default=20)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--km-iter", type=int, default=20)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=("lr", "kmeans"), default=None)
    ap.add_argument("--skip-mllib", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "ml.json"))
    args = ap.parse_args()

    report = {
        "benchmark": "hybrid_iter.ml vs Spark MLlib vs numpy (issue 10)",
        "partitions": args.partitions,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    with hi.Session.local(
        parallelism=args.partitions,
        driver_memory="6g",
        spark_conf={"spark.sql.execution.arrow.pyspark.enabled": "true"},
    ) as session:
        if args.only in (None, "lr"):
            report["lr"] = bench_lr(session.spark, args)
        if args.only in (None, "kmeans"):
            report["kmeans"] = bench_kmeans(session.spark, args)
    report["ratios"] = _ratios(report)
    report["targets"] = {
        "lr_ours_over_numpy": "<= 1.15",
        "lr_mllib_over_ours": ">= 4",
        "kmeans_ours_over_numpy": "<= 1.2",
        "kmeans_mllib_over_ours": ">= 2.5",
    }
    print()
    for k, v in report["ratios"].items():
        print(f"{k:36s} {v:6.2f}x")
    lr = report.get("lr")
    if lr:
        parts = [f"ours {lr['ours']['log_loss']:.5f} / {lr['ours']['accuracy']:.4f}"]
        parts.append(f"numpy {lr['numpy']['log_loss']:.5f} / {lr['numpy']['accuracy']:.4f}")
        if "mllib" in lr:
            parts.append(f"mllib {lr['mllib']['log_loss']:.5f} / {lr['mllib']['accuracy']:.4f}")
        print("LR final log loss / accuracy: " + " | ".join(parts))
    km = report.get("kmeans")
    if km:
        parts = [f"ours {km['ours']['cost']:.6g}", f"optimum (numpy) {km['numpy']['cost']:.6g}"]
        if "mllib" in km:
            parts.append(f"mllib {km['mllib']['cost']:.6g}")
        print("KMeans final cost: " + " | ".join(parts))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
