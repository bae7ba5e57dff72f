"""The package boundaries of DESIGN.md section 2, and lint."""

from __future__ import annotations

import ast
import subprocess
import sys
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
