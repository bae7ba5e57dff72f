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
them (on the same axes, e.g. ``{"sync": ..., "async": ...}``).

``bench`` runs ``python -m benchmarks`` of the source checkout in the current directory
(the benchmarks are not installed with the package): every ``benchmarks/bench_*.py`` of
the suite, then ``benchmarks/results/suite.json`` and ``suite.png``.

Exit status: 0 done, 1 the session or the function failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from ._errors import HybridIterError, SessionError
from ._session import DEFAULT_CONNECT_TIMEOUT, check_ray_address

__all__ = [
    "RESULT_PREFIX",
    "CliError",
    "RunOptions",
    "load_target",
    "main",
    "resolve_run_options",
    "versions",
]

#: Prefix of the one stdout line that carries the result of ``run`` as JSON.
RESULT_PREFIX = "hybrid-iter result: "

_SESSIONS = ("local", "raydp")
_ENV_PREFIX = "HYBRID_ITER_"
# Spark's JavaUtils.byteStringAs units; no unit means MiB for executor/driver memory.
_MEMORY = re.compile(r"^([0-9]+)(b|k|kb|m|mb|g|gb|t|tb|p|pb)?$")
_MEMORY_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
# Spark refuses executor or driver memory under 1.5 x its 300 MiB reserve.
_MIN_SPARK_MEMORY = 450 << 20
_VERSION_DISTRIBUTIONS = ("hybrid-iter", "pyspark", "ray", "raydp", "numpy", "pyarrow", "pandas")

log = logging.getLogger("hybrid_iter.cli")


class CliError(HybridIterError, ValueError):
    """A bad flag or environment variable; the message names it and the fix."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Everything ``hybrid-iter run`` needs, resolved from flags, environment, defaults."""

    target: str
    session: str = "local"
    ray_address: str | None = None
    parallelism: int | None = None
    executors: int = 1
    executor_cores: int = 1
    executor_memory: str = "1g"
    executor_wait_seconds: float = 120.0
    connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT
    driver_memory: str | None = None
    app_name: str = "hybrid_iter"
    spark_conf: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    output: str | None = None
    plot: str | None = None
    log_level: str = "WARNING"


# -- parsing one value; ``where`` is the flag or the environment variable it came from --------


