"""The package boundaries of DESIGN.md section 2, and lint."""

from __future__ import annotations

import ast
import shutil
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


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff not installed",
)
def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    dirs = [
        "hybrid_iter",
        "coordinator",
        "spark_ops",
        "storage_uri",
        "tests",
        "examples",
        "benchmarks",
    ]
    proc = subprocess.run([ruff, "check", *dirs], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
