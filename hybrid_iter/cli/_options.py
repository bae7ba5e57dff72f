"""``hybrid-iter run``'s options: each from its flag, else its ``HYBRID_ITER_*``
environment variable, else the default; every value checked before Spark or Ray starts
(the table and the rules are in ``hybrid_iter.cli``'s docstring)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._cluster.ray_join import DEFAULT_CONNECT_TIMEOUT, check_ray_address
from .._errors import CliError, SessionError
from ._versions import _version_of

#: Prefix of the one stdout line that carries the result of ``run`` as JSON.
RESULT_PREFIX = "hybrid-iter result: "

_SESSIONS = ("local", "raydp")
_ENV_PREFIX = "HYBRID_ITER_"
# Spark's JavaUtils.byteStringAs units; no unit means MiB for executor/driver memory.
_MEMORY = re.compile(r"^([0-9]+)(b|k|kb|m|mb|g|gb|t|tb|p|pb)?$")
_MEMORY_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
# Spark refuses executor or driver memory under 1.5 x its 300 MiB reserve.
_MIN_SPARK_MEMORY = 450 << 20

log = logging.getLogger("hybrid_iter.cli")


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
        raise CliError(str(ex)) from ex


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


def _plot_path(text: str, where: str) -> str:
    """A PNG file a run can write at its end (``IterationResult.plot`` writes PNG), with
    matplotlib to draw it: checked before anything runs, not after the run."""
    path = Path(text).expanduser()
    if path.suffix.lower() != ".png":
        raise CliError(f"{where}={text!r} must name a .png file (the plot is written as PNG)")
    if not path.parent.is_dir():
        raise CliError(f"{where}={text!r}: directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise CliError(f"{where}={text!r} is a directory; name a .png file in it")
    try:  # what the run will do there (access() says yes to root even in /proc)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as ex:
        raise CliError(
            f"{where}={text!r}: cannot write in directory {str(path.parent)!r} "
            f"({ex.strerror or ex}); choose a directory you can write"
        ) from ex
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError(f"{where} needs matplotlib: pip install 'hybrid-iter[plot]'")
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
            raise CliError(f"{where} is not valid JSON: {ex}") from ex
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
        _plot_path,
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
