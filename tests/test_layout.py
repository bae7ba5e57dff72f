"""The package boundaries of DESIGN.md section 2, and lint."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "coordinator": {"pyspark", "hybrid_iter", "spark_ops"},
    "spark_ops": {"ray", "hybrid_iter", "coordinator"},
    # the leaf the three share (storage locations): pyarrow only
    "storage_uri": {"pyspark", "ray", "hybrid_iter", "coordinator", "spark_ops"},
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_its_forbidden_neighbours(package):
    for path in (ROOT / package).rglob("*.py"):
        bad = imported_top_levels(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize(
    "package, absent",
    [
        ("coordinator", "pyspark"),
        ("spark_ops", "ray"),
        ("storage_uri", "pyspark"),
        ("storage_uri", "ray"),
    ],
)
def test_importing_a_package_does_not_load_the_other_engine(package, absent):
    code = f"import sys, {package}; print({absent!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_public_api_is_declared():
    import coordinator
    import hybrid_iter
    import spark_ops

    for module in (hybrid_iter, coordinator, spark_ops):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


#: Spark's JVM internals and the calls whose meaning differs between Spark lines: only
#: spark_ops/_spark_compat.py may touch them, so that a new Spark release is one change.
SPARK_INTERNALS = {
    "_jdf",
    "_jsc",
    "_jvm",
    "_jsparkSession",
    "_gateway",
    "_active_spark_context",
    "_collect_as_arrow",
    "queryExecution",
    "getRDDStorageInfo",
    "getPersistentRDDs",
    "setJobGroup",
    "cancelJobGroup",
    "addJobTag",
    "cancelJobsWithTag",
    "interruptTag",
}
SPARK_VERSIONED_MODULES = {"pyspark.sql.pandas.types", "py4j", "py4j.java_gateway"}
COMPAT = ROOT / "spark_ops" / "_spark_compat.py"


def spark_internals_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SPARK_INTERNALS:
            found.add(node.attr)
        elif isinstance(node, ast.Attribute) and (
            isinstance(node.value, ast.Attribute)
            and node.value.attr == "sparkContext"
            and node.attr.startswith("_")
        ):
            found.add(f"sparkContext.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in SPARK_VERSIONED_MODULES:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in SPARK_VERSIONED_MODULES}
    return found


@pytest.mark.parametrize("package", ["hybrid_iter", "spark_ops", "coordinator"])
def test_spark_internals_live_in_the_compat_module_only(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(used)
        for path in (ROOT / package).rglob("*.py")
        if path != COMPAT and (used := spark_internals_used(path))
    }
    assert not offenders, f"move these to spark_ops/_spark_compat.py: {offenders}"


def test_the_internals_check_sees_the_compat_module_itself():
    # the check above would pass vacuously if it could not recognise a use
    assert {"_jdf", "_jsc", "pyspark.sql.pandas.types"} <= spark_internals_used(COMPAT)


def test_every_test_that_needs_raydp_runs_in_the_ci_raydp_environment():
    # where RayDP cannot run (the default install) these tests skip: .ci/run's Spark 3.5
    # environment is then the only place they run
    import re

    listed = re.search(r"SPARK35_TESTS=\((.*?)\n\)", (ROOT / ".ci" / "run").read_text(), re.S)
    assert listed is not None
    entries = [
        line.strip() for line in listed.group(1).splitlines() if line.strip().startswith("tests/")
    ]
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        if "requires_raydp" not in source:
            continue
        rel = f"tests/{path.name}"
        if rel in entries:
            continue
        module = ast.parse(source)
        marked = [
            node.name
            for node in ast.walk(module)
            if isinstance(node, ast.FunctionDef)
            and any(
                isinstance(d, ast.Name) and d.id == "requires_raydp" for d in node.decorator_list
            )
        ]
        assert marked, f"{rel} uses requires_raydp module-wide: list it in .ci/run"
        for name in marked:
            assert f"{rel}::{name}" in entries, f"{rel}::{name} needs RayDP: list it in .ci/run"


def _module_imports(package: str) -> dict[str, set[str]]:
    """Module name -> the modules of ``package`` it imports when it is loaded (imports
    inside functions and under ``TYPE_CHECKING`` do not run then)."""
    base = ROOT / package
    modules = {}
    for path in base.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def loaded(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from loaded(node.body)
                yield from loaded(node.orelse)
            elif isinstance(node, ast.Try):
                yield from loaded(node.body)

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in loaded(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
                continue
            if node.level:
                parent = here[: len(here) - node.level + 1]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            # ``from . import a`` of submodules only: the package is being loaded already
            deps |= submodules or ({target} & modules.keys())
        graph[name] = deps - {name}
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for dep in sorted(graph[name]):
            cycle = visit(dep, [*path, name])
            if cycle:
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle:
            return cycle
    return None


@pytest.mark.parametrize("package", ["hybrid_iter", "coordinator"])
def test_no_import_cycle_between_modules(package):
    """A cycle makes the import order decide what is defined when (the operator API and
    the subtask runtime once imported each other)."""
    cycle = _a_cycle(_module_imports(package))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "circle"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    pass\nfrom . import a\n\nx = 1\n"
    )
    (pkg / "c.py").write_text("def f():\n    from . import a\n")  # loaded late: no edge
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _module_imports("circle")
    assert graph == {
        "circle": set(),
        "circle.a": {"circle.b"},
        "circle.b": {"circle.a"},
        "circle.c": set(),
    }
    assert _a_cycle(graph) == ["circle.a", "circle.b", "circle.a"]
