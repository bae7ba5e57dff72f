"""Pickling user operators for Spark tasks and the Ray actor.

Operators are pickled once on the driver with cloudpickle. Classes from the user's own
files (a script's sibling module, a test module, a notebook's helper file) are pickled
by value, so they need not be importable on executors or in the Ray actor; classes from
installed packages (and hybrid_iter itself) are pickled by reference as usual.
"""

from __future__ import annotations

import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from ._errors import IterationConfigError

__all__ = ["dumps"]

_OWN = {"hybrid_iter", "coordinator", "spark_ops"}


def _installed_roots() -> list[Path]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            roots.add(p)
    return [Path(r).resolve() for r in roots]


def _is_user_module(module: ModuleType, roots: list[Path]) -> bool:
    name = module.__name__
    if name == "__main__" or name.split(".")[0] in _OWN:
        return False  # __main__ is by value already; our packages are installed
    file = getattr(module, "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    return not any(path.is_relative_to(r) for r in roots)


def _user_modules(objs: Any) -> set[ModuleType]:
    roots = _installed_roots()
    found: set[ModuleType] = set()
    items = objs if isinstance(objs, (list, tuple)) else [objs]
    for obj in items:
        if isinstance(obj, (list, tuple)):
            found |= _user_modules(obj)
            continue
        if obj is None:
            continue
        for cls in type(obj).__mro__:
            module = sys.modules.get(cls.__module__)
            if module is not None and _is_user_module(module, roots):
                found.add(module)
    return found


_lock = threading.Lock()


def dumps(obj: Any, what: str) -> bytes:
    """cloudpickle ``obj`` (operators), user-local modules by value."""
    import cloudpickle

    # cloudpickle's by-value registry is process-global: one caller at a time, and only
    # what this call registered is unregistered (the user's own registrations stay).
    with _lock:
        already = cloudpickle.list_registry_pickle_by_value()
        modules = {m for m in _user_modules(obj) if m.__name__ not in already}
        for m in modules:
            cloudpickle.register_pickle_by_value(m)
        try:
            return cloudpickle.dumps(obj)
        except Exception as ex:
            raise IterationConfigError(
                f"{what} cannot be pickled to ship it to the cluster: {ex}. Keep only "
                f"plain data in operators (no SparkSession, locks, open files or sockets); "
                f"build such things in open()"
            ) from ex
        finally:
            for m in modules:
                cloudpickle.unregister_pickle_by_value(m)
