"""The benchmark suite: ``python -m benchmarks`` (or ``hybrid-iter bench``) from the
repository root.

    python -m benchmarks                     # ml, async, ps at the issue's sizes
    python -m benchmarks --quick             # reduced sizes (a few minutes)
    python -m benchmarks --only ml,ps        # a subset; any benchmarks/bench_<name>.py works
    python -m benchmarks --dry-run           # print the commands only

Each benchmark runs in its own process (its own Spark and Ray, stopped at its end) and
writes ``benchmarks/results/<name>.json``; then this writes ``results/suite.json`` (every
report, with each run's exit status and seconds) and ``results/suite.png`` (per-epoch
seconds of ours, numpy and MLlib; seconds to the target loss of sync, async and SSP with
a straggler; the parameter server's round trip by size and shard count). Exit status 1
when a benchmark failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._harness import beside, figure, write_report

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: name -> (script, arguments at the issue's sizes, arguments of --quick)
SUITE: dict[str, tuple[str, list[str], list[str]]] = {
    "ml": (
        "bench_ml.py",
        [],
        ["--rows", "200000", "--km-rows", "200000", "--repeats", "2"],
    ),
    "async": ("bench_async.py", [], ["--rows", "200000", "--repeats", "2"]),
    "ps": (
        "bench_ps.py",
        [],
        [
            "--sizes",
            "1000,100000,1000000",
            "--repeats",
            "10",
            "--train-size",
            "2000000",
        ],
    ),
    "scale": ("bench_scale.py", [], ["--quick"]),
}


def _commands(names: list[str], quick: bool) -> list[tuple[str, list[str]]]:
    out = []
    for name in names:
        script, full, reduced = SUITE.get(name, (f"bench_{name}.py", [], []))
        path = HERE / script
        if not path.is_file():
            known = sorted({*SUITE, *(p.stem[6:] for p in HERE.glob("bench_*.py"))})
            raise SystemExit(f"benchmarks: no benchmark {name!r}; known: {', '.join(known)}")
        out.append((name, [sys.executable, str(path), *(reduced if quick else full)]))
    return out


def _ml_panel(ax: Any, part: dict[str, Any] | None, unit: str, title: str) -> None:
    if not part:
        ax.set_axis_off()
        return
    bars = {"numpy": part[f"numpy_{unit}"], "hybrid_iter": part[f"ours_{unit}"]}
    mllib = part.get("mllib") or {}
    if mllib:
        bars["MLlib (marginal)"] = mllib["marginal_s_per_iteration"]
        bars["MLlib (amortised)"] = mllib["amortised_s_per_iteration"]
    ax.bar(list(bars), [v * 1e3 for v in bars.values()], color="C0")
    ax.set_title(f"{title} ({part['rows']:,} x {part['features']})")
    ax.set_ylabel("ms")


def _async_panel(ax: Any, asy: dict[str, Any] | None) -> None:
    if not (asy and asy.get("seconds_to_target")):
        ax.set_axis_off()
        return
    names = list(asy["seconds_to_target"])
    values = [asy["seconds_to_target"][n] or 0.0 for n in names]
    ax.bar(names, values, color=["C1" if n == "sync" else "C2" for n in names])
    ax.set_title(
        f"seconds to loss {asy['target_loss']:.4f}, subtask {asy['slowed_subtask']} "
        f"slowed {asy['slowdown']:g}x"
    )
    ax.set_ylabel("s")


def _ps_panel(ax: Any, ps: dict[str, Any] | None) -> None:
    if not (ps and ps.get("results")):
        ax.set_axis_off()
        return
    for shards in sorted({r["shards"] for r in ps["results"]}):
        rows = [r for r in ps["results"] if r["shards"] == shards]
        ax.plot(
            [r["size"] for r in rows],
            [r["round_trip_s"] * 1e3 for r in rows],
            marker="o",
            label=f"{shards} shard(s)",
        )
    plain = [r for r in ps["results"] if r.get("plain_actor_round_trip_s")]
    ax.plot(
        [r["size"] for r in plain],
        [r["plain_actor_round_trip_s"] * 1e3 for r in plain],
        linestyle="--",
        color="gray",
        label="plain actor (reference)",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("float64 parameters")
    ax.set_ylabel("ms")
    ax.set_title("parameter server: pull + push round trip")
    ax.legend()


def _summary_png(reports: dict[str, Any], path: Path) -> Path | None:
    ml = reports.get("ml") or {}

    def draw(axes: Any) -> None:
        _ml_panel(axes[0][0], ml.get("lr"), "s_per_epoch", "logistic regression: ms per epoch")
        _ml_panel(axes[0][1], ml.get("kmeans"), "s_per_pass", "KMeans: ms per Lloyd pass")
        _async_panel(axes[1][0], reports.get("async"))
        _ps_panel(axes[1][1], reports.get("ps"))

    return figure(path, draw, rows=2, cols=2, size=(13, 9))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced sizes")
    ap.add_argument("--only", help="comma-separated names (default: ml,async,ps)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)
    names = [n.strip() for n in (args.only or ",".join(SUITE)).split(",") if n.strip()]
    commands = _commands(names, args.quick)
    if args.dry_run:
        for name, cmd in commands:
            print(f"{name}: {' '.join(cmd)}")
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    for name, cmd in commands:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        started = time.perf_counter()
        code = subprocess.run(cmd, cwd=HERE.parent, check=False).returncode
        runs[name] = {"exit_status": code, "seconds": round(time.perf_counter() - started, 1)}
    reports = {}
    for name in runs:
        path = RESULTS / f"{name}.json"
        if path.is_file():
            reports[name] = json.loads(path.read_text())
    png = _summary_png(reports, beside(RESULTS / "suite.json"))
    suite = {"quick": args.quick, "runs": runs, "reports": reports, "png": str(png)}
    out = write_report(suite, RESULTS / "suite.json")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 1 if any(r["exit_status"] for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
