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

from .._errors import IterationConfigError

__all__ = ["dumps"]

_OWN = {"hybrid_iter", "coordinator", "spark_ops", "storage_uri"}


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


def _user_modules(obj: Any, *, max_objects: int = 10_000) -> set[ModuleType]:
    """Modules of user-local classes and functions reachable from ``obj``: its class
    hierarchy, and what it holds (attributes, containers), walked breadth first."""
    roots = _installed_roots()
    found: set[ModuleType] = set()
    seen: set[int] = set()
    queue = [obj]
    while queue and len(seen) < max_objects:
        item = queue.pop()
        if id(item) in seen or item is None or isinstance(item, (str, bytes, int, float, bool)):
            continue
        seen.add(id(item))
        kinds = item.__mro__ if isinstance(item, type) else type(item).__mro__
        names = [k.__module__ for k in kinds]
        if callable(item) and hasattr(item, "__module__") and not isinstance(item, type):
            names.append(item.__module__)
        for name in names:
            module = sys.modules.get(name or "")
            if module is not None and _is_user_module(module, roots):
                found.add(module)
        if isinstance(item, dict):
            queue.extend(item.keys())
            queue.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            queue.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, (type, ModuleType)):
            queue.extend(vars(item).values())
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
