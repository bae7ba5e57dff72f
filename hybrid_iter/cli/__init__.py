"""The ``hybrid-iter`` command (runs on the driver).

    hybrid-iter run MODULE:FUNCTION [options]   # FUNCTION(session, **params) in a Session
    hybrid-iter bench [--quick] [--only NAMES]  # the benchmark suite (a source checkout)
    hybrid-iter version [--json]                # versions of the stack, Java included

``run`` takes each option from its flag or, when the flag is absent, from its
``HYBRID_ITER_*`` environment variable (what a pod spec or a RayJob's runtime env sets),
then the default::

    --session local|raydp        HYBRID_ITER_SESSION                  local
    --ray-address ADDR           HYBRID_ITER_RAY_ADDRESS, RAY_ADDRESS raydp: local (embedded)
    --connect-timeout-seconds S  HYBRID_ITER_CONNECT_TIMEOUT_SECONDS  raydp: 30
    --parallelism N              HYBRID_ITER_PARALLELISM              local: every core
    --executors N                HYBRID_ITER_EXECUTORS                raydp: 1
    --executor-cores N           HYBRID_ITER_EXECUTOR_CORES           raydp: 1
    --executor-memory SIZE       HYBRID_ITER_EXECUTOR_MEMORY          raydp: 1g
    --executor-wait-seconds S    HYBRID_ITER_EXECUTOR_WAIT_SECONDS    raydp: 120
    --driver-memory SIZE         HYBRID_ITER_DRIVER_MEMORY            Spark's / Session's default
    --app-name NAME              HYBRID_ITER_APP_NAME                 hybrid_iter
    --conf KEY=VALUE ...         HYBRID_ITER_SPARK_CONF               Spark properties
    --param NAME=VALUE ...       HYBRID_ITER_PARAMS                   FUNCTION's keyword arguments
    --output PATH                HYBRID_ITER_OUTPUT                   also write the result there
    --plot PATH                  HYBRID_ITER_PLOT                     PNG of the returned run(s)' loss
    --log-level LEVEL            HYBRID_ITER_LOG_LEVEL                WARNING

``--ray-address`` falls back to ``HYBRID_ITER_RAY_ADDRESS``, then to Ray's own
``RAY_ADDRESS`` (``ray job submit`` sets it for the entrypoint: a submitted job runs on the
cluster it was submitted to), then to ``local``. Ray Client (``ray://``) and dashboard
(``http://``) addresses are refused with the alternative (``ray job submit``). An
unreachable cluster, or one that wants a Ray auth token this process lacks, fails within
about ``--connect-timeout-seconds`` with the address and what to check. Before calling the
function ``run`` prints one line on stderr saying where it runs (Ray address, nodes,
executors); the result JSON carries the same under ``"where"``.

``HYBRID_ITER_SPARK_CONF`` and ``HYBRID_ITER_PARAMS`` hold a JSON object or
``KEY=VALUE`` lines; ``--conf``/``--param`` flags override single keys of them. A param
value is JSON when it parses as JSON (``20000``, ``0.5``, ``true``, ``"x"``), else a
string. Everything (values, the target's import, its parameter names) is checked before
Spark or Ray starts (``--dry-run`` stops there and prints the options). ``run`` then opens the session, calls the function, prints one line
``hybrid-iter result: {json}`` and stops what the session started, also on SIGTERM (a
pod being deleted). The current directory is importable, as with ``python -m``.

``--plot`` draws the loss per epoch and per second of what the function returned: an
``IterationResult``, a ``hybrid_iter.ml`` model, a ``ps.TrainResult``, or a dict or list of
them (on the same axes, e.g. ``{"sync": ..., "async": ...}``). Its path is checked with
the other options (a ``.png`` file in a directory this process can write, matplotlib
installed). The result line is printed whatever the plot does: with ``"plot"`` (the
file written), or with ``"plot_error"`` when there was nothing to draw or the file
could not be written, said again on stderr, and exit status 3.

``bench`` runs ``python -m benchmarks`` of the source checkout in the current directory
(the benchmarks are not installed with the package): every ``benchmarks/bench_*.py`` of
the suite, then ``benchmarks/results/suite.json`` and ``suite.png``.

Exit status: 0 done, 1 the session or the function failed, 2 bad arguments, 3 the result
was printed but ``--plot`` was not written.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

from .._errors import CliError
from ._bench import _bench
from ._options import RESULT_PREFIX, RunOptions, _parser, resolve_run_options
from ._runner import _run, load_target
from ._versions import versions

__all__ = [
    "RESULT_PREFIX",
    "CliError",
    "RunOptions",
    "load_target",
    "main",
    "resolve_run_options",
    "versions",
]

# -- entry point -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """``hybrid-iter`` (the console script); returns the exit status."""
    args = _parser().parse_args(argv)  # exits 2 with argparse's message on bad syntax
    if args.command == "version":
        found = versions()
        print(json.dumps(found) if args.json else "\n".join(f"{k} {v}" for k, v in found.items()))
        return 0
    try:
        if args.command == "bench":
            return _bench(args)
        env = os.environ if environ is None else environ
        options = resolve_run_options(args, env)
        if options.session == "local" and env.get("RAY_ADDRESS", "").strip():
            print(
                f"hybrid-iter: note: RAY_ADDRESS={env['RAY_ADDRESS'].strip()!r} is set but "
                f"--session local runs on its own embedded Ray; use --session raydp to run "
                f"on that cluster",
                file=sys.stderr,
            )
        return _run(options, dry_run=args.dry_run)
    except CliError as ex:
        print(f"hybrid-iter: error: {ex}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