def _int_at_least_1(text: str, where: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise CliError(f"{where} must be an integer >= 1, got {text!r}")
    return value


def _positive_seconds(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise CliError(f"{where} must be a number of seconds > 0, got {text!r}")
    return value


def _spark_memory(text: str, where: str) -> str:
    m = _MEMORY.match(text.strip().lower())
    if m is None:
        raise CliError(
            f"{where} must be a Spark memory size such as 512m, 4g or 4096 (MiB), got {text!r}"
        )
    unit = (m.group(2) or "m")[0]
    if int(m.group(1)) * _MEMORY_UNITS[unit] < _MIN_SPARK_MEMORY:
        raise CliError(f"{where} must be at least 450m (Spark's minimum), got {text!r}")
    return text.strip().lower()


def _session_kind(text: str, where: str) -> str:
    kind = text.strip().lower()
    if kind not in _SESSIONS:
        raise CliError(
            f"{where} must be one of {', '.join(_SESSIONS)} (local: embedded Ray and Spark "
            f"local[N]; raydp: Spark on a Ray cluster), got {text!r}"
        )
    return kind


def _ray_address(text: str, where: str) -> str:
    try:
        return check_ray_address(text, where)
    except SessionError as ex:
        raise CliError(str(ex)) from None


def _non_empty(text: str, where: str) -> str:
    if not text.strip():
        raise CliError(f"{where} must not be empty")
    return text.strip()


def _log_level(text: str, where: str) -> str:
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise CliError(f"{where} must be DEBUG, INFO, WARNING or ERROR, got {text!r}")
    return level


def _output_path(text: str, where: str) -> str:
    path = Path(text).expanduser()
    if not path.parent.is_dir():
        raise CliError(f"{where}={text!r}: directory {str(path.parent)!r} does not exist")
    return str(path)


def _split_pair(item: str, where: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise CliError(f"{where} entries must be KEY=VALUE, got {item!r}")
    return key.strip(), value.strip()


def _pairs(text: str, where: str) -> dict[str, Any]:
    """A JSON object, or ``KEY=VALUE`` lines (blank lines and ``#`` comments skipped)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as ex:
            raise CliError(f"{where} is not valid JSON: {ex}") from None
        if not isinstance(value, dict):
            raise CliError(f"{where} must be a JSON object")
        return dict(value)
    pairs = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = _split_pair(line, where)
            pairs[key] = value
    return pairs


def _param_value(text: Any) -> Any:
    if not isinstance(text, str):
        return text  # from a JSON object already
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _check_spark_conf(conf: Mapping[str, Any], where: str) -> dict[str, str]:
    for key in conf:
        if not key.startswith("spark."):
            # Spark drops unknown keys silently: a typo would go unnoticed.
            raise CliError(f"{where}: {key!r} is not a Spark property (they start with 'spark.')")
    return {k: str(v) for k, v in conf.items()}


def _check_params(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in params:
        if not key.isidentifier():
            raise CliError(f"{where}: {key!r} is not a valid parameter name")
    return {k: _param_value(v) for k, v in params.items()}


# -- the option table: flag, environment variable, parser, default, which session -----------


@dataclass(frozen=True)
class _Option:
    dest: str
    flag: str
    parse: Callable[[str, str], Any]
    help: str
    sessions: tuple[str, ...] = _SESSIONS
    metavar: str | None = None

    @property
    def env(self) -> str:
        return _ENV_PREFIX + self.dest.upper()


_OPTIONS = (
    _Option("session", "--session", _session_kind, "local or raydp", metavar="KIND"),
    _Option(
        "ray_address",
        "--ray-address",
        _ray_address,
        "Ray cluster to join: host:port of its GCS, or auto on a cluster node",
        ("raydp",),
        "ADDR",
    ),
    _Option(
        "parallelism",
        "--parallelism",
        _int_at_least_1,
        "Spark local[N] task slots",
        ("local",),
        "N",
    ),
    _Option(
        "executors",
        "--executors",
        _int_at_least_1,
        "Spark executors (Ray actors)",
        ("raydp",),
        "N",
    ),
    _Option("executor_cores", "--executor-cores", _int_at_least_1, "cores each", ("raydp",), "N"),
    _Option(
        "executor_memory",
        "--executor-memory",
        _spark_memory,
        "heap each, e.g. 4g; the pod needs room for JVM and Python overhead on top",
        ("raydp",),
        "SIZE",
    ),
    _Option(
        "executor_wait_seconds",
        "--executor-wait-seconds",
        _positive_seconds,
        "how long to wait for every executor to register (autoscaling takes minutes)",
        ("raydp",),
        "S",
    ),
    _Option(
        "connect_timeout_seconds",
        "--connect-timeout-seconds",
        _positive_seconds,
        "how long to try reaching the Ray cluster before failing",
        ("raydp",),
        "S",
    ),
    _Option("driver_memory", "--driver-memory", _spark_memory, "Spark driver heap", metavar="SIZE"),
    _Option("app_name", "--app-name", _non_empty, "Spark application name", metavar="NAME"),
    _Option("output", "--output", _output_path, "also write the result JSON here", metavar="PATH"),
    _Option(
        "plot",
        "--plot",
        _output_path,
        "write a PNG of the loss per epoch and per second of the returned run(s)",
        metavar="PATH",
    ),
    _Option(
        "log_level", "--log-level", _log_level, "DEBUG, INFO, WARNING or ERROR", metavar="LEVEL"
    ),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-iter",
        description="Run hybrid_iter entry functions on a local or Spark-on-Ray session.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version_of('hybrid-iter')}"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="call MODULE:FUNCTION(session, **params) in a session",
        description=(
            "Call MODULE:FUNCTION(session, **params) in a local or Spark-on-Ray session. "
            "Each option falls back to the environment variable in brackets."
        ),
    )
    run.add_argument("target", metavar="MODULE:FUNCTION")
    for opt in _OPTIONS:
        run.add_argument(
            opt.flag, dest=opt.dest, metavar=opt.metavar, help=f"{opt.help} [{opt.env}]"
        )
    run.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark property; repeatable [HYBRID_ITER_SPARK_CONF]",
    )
    run.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a keyword argument of FUNCTION (JSON if it parses); repeatable [HYBRID_ITER_PARAMS]",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything and print the resolved options as JSON; start nothing",
    )

    bench = commands.add_parser(
        "bench",
        help="run the benchmark suite of a source checkout (python -m benchmarks)",
        description=(
            "Run the benchmark suite (benchmarks/ of the source checkout in the current "
            "directory); writes benchmarks/results/*.json and a PNG summary."
        ),
    )
    bench.add_argument(
        "--quick", action="store_true", help="reduced sizes (minutes, for a noisy machine)"
    )
    bench.add_argument(
        "--only", metavar="NAMES", help="comma-separated subset of the suite, e.g. ml,ps"
    )
    bench.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")

    version = commands.add_parser("version", help="print the versions of the stack")
    version.add_argument("--json", action="store_true", help="as one JSON object")
    return parser


def resolve_run_options(args: argparse.Namespace, environ: Mapping[str, str]) -> RunOptions:
    """Flags over environment variables over defaults; raises ``CliError`` when bad."""
    values: dict[str, Any] = {}
    explicit: dict[str, str] = {}  # dest -> flag, for options given as flags
    for opt in _OPTIONS:
        text = getattr(args, opt.dest)
        if text is not None:
            values[opt.dest] = opt.parse(text, opt.flag)
            explicit[opt.dest] = opt.flag
        elif environ.get(opt.env, "").strip():
            values[opt.dest] = opt.parse(environ[opt.env], opt.env)
    kind = values.get("session", "local")
    if kind == "raydp" and "ray_address" not in values and environ.get("RAY_ADDRESS", "").strip():
        # Ray's convention (what `ray job submit` sets), after our own variable.
        values["ray_address"] = _ray_address(environ["RAY_ADDRESS"], "RAY_ADDRESS")
    for opt in _OPTIONS:
        if opt.dest in explicit and kind not in opt.sessions:
            raise CliError(
                f"{opt.flag} applies to --session {' or '.join(opt.sessions)}, not to "
                f"--session {kind}"
                + ("; --session local uses --parallelism" if kind == "local" else "")
            )
        if opt.dest in values and kind not in opt.sessions:
            del values[opt.dest]  # set in the environment for another kind of session

    conf = _pairs(environ.get("HYBRID_ITER_SPARK_CONF", ""), "HYBRID_ITER_SPARK_CONF")
    conf.update(_split_pair(item, "--conf") for item in args.conf)
    params = _pairs(environ.get("HYBRID_ITER_PARAMS", ""), "HYBRID_ITER_PARAMS")
    params.update(_split_pair(item, "--param") for item in args.param)
    return RunOptions(
        target=_non_empty(args.target, "MODULE:FUNCTION"),
        spark_conf=_check_spark_conf(conf, "--conf/HYBRID_ITER_SPARK_CONF"),
        params=_check_params(params, "--param/HYBRID_ITER_PARAMS"),
        **values,
    )


def load_target(target: str) -> Callable[..., Any]:
    """Import ``MODULE:FUNCTION`` (``FUNCTION`` may be dotted: ``Class.method``)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(
            f"MODULE:FUNCTION must name a module and a function, e.g. "
            f"hybrid_iter.example:linear_regression, got {target!r}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as ex:
        raise CliError(
            f"cannot import module {module_name!r} of {target!r}: {ex}. Install it in the "
            f"image, or run from the directory that holds it"
        ) from ex
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"{target!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise CliError(f"{target!r} is a {type(obj).__name__}, not a function")
    return obj


def _check_signature(fn: Callable[..., Any], options: RunOptions) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: let the call decide
        return
    try:
        signature.bind(None, **options.params)
    except TypeError as ex:
        names = [p for p in signature.parameters][1:]
        raise CliError(
            f"{options.target} cannot be called as FUNCTION(session, **params) with params "
            f"{sorted(options.params)}: {ex}; it takes (session, {', '.join(names)})"
        ) from None


def _open_session(options: RunOptions) -> Any:
    from ._session import Session

    conf = dict(options.spark_conf)
    if options.session == "local":
        kwargs: dict[str, Any] = {"spark_conf": conf, "app_name": options.app_name}
        if options.driver_memory is not None:
            kwargs["driver_memory"] = options.driver_memory
        return Session.local(options.parallelism, **kwargs)
    if options.driver_memory is not None:
        conf.setdefault("spark.driver.memory", options.driver_memory)
    return Session.raydp(
        address=options.ray_address or "local",
        connect_timeout=options.connect_timeout_seconds,
        num_executors=options.executors,
        executor_cores=options.executor_cores,
        executor_memory=options.executor_memory,
        executor_wait_seconds=options.executor_wait_seconds,
        app_name=options.app_name,
        spark_conf=conf,
    )


def _jsonable(value: Any) -> Any:
    """Results as JSON: numpy values become numbers and lists, the rest ``str``."""
    from ._result import IterationResult

    if isinstance(value, IterationResult):
        return {
            "summary": value.summary(),
            "epochs": value.epochs,
            "terminated_by": value.terminated_by,
            "variables": _jsonable(dict(value.variables)),
        }
    if is_dataclass(value) and not isinstance(value, type):
        return _jsonable(asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _jsonable(value.tolist())
    return str(value)


def _plottable(value: Any) -> dict[str, Any]:
    """The training runs in what an entry function returned, by label."""
    from ._result import IterationResult

    def run_of(v: Any) -> IterationResult | None:
        if isinstance(v, IterationResult):
            return v
        inner = getattr(v, "result", None)  # hybrid_iter.ml models, ps.TrainResult
        return inner if isinstance(inner, IterationResult) else None

    single = run_of(value)
    if single is not None:
        return {single.mode: single}
    if isinstance(value, Mapping):
        pairs = [(str(k), run_of(v)) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        pairs = [(f"{r.mode} {i}", r) for i, r in enumerate(map(run_of, value)) if r is not None]
    else:
        pairs = []
    return {k: r for k, r in pairs if r is not None}


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


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    # Unwinds through the session's ``with`` block, which stops Spark and Ray.
    raise SystemExit(128 + signum)


def _run(options: RunOptions, *, dry_run: bool) -> int:
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(name)s %(message)s")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does: the user's own modules
    fn = load_target(options.target)
    _check_signature(fn, options)
    if dry_run:
        print(json.dumps({"command": "run", **_jsonable(asdict(options))}, sort_keys=True))
        return 0

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    if in_main:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        started = time.perf_counter()
        try:
            session = _open_session(options)
        except Exception as ex:  # SessionError, or Ray's own (no cluster at the address)
            print(
                f"hybrid-iter: could not start the {options.session} session: "
                f"{type(ex).__name__}: {ex}",
                file=sys.stderr,
            )
            return 1
        if in_main:  # ray.init put its own handler (exit status 15) in place of ours
            signal.signal(signal.SIGTERM, _raise_on_sigterm)
        with session:
            master = session.spark.sparkContext.master
            where = session.describe()
            print(
                f"hybrid-iter: running {options.target} on a {where['kind']} session: Ray "
                f"{where['ray_address']} ({where['ray_nodes']} node(s), head "
                f"{where['ray_head']}), Spark {where['spark_master']} with "
                f"{where['executors']} executor(s), {where['task_slots']} task slot(s)",
                file=sys.stderr,
                flush=True,
            )
            try:
                value = fn(session, **options.params)
            except Exception as ex:
                traceback.print_exc()
                print(f"hybrid-iter: {options.target} failed: {ex}", file=sys.stderr)
                return 1
        payload = {
            "target": options.target,
            "session": options.session,
            "spark_master": master,
            "where": where,
            "seconds": round(time.perf_counter() - started, 3),
            "result": _jsonable(value),
        }
        if options.plot is not None:
            runs = _plottable(value)
            if not runs:
                print(
                    f"hybrid-iter: --plot: {options.target} returned no IterationResult, "
                    f"model or ps.TrainResult to plot (got {type(value).__name__})",
                    file=sys.stderr,
                )
                return 1
            (label, first), *rest = runs.items()
            payload["plot"] = str(first.plot(options.plot, compare=dict(rest), label=label))
        text = json.dumps(payload, sort_keys=True)
        print(RESULT_PREFIX + text, flush=True)
        if options.output is not None:
            Path(options.output).write_text(text + "\n")
        return 0
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


# -- version ---------------------------------------------------------------------------------


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _java_version() -> str:
    try:
        proc = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as ex:
        return f"not usable ({ex.__class__.__name__})"
    # `java -version` prints `openjdk version "17.0.15" 2025-04-15` on stderr
    m = re.search(r'version "([^"]+)"', proc.stderr)
    return m.group(1) if m else "unknown"


def versions() -> dict[str, str]:
    """Versions of this package, Python, the engines and Java, as plain strings."""
    found = {"python": sys.version.split()[0]}
    found.update({name: _version_of(name) for name in _VERSION_DISTRIBUTIONS})
    found["java"] = _java_version()
    return found


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
