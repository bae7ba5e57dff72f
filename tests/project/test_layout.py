"""The package boundaries and layers of docs/design.md, and lint."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import ROOT

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


def test_the_ci_raydp_environment_runs_every_test_marked_raydp():
    # where RayDP cannot run (the default install) the raydp tests skip: .ci/run's RayDP
    # environment is then the only place they run, selected by their marker (conftest's
    # requires_raydp), with a broken RayDP failing instead of skipping
    run = (ROOT / ".ci" / "run").read_text()
    lines = [
        ln
        for ln in run.splitlines()
        if "HYBRID_ITER_REQUIRE_RAYDP=1" in ln and ln.strip()[:1] != "#"
    ]
    assert lines and all("-m raydp" in ln or '-m "raydp' in ln for ln in lines), lines


#: exception classes allowed outside an ``_errors.py`` (module -> names), each with why
EXCEPTIONS_ELSEWHERE: dict[str, set[str]] = {}
PACKAGES = ("hybrid_iter", "coordinator", "spark_ops", "storage_uri")


def exception_classes_defined(path: Path) -> set[str]:
    """The names of the classes ``path`` defines (at any depth) that derive from
    ``BaseException``: a base is resolved in the imported module's namespace, or is one
    of the file's own exception classes."""
    import importlib

    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    namespace = vars(importlib.import_module(".".join(parts)))
    classes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
    found: set[str] = set()
    grew = True
    while grew:
        grew = False
        for node in classes:
            if node.name in found:
                continue
            for base in node.bases:
                text = ast.unparse(base)
                if text in found:
                    is_exception = True
                else:
                    try:
                        value = eval(text, dict(namespace))
                    except Exception:
                        continue
                    is_exception = isinstance(value, type) and issubclass(value, BaseException)
                if is_exception:
                    found.add(node.name)
                    grew = True
                    break
    return found


def exceptions_outside_errors_modules() -> dict[str, set[str]]:
    return {
        str(path.relative_to(ROOT)): names
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "_errors.py" and (names := exception_classes_defined(path))
    }


def test_every_exception_class_is_defined_in_an_errors_module():
    # one tree per package, drawn in its _errors.py: a class defined next to the code
    # that raises it is missing from the drawing and from the re-exports
    offenders = {
        rel: sorted(names - EXCEPTIONS_ELSEWHERE.get(rel, set()))
        for rel, names in exceptions_outside_errors_modules().items()
        if names - EXCEPTIONS_ELSEWHERE.get(rel, set())
    }
    assert not offenders, f"define these in the package's _errors.py: {offenders}"


def test_the_exception_check_sees_a_class_deriving_from_an_imported_error():
    # the check above would pass vacuously if it could not recognise one
    found = exception_classes_defined(ROOT / "coordinator" / "_errors.py")
    assert {"HybridIterError", "CutError", "NonFiniteGradient", "UserCodeFailed"} <= found
    assert "SideInputKeyError" in exception_classes_defined(
        ROOT / "spark_ops" / "side_inputs" / "_errors.py"
    )


def intra_package_imports(folder: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same folder it imports, at module level or inside a
    function (a lazy import closes a cycle as surely as an eager one)."""
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(f"{package}."):
                    deps.add(node.module[len(package) + 1 :].split(".")[0])
        graph[path.stem] = deps & {p.stem for p in folder.glob("*.py")} - {path.stem}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep] if dep in path else [node, dep]
            if dep not in state and (found := visit(dep, [*path, dep])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle_inside_ml():
    # the package's __init__ imports its modules lazily and none of them imports it back
    graph = intra_package_imports(ROOT / "hybrid_iter" / "ml", "hybrid_iter.ml")
    assert import_cycle(graph) is None, f"an import cycle in hybrid_iter/ml: {import_cycle(graph)}"


def test_the_cycle_check_finds_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None


def _module_imports(package: str, *, lazy: bool = True) -> dict[str, set[str]]:
    """Module name -> the modules of ``package`` it imports: when it is loaded, and
    (``lazy``) inside its functions too, which close a cycle as surely when they run;
    imports under ``TYPE_CHECKING`` never run and do not count."""
    base = ROOT / package
    modules = {}
    for path in base.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def loaded(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    yield from loaded(node.body)
                    yield from loaded(node.orelse)
            elif isinstance(node, ast.Try):
                yield from loaded(node.body)
                for handler in node.handlers:
                    yield from loaded(handler.body) if lazy else iter(())
                yield from loaded(node.orelse) if lazy else iter(())
            elif lazy and isinstance(
                node,
                ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.With | ast.For,
            ):
                yield from loaded(node.body)
            elif lazy and isinstance(node, ast.While):
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
    (pkg / "c.py").write_text("def f():\n    from . import d\n")  # loaded late
    (pkg / "d.py").write_text("def g():\n    if True:\n        from . import c\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _module_imports("circle")
    assert graph == {
        "circle": set(),
        "circle.a": {"circle.b"},
        "circle.b": {"circle.a"},
        "circle.c": {"circle.d"},
        "circle.d": {"circle.c"},
    }
    assert _a_cycle(graph) == ["circle.a", "circle.b", "circle.a"]
    del graph["circle.a"], graph["circle.b"]
    assert _a_cycle(graph) == ["circle.c", "circle.d", "circle.c"]  # inside functions too
    assert _module_imports("circle", lazy=False)["circle.c"] == set()


#: what may import the session (``hybrid_iter._session``): the package's own surface and
#: what runs a session for the user; everything else is below it and reads the cluster
#: context (``hybrid_iter._cluster``)
_ABOVE_THE_SESSION = ("hybrid_iter", "hybrid_iter.cli", "hybrid_iter.example")


def test_nothing_below_the_session_imports_it():
    graph = _module_imports("hybrid_iter")
    offenders = sorted(
        name
        for name, deps in graph.items()
        if any(d == "hybrid_iter._session" or d.startswith("hybrid_iter._session.") for d in deps)
        and not name.startswith("hybrid_iter._session")
        and not any(name == a or name.startswith(f"{a}.") for a in _ABOVE_THE_SESSION[1:])
        and name != "hybrid_iter"
    )
    assert offenders == [], f"below the session, yet importing it: {offenders}"


def test_the_cluster_layer_imports_nothing_above_it():
    graph = _module_imports("hybrid_iter")
    above = ("hybrid_iter._session", "hybrid_iter._runtime", "hybrid_iter.ml", "hybrid_iter.ps")
    offenders = sorted(
        (name, d)
        for name, deps in graph.items()
        if name.startswith("hybrid_iter._cluster")
        for d in deps
        if d.startswith(above)
    )
    assert offenders == [], f"the cluster layer imports what is above it: {offenders}"


#: the most lines a product file may have: beyond it, a file holds more than one concept
MAX_LINES = 800


def test_no_product_file_is_over_800_lines():
    too_long = {
        str(path.relative_to(ROOT)): n
        for package in ("hybrid_iter", "coordinator", "spark_ops", "storage_uri")
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}, f"split these by concept (at most {MAX_LINES} lines): {too_long}"


def test_every_test_folder_is_on_the_path_and_every_test_name_is_unique():
    # pytest imports a test module by its name; the folders are listed in pyproject.toml
    # so that one test module may import another's helpers from any folder
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
            "pythonpath"
        ]
    )
    tests = sorted((ROOT / "tests").rglob("test_*.py"))
    folders = {str(p.parent.relative_to(ROOT)) for p in tests}
    assert folders <= listed, f"add {sorted(folders - listed)} to pythonpath in pyproject.toml"
    names = [p.name for p in tests]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
