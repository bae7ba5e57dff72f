"""``hybrid-iter run``: import the target, open the session, call it, print and write
the result (and its plot), stop the session also on SIGTERM."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from .._errors import CliError
from ._options import RESULT_PREFIX, RunOptions

log = logging.getLogger("hybrid_iter.cli")

#: the exit status of a run whose result was printed but whose --plot was not written
PLOT_FAILED = 3


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
        except AttributeError as ex:
            raise CliError(f"{target!r}: {module_name!r} has no attribute {attr!r}") from ex
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
        ) from ex


def _open_session(options: RunOptions) -> Any:
    from .._session import Session

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
    from .._result import IterationResult

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
    from .._result import IterationResult

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


def _plot(options: RunOptions, value: Any, payload: dict[str, Any]) -> str | None:
    """Draw what the function returned to ``options.plot`` (its path under ``"plot"`` of
    ``payload``); why not, if it could not (also under ``"plot_error"``)."""
    try:
        runs = _plottable(value)
        if runs:
            (label, first), *rest = runs.items()
            payload["plot"] = str(first.plot(options.plot, compare=dict(rest), label=label))
            return None
        why = (
            f"{options.target} returned no IterationResult, model or ps.TrainResult to "
            f"plot (got {type(value).__name__}); nothing was written to {options.plot}"
        )
    except Exception as ex:  # matplotlib's or the file system's: said after the result
        why = f"could not write {options.plot}: {type(ex).__name__}: {ex}"
    payload["plot_error"] = why
    return why


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
        plot_failed: str | None = None
        try:
            if options.plot is not None:
                plot_failed = _plot(options, value, payload)
        finally:  # the result is printed whatever the plot did
            text = json.dumps(payload, sort_keys=True)
            print(RESULT_PREFIX + text, flush=True)
            if options.output is not None:
                Path(options.output).write_text(text + "\n")
        if plot_failed is not None:
            print(f"hybrid-iter: --plot: {plot_failed}", file=sys.stderr)
            return PLOT_FAILED
        return 0
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
