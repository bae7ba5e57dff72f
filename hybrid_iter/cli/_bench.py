"""``hybrid-iter bench``: the benchmark suite of the source checkout."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .._errors import CliError


def _bench(args: argparse.Namespace) -> int:
    """``python -m benchmarks`` of the checkout in the current directory."""
    root = Path.cwd()
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise CliError(
            f"hybrid-iter bench runs the benchmarks/ directory of a source checkout, and "
            f"{str(root)!r} has none; run it from the repository root"
        )
    argv = [sys.executable, "-m", "benchmarks"]
    if args.quick:
        argv.append("--quick")
    if args.only:
        argv += ["--only", args.only]
    if args.dry_run:
        argv.append("--dry-run")
    return subprocess.run(argv, cwd=root, check=False).returncode
