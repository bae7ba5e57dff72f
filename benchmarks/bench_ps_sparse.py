"""The sparse parameter server on hashed flights: ``ps.train`` side by side with Spark
MLlib, scikit-learn and a single-process numpy loop, in one run.

    python benchmarks/bench_ps_sparse.py            # the real run (all flights, 4 D: ~18 min)
    python benchmarks/bench_ps_sparse.py --quick    # 60,000 flights, D = 2^20, 2^26 (~4 min)
    python benchmarks/bench_ps_sparse.py --rows 150000 --dims 20,24 --out /tmp/x.json

What it measures and how: ``benchmarks/ps_sparse/__init__.py``; the code is that package.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_sparse.cli import main

if __name__ == "__main__":
    sys.exit(main())
