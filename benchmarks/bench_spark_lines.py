"""The Spark lines side by side: bench_iteration.py and bench_ml.py on Spark 4 (the
default install) and on Spark 3.5 (the raydp extra's install), on the same machine, the
same generated data (fixed seeds), the same arguments.

    python benchmarks/bench_spark_lines.py                       # the two venvs of .ci/run
    python benchmarks/bench_spark_lines.py --spark4-python .venv/bin/python \\
        --spark35-python .venv35/bin/python --iteration-args "--rows 200000"

Each benchmark runs as a subprocess of each environment's Python, one after the other
(3.5, then 4, per benchmark: the machine's noise falls on both alike), each writing its
own JSON; this script then prints each line's figures and the ratio Spark 4 / Spark 3.5
(below 1: Spark 4 faster) and writes benchmarks/results/spark_lines.json with both
reports and the ratios.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _harness import ratio, write_report  # noqa: E402

#: the figures compared: (benchmark, path in its JSON, label)
ITERATION_FIGURES = [
    (("steady_s_per_epoch", "sync"), "sync epoch, steady (s)"),
    (("end_to_end_s_per_epoch", "sync"), "sync epoch, end to end (s)"),
    (("steady_s_per_epoch", "empty"), "empty-body epoch, steady (s)"),
    (("end_to_end_s_per_epoch", "empty"), "empty-body epoch, end to end (s)"),
    (("steady_s_per_epoch", "spark_job"), "one Spark job (s)"),
    (("steady_s_per_epoch", "numpy"), "numpy epoch (s)"),
    (("steady_s_per_epoch", "mllib"), "MLlib iteration, marginal (s)"),
    # the fastest repeat: on a shared machine the least disturbed one
    (("best_steady_s_per_epoch", "sync"), "sync epoch, steady, best repeat (s)"),
    (("best_steady_s_per_epoch", "empty"), "empty-body epoch, steady, best repeat (s)"),
]


def _with_best(report: dict) -> dict:
    """bench_iteration's report plus each contender's fastest steady repeat."""
    runs = report.get("runs") or {}
    best = {k: min(r["steady"] for r in v) for k, v in runs.items() if v}
    return {**report, "best_steady_s_per_epoch": best}


def _get(report: dict, path: tuple[str, ...]) -> Any:
    node: Any = report
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _ml_figures(report: dict) -> list[tuple[tuple[str, ...], str]]:
    """Every task's median seconds per system, and ours over MLlib."""
    found = []
    for dataset, tasks in (report.get("datasets") or {}).items():
        for task, r in tasks.items():
            for system in r.get("median_s", {}):
                found.append(
                    (
                        ("datasets", dataset, task, "median_s", system),
                        f"{dataset} {task}: {system} (s)",
                    )
                )
            if "ours_over_mllib" in r:
                found.append(
                    (
                        ("datasets", dataset, task, "ours_over_mllib"),
                        f"{dataset} {task}: ours / MLlib",
                    )
                )
    return found


def _version(python: str) -> dict[str, str]:
    code = (
        "import json, sys, pyspark, ray; from importlib import metadata\n"
        "def v(d):\n"
        "    try: return metadata.version(d)\n"
        "    except metadata.PackageNotFoundError: return None\n"
        "print(json.dumps({'pyspark': pyspark.__version__, 'ray': ray.__version__, "
        "'raydp': v('raydp'), 'python': sys.version.split()[0]}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(python: str, script: str, args: list[str], out: Path, log: Path) -> tuple[dict, float]:
    cmd = [python, str(HERE / script), *args, "--out", str(out)]
    print(f"$ {shlex.join(cmd)}", flush=True)
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed on {python} (exit {proc.returncode}); log: {log}")
    return json.loads(out.read_text()), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spark4-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--spark35-python", default=str(ROOT / ".venv35" / "bin" / "python"))
    ap.add_argument("--iteration-args", default="", help="arguments for bench_iteration.py")
    ap.add_argument("--ml-args", default="", help="arguments for bench_ml.py")
    ap.add_argument("--skip", choices=("iteration", "ml"), action="append", default=[])
    ap.add_argument("--out", default=str(HERE / "results" / "spark_lines.json"))
    args = ap.parse_args()

    lines = {"spark35": args.spark35_python, "spark4": args.spark4_python}
    versions = {name: _version(py) for name, py in lines.items()}
    for name, v in versions.items():
        print(f"{name}: PySpark {v['pyspark']}, Ray {v['ray']}, RayDP {v['raydp']}", flush=True)
    benchmarks = [
        ("iteration", "bench_iteration.py", shlex.split(args.iteration_args)),
        ("ml", "bench_ml.py", shlex.split(args.ml_args)),
    ]
    report: dict[str, Any] = {
        "benchmark": "the Spark lines side by side (bench_iteration.py, bench_ml.py)",
        "versions": versions,
        "ratio": "Spark 4 / Spark 3.5 (below 1: Spark 4 faster)",
        "runs": {},
        "figures": {},
    }
    work = Path(tempfile.mkdtemp(prefix="bench_spark_lines_"))
    for bench, script, extra in benchmarks:
        if bench in args.skip:
            continue
        results = {}
        for name, python in lines.items():
            out, log = work / f"{bench}-{name}.json", work / f"{bench}-{name}.log"
            results[name], seconds = _run(python, script, extra, out, log)
            if bench == "iteration":
                results[name] = _with_best(results[name])
            report["runs"][f"{bench}/{name}"] = {"args": extra, "wall_s": round(seconds, 1)}
        report[bench] = results
        figures = ITERATION_FIGURES if bench == "iteration" else _ml_figures(results["spark35"])
        rows = []
        for path, label in figures:
            a, b = _get(results["spark4"], path), _get(results["spark35"], path)
            rows.append(
                {"figure": label, "spark35": b, "spark4": a, "spark4_over_spark35": ratio(a, b)}
            )
        report["figures"][bench] = rows
        print(f"\n{bench}:\n  {'figure':44s} {'3.5':>10s} {'4.x':>10s} {'4/3.5':>7s}")
        for r in rows:
            cells = [
                f"{v:10.4f}" if isinstance(v, (int, float)) else f"{'-':>10s}"
                for v in (r["spark35"], r["spark4"])
            ]
            q = r["spark4_over_spark35"]
            print(f"  {r['figure']:44s} {' '.join(cells)} " + (f"{q:7.2f}" if q else f"{'-':>7s}"))
    out = write_report(report, args.out)
    print(f"\nwrote {out} (logs in {work})")


if __name__ == "__main__":
    sys.exit(main())
