"""Benchmarks of two commits, alternating, in one run: ``before`` (any commit) against
``after`` (the work tree this file is in, or a commit).

    python benchmarks/bench_before_after.py --before 0873968 --rounds 3 \\
        --bench "bench_iteration.py --rows 200000 --epochs 10 --repeats 1 --skip-mllib" \\
        --bench "bench_ps.py --sizes 1000,100000 --shards 1,2 --repeats 5"

Each ``--bench`` runs once per round for each side, in its side's tree (a ``git
worktree`` of the commit, made here and removed at the end), with that tree first on
``PYTHONPATH``, so the benchmark, the driver, Spark's Python workers and Ray's workers
all run that commit's code; the installed packages (PySpark, Ray, numpy) are the same
for both. The sides take turns going first (round 0 before first, round 1 after first,
...), so a machine getting busier or quieter over the run weighs on both alike.

A benchmark reports what it measured in its JSON (``--out``): every number under a key
that names a median (``median``, ``median_seconds``, ``median_s``...) is a figure here,
named by its path. The report gives each figure's median over the rounds for each side
and the ratio after / before (under 1: after is faster, for a time), and writes
``results/before_after.json``: after every run, so that a run that fails (its command,
exit code and stderr are in ``failed``; the comparison ends there, exit 1) or a stop
loses nothing measured before it (``complete``, ``rounds_done``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import ratio, write_report  # noqa: E402


def medians(
    node: Any, path: str = "", inside: bool = False, keys: tuple[str, ...] = ("median",)
) -> dict[str, float]:
    """Every number under a key that names a median, by its path (``a.b.c``); ``keys``:
    the words such a key contains (a benchmark that reports its medians under keys of
    its own, ``steady_s_per_epoch``, is read with ``--figures-under s_per_epoch``). A
    list of records is read record by record, each named by its whole-number and text
    fields (``results[size=1000,shards=1].round_trip_s``); a list of numbers is a run's
    samples, not a figure."""
    found: dict[str, float] = {}
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            found.update(medians(value, where, inside or any(k in str(key) for k in keys), keys))
    elif isinstance(node, list):  # records (one per size, per shard count...)
        for i, item in enumerate(node):
            if isinstance(item, dict):  # named by their whole-number and text fields
                ids = [
                    f"{k}={v}"
                    for k, v in item.items()
                    if isinstance(v, (int, str)) and not isinstance(v, bool)
                ]
                found.update(medians(item, f"{path}[{','.join(ids) or i}]", inside, keys))
    elif inside and isinstance(node, (int, float)) and not isinstance(node, bool):
        found[path] = float(node)
    return found


def worktree(repo: Path, commit: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(into), commit],
        check=True,
    )
    return into


class RunFailed(Exception):
    """A benchmark run exited with an error (its command, exit code and stderr's end)."""


def figure_rows(got: dict[str, dict[str, dict[str, list[float]]]]) -> list[dict[str, Any]]:
    """Each figure both sides measured: its median over the rounds so far per side, and
    the ratio after / before."""
    rows = []
    for bench, sides in got.items():
        for name in sorted(set(sides.get("before", {})) & set(sides.get("after", {}))):
            b = statistics.median(sides["before"][name])
            a = statistics.median(sides["after"][name])
            rows.append(
                {
                    "bench": bench.split()[0],
                    "figure": name,
                    "before": b,
                    "after": a,
                    "ratio_after_over_before": ratio(a, b),
                    "before_runs": sides["before"][name],
                    "after_runs": sides["after"][name],
                }
            )
    return rows


def run_bench(
    tree: Path, bench: str, out: Path, timeout: float, keys: tuple[str, ...]
) -> dict[str, float]:
    script, *args = shlex.split(bench)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--out", str(out)]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=tree, env=env, timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0:
        raise RunFailed(
            f"{' '.join(cmd)} (in {tree}) exited {done.returncode} after "
            f"{time.monotonic() - started:.0f} s:\n{done.stderr[-4000:]}"
        )
    return medians(json.loads(out.read_text()), keys=keys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a commit")
    ap.add_argument("--after", default=None, help="a commit (default: this work tree)")
    ap.add_argument("--bench", action="append", required=True, help="a script and its arguments")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--figures-under",
        action="append",
        default=None,
        help="a word of the keys whose numbers are figures (default: median; repeatable)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark run")
    ap.add_argument("--out", default=str(HERE / "results" / "before_after.json"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")

    keys = tuple(args.figures_under or ["median"])
    repo = HERE.parent
    work = Path(tempfile.mkdtemp(prefix="before_after_"))
    made: list[Path] = []
    try:
        trees = {"before": worktree(repo, args.before, work / "before")}
        made.append(trees["before"])
        if args.after is None:
            trees["after"] = repo
        else:
            trees["after"] = worktree(repo, args.after, work / "after")
            made.append(trees["after"])
        # bench -> side -> figure -> one value per round
        got: dict[str, dict[str, dict[str, list[float]]]] = {}
        report: dict[str, Any] = {
            "benchmark": "before_after",
            "before": args.before,
            "after": args.after or "work tree",
            "rounds": args.rounds,
            "benches": args.bench,
            "complete": False,
            "rounds_done": 0,
            "failed": None,
            "figures": [],
        }
        try:
            for r in range(args.rounds):
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for bench in args.bench:
                    for side in order:
                        figures = run_bench(
                            trees[side], bench, work / f"{side}-{r}.json", args.timeout, keys
                        )
                        per = got.setdefault(bench, {}).setdefault(side, {})
                        for name, value in figures.items():
                            per.setdefault(name, []).append(value)
                        print(f"round {r} {side:6s} {bench}: {len(figures)} figures", flush=True)
                        # written after every run: a later run's failure (or a stop)
                        # loses nothing measured so far
                        report["figures"] = figure_rows(got)
                        write_report(report, args.out)
                report["rounds_done"] = r + 1
            report["complete"] = True
        except RunFailed as ex:
            report["failed"] = str(ex)
            print(f"a run failed; the figures so far are kept:\n{ex}", file=sys.stderr)
    finally:
        for tree in made:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)])

    rows = report["figures"] = figure_rows(got)
    width = max((len(r["figure"]) for r in rows), default=10)
    print(f"{'figure':{width}s}  {'before':>10s}  {'after':>10s}  after/before")
    for row in rows:
        rr = row["ratio_after_over_before"]
        print(
            f"{row['figure']:{width}s}  {row['before']:10.4g}  {row['after']:10.4g}  "
            f"{'-' if rr is None else f'{rr:.3f}'}   ({row['bench']})"
        )
    print(write_report(report, args.out))
    return 0 if report["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
