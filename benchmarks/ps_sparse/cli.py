"""The run: the data and the targets, then every contender at every D in one Spark and
Ray session, then the report (JSON, figure, table, ratios, checks)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _harness import write_report

import hybrid_iter as hi

from . import __doc__ as about
from . import figures
from .config import ALL_FLIGHTS, BATCH, C_REF, FTRL, MARGIN, PARTS, TIMED_REGION
from .data import Data, Frames, hashed_flights, reference
from .mllib import jvm_alive, run_mllib
from .models import dense_spec, fm_spec, lr_spec
from .record import Run, dim_label, steps_per_epoch
from .runs import compare_with_floor, compare_with_sparse, run_numpy, run_ps, run_sgd, sweep
from .summary import checks, fmt, print_table, ratios

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run_width(
    dim: int | None,
    data: Data,
    frames: Frames,
    target: float,
    args: argparse.Namespace,
    wanted: Callable[[str], bool],
) -> Iterator[Run]:
    """Every contender at width ``dim`` (None: the raw 64-bit ids, ps_sync only), one
    after the other; MLlib last (the JVM's heap grows with D and stays grown)."""
    epochs, repeats = args.epochs, args.repeats
    floor = None
    if dim is not None and (wanted("numpy") or wanted("ps_sync")):
        run, floor = run_numpy(data, dim, epochs, repeats)
        yield run
    if dim is not None and wanted("sklearn_sgd"):
        yield run_sgd(data, dim, epochs, repeats)
    train, test = frames.ids(dim)
    kept: dict[str, Any] = {}
    if wanted("ps_sync"):
        check = compare_with_floor(floor, np.unique(data.ids(dim)), kept) if floor else None
        yield run_ps(lr_spec("sync"), dim, train, test, data, epochs, repeats, check)
    if dim is not None and wanted("ps_sync_1shard"):
        check = compare_with_floor(floor, np.unique(data.ids(dim)), {}) if floor else None
        yield run_ps(lr_spec("sync", 1), dim, train, test, data, epochs, repeats, check)
    del floor
    if dim is None:
        return
    if wanted("ps_async"):
        yield run_ps(lr_spec("async"), dim, train, test, data, epochs, repeats)
    if dim in args.dense_dims and wanted("ps_dense"):
        check = compare_with_sparse(kept)
        yield run_ps(dense_spec(dim), dim, train, test, data, epochs, repeats, check)
    fm = dim == args.fm_dim
    if fm and wanted("ps_fm"):
        yield run_ps(fm_spec(args.fm_k), dim, train, test, data, epochs, repeats)
    if not (wanted("mllib_lr") or (fm and wanted("mllib_fm"))):
        return
    from pyspark.ml.classification import FMClassifier, LogisticRegression

    vtrain, vtest = frames.vectors(dim)
    k, reg = args.fm_k, 1.0 / (C_REF * len(data.y_tr))
    common = {"dim": dim, "train": vtrain, "test": vtest, "y_te": data.y_te, "target": target}
    if fm and wanted("mllib_fm"):
        yield run_mllib(
            "mllib_fm",
            lambda it: FMClassifier(factorSize=k, maxIter=it, stepSize=0.01, seed=0),
            budget=args.budget,
            repeats=repeats,
            bytes_per_pass=(PARTS + 1) * dim * (k + 1) * 8,
            bytes_how="model: per pass, the D x (k + 1) parameters broadcast and one "
            "gradient of that size per partition",
            **common,
        )
    if wanted("mllib_lr"):
        yield run_mllib(
            "mllib_lr",
            lambda it: LogisticRegression(
                maxIter=it, regParam=reg, standardization=False, tol=1e-12
            ),
            budget=args.budget,
            repeats=repeats,
            bytes_per_pass=(PARTS + 1) * dim * 8,
            bytes_how="model: per pass, the D coefficients broadcast and one D-sized gradient "
            "per partition (a line search may take more passes)",
            **common,
        )


def arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, its defaults resolved (``--quick`` or the real run)."""
    ap = argparse.ArgumentParser(description=(about or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60,000 flights, D 2^20 and 2^26")
    ap.add_argument("--rows", type=int, default=None, help="flights (default: all)")
    ap.add_argument("--dims", default=None, help="log2 of each D (default 20,22,24,26)")
    ap.add_argument("--dense-dims", default=None, help="log2 of each D of ps_dense")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=float, default=None, help="seconds of MLlib fits per D")
    ap.add_argument("--fm-dim", type=int, default=20, help="log2 of the FM's D")
    ap.add_argument("--fm-k", type=int, default=8)
    ap.add_argument("--only", default=None, help="comma-separated contenders")
    ap.add_argument("--raw", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--sweep-rounds", type=int, default=None, help="rounds of the D sweep")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--driver-memory", default="6g")
    ap.add_argument("--out", default=str(RESULTS / "ps_sparse.json"))
    args = ap.parse_args(argv)
    quick = args.quick
    args.rows = args.rows if args.rows is not None else (60_000 if quick else None)
    args.dims = [
        1 << int(x) for x in (args.dims or ("20,26" if quick else "20,22,24,26")).split(",")
    ]
    args.dense_dims = [
        1 << int(x) for x in (args.dense_dims or ("20" if quick else "20,22")).split(",")
    ]
    args.epochs = args.epochs or (3 if quick else 5)
    args.budget = args.budget or (30.0 if quick else 150.0)
    args.raw = args.raw if args.raw is not None else not quick
    args.sweep_rounds = args.sweep_rounds or (2 if quick else 3)
    args.fm_dim = 1 << args.fm_dim
    return args


def targets(data: Data, dims: list[int], raw: bool) -> dict[str, Any]:
    """The reference at every D (each warm-started from the previous width's solution)."""
    out: dict[str, Any] = {}
    warm = None
    for dim in [*dims, *([None] if raw else [])]:
        ref = reference(data, dim, warm)
        warm = ref.pop("_warm")
        out[dim_label(dim)] = ref
        print(
            f"reference LogisticRegression at D = {dim_label(dim)}: log loss "
            f"{ref['log_loss']:.5f}, AUC {ref['auc']:.4f} ({ref['iterations']} newton-cg "
            f"iterations, {ref['seconds']:.0f} s): target {ref['target']:.5f}",
            flush=True,
        )
    return out


def _added(row: dict[str, Any]) -> None:
    print(
        f"  {row['contender']:<12} D={dim_label(row['dim']):>5}: "
        f"{fmt(row['ms_per_step'], '.2f')} ms/step, {fmt(row['ms_per_pass'], '.0f')} "
        f"ms/pass, to target {fmt(row['time_to_target_s'], '.1f')} s, best log loss "
        f"{fmt(row['best_log_loss'], '.4f')}" + (f" ERROR {row['error']}" if row["error"] else ""),
        flush=True,
    )


def contenders(
    args: argparse.Namespace, data: Data, goals: dict[str, Any], wanted: Callable[[str], bool]
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str | None]:
    """Every contender in one session: the rows, the interleaved sweep, and where the
    Spark JVM exited (None: it did not)."""
    results: list[dict[str, Any]] = []
    flat: dict[str, Any] | None = None
    with hi.Session.local(PARTS, driver_memory=args.driver_memory) as session:
        spark = session.spark
        spark.sparkContext.setLogLevel("FATAL")  # a cancelled MLlib fit logs its stack
        frames = Frames(spark, data)
        print(f"DataFrames built in {frames.seconds:.1f} s", flush=True)
        if wanted("ps_sync") and len(args.dims) > 1:
            flat = sweep(frames, data, args.dims, args.sweep_rounds)
            print(
                "ps_sync ms per step by D, interleaved: "
                + ", ".join(f"{k} {v:.2f}" for k, v in flat["ms_per_step"].items()),
                flush=True,
            )
        for dim in [*([None] if args.raw else []), *args.dims]:  # MLlib at the widest D last
            label = dim_label(dim)
            target = goals[label]["target"]
            print(f"D = {label} (target {target:.5f})", flush=True)
            for run in run_width(dim, data, frames, target, args, wanted):
                results.append(run.to_json(target))
                _added(results[-1])
            try:
                frames.release()
            except Exception:
                if jvm_alive(spark.sparkContext):
                    raise
                print("the Spark JVM exited: no more Spark contenders", flush=True)
                return results, flat, f"during the contenders at D = {label}"
    return results, flat, None


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    only = set(args.only.split(",")) if args.only else None

    def wanted(name: str) -> bool:
        return only is None or name in only

    started = time.perf_counter()
    data = hashed_flights(args.rows, args.seed)
    n_tr, n_te = len(data.y_tr), len(data.y_te)
    print(
        f"{n_tr + n_te:,} flights hashed into {len(data.fields)} ids each in {data.seconds:.1f} s "
        f"({n_tr:,} train / {n_te:,} held out); {steps_per_epoch(data)} steps per epoch",
        flush=True,
    )
    goals = targets(data, args.dims, args.raw)
    results, flat, spark_died = contenders(args, data, goals, wanted)
    report: dict[str, Any] = {
        "benchmark": "sparse parameter server on hashed flights (ps.train vs MLlib, scikit-learn, numpy)",
        "command": " ".join(["python", "benchmarks/bench_ps_sparse.py", *(argv or sys.argv[1:])]),
        "quick": args.quick,
        "config": {
            "rows": n_tr + n_te,
            "rows_all_flights_with_arr_delay": ALL_FLIGHTS,
            "rows_why": "all flights with an arrival delay"
            if args.rows is None
            else f"a seeded sample of {args.rows:,} flights (run time)",
            "train_rows": n_tr,
            "test_rows": n_te,
            "fields": data.fields,
            "dims": args.dims,
            "dense_dims": args.dense_dims,
            "fm_dim": args.fm_dim,
            "fm_k": args.fm_k,
            "raw_ids_run": args.raw,
            "epochs": args.epochs,
            "batch_rows_per_worker": BATCH,
            "workers": PARTS,
            "steps_per_epoch": steps_per_epoch(data),
            "ftrl": FTRL,
            "reference_C": C_REF,
            "target_margin": MARGIN,
            "mllib_budget_s_per_contender_and_D": args.budget,
            "repeats": args.repeats,
            "warm_up": "one untimed epoch (MLlib: a maxIter 1 fit) of each contender at each D",
            "timed_region": TIMED_REGION,
        },
        "targets": goals,
        "sweep_ps_sync_by_dim": flat,
        "spark_jvm_exited": spark_died,
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    report["ratios"] = ratios(report)
    report["checks"] = checks(report)
    out = write_report(report, args.out)
    png = figures.draw(report, out)
    print()
    print_table(results)
    print()
    for label, r in report["ratios"].items():
        print(f"D = {label}: " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in r.items()))
    print()
    for c in report["checks"]:
        state = {True: "MET", False: "MISSED", None: "not measured"}[c["met"]]
        print(f"[{state}] {c['target']}: {c['values']}")
    print(f"\nwrote {out}" + (f" and {png}" if png else "") + f" in {report['seconds']:.0f} s")
    return 0
