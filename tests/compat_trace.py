"""Which functions of ``spark_ops/_spark_compat.py`` this process ran.

``install()`` replaces every function and method the module defines by a wrapper that
notes its name when called, and rebinds the names other modules imported from it (``from
spark_ops._spark_compat import JobTag``), so that a call through any path is seen. It
changes no result: the wrapper calls the function and returns what it returns. The
suite installs it in every process it starts (``conftest.py``, ``fresh_process.py``:
set ``HYBRID_ITER_COMPAT_TRACE`` to a file and the names are appended to it at exit),
and ``test_spark_lines.py`` checks at the end of the compatibility set that every
function ran in this environment, but those that only run on some lines.
"""

from __future__ import annotations

import ast
import atexit
import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the environment variable naming the file a fresh process appends its names to
TRACE_ENV = "HYBRID_ITER_COMPAT_TRACE"

_seen: set[str] = set()
_installed = False


def _record(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _seen.add(name)
        return fn(*args, **kwargs)

    traced._compat_traced = True  # type: ignore[attr-defined]
    return traced


def defined() -> set[str]:
    """Every function and method ``_spark_compat.py`` defines (``JobTag.cancel`` for a
    method), read off its source."""
    from spark_ops import _spark_compat

    tree = ast.parse(Path(_spark_compat.__file__).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(f"{node.name}.{item.name}")
    return names


def install() -> None:
    """Trace the module's functions in this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    from spark_ops import _spark_compat as compat

    originals: dict[int, Callable[..., Any]] = {}
    for name in defined():
        if "." in name:
            cls_name, attr = name.split(".")
            cls = getattr(compat, cls_name)
            raw = inspect.getattr_static(cls, attr)
            if isinstance(raw, (staticmethod, classmethod)):
                setattr(cls, attr, type(raw)(_record(name, raw.__func__)))
            else:
                setattr(cls, attr, _record(name, raw))
            continue
        fn = getattr(compat, name)
        traced = _record(name, fn)
        if hasattr(fn, "cache_clear"):  # functools.cache: keep its interface
            traced.cache_clear = fn.cache_clear  # type: ignore[attr-defined]
        originals[id(fn)] = traced
        setattr(compat, name, traced)
    # names bound by ``from spark_ops._spark_compat import f`` before this ran
    for module in list(sys.modules.values()):
        where = getattr(module, "__name__", "") or ""
        if not where.startswith(("hybrid_iter", "spark_ops", "coordinator")):
            continue
        for attr, value in list(vars(module).items()):
            traced = originals.get(id(value))
            if traced is not None and module is not compat:
                setattr(module, attr, traced)
    path = os.environ.get(TRACE_ENV)
    if path:
        atexit.register(_append, path)


def _append(path: str) -> None:
    with open(path, "a") as f:
        for name in sorted(_seen):
            f.write(name + "\n")


def seen(trace_file: str | None = None) -> set[str]:
    """The names this process ran, and those fresh processes appended to ``trace_file``."""
    names = set(_seen)
    if trace_file and os.path.exists(trace_file):
        names |= {line.strip() for line in Path(trace_file).read_text().splitlines()}
    return names - {""}
