"""An error never hides its cause: a check that catches an exception to explain it keeps
that exception as the cause (``raise ... from ex``) and says what failed, and it decides
by what it checked (a type, a file that is there or not), never by guessing.

The lint below reads the three packages' source (no Spark, no Ray); the tests after it
raise the messages a user can meet and look at their causes. Those needing a live
Spark session take the ``spark`` fixture and are named ``test_spark_*``.
"""

from __future__ import annotations

import ast
import functools
import json
import struct
import types

import numpy as np
import pyarrow as pa
import pytest
from paths import ROOT

import coordinator
import hybrid_iter as hi

PACKAGES = ("hybrid_iter", "coordinator", "spark_ops")

#: (file, function) -> why hiding the caught exception (``from None``) is right there
HIDDEN_ON_PURPOSE: dict[tuple[str, str], str] = {
    ("hybrid_iter/ps/_client.py", "RayShards.get"): (
        "re-raises a shard's own refusal (a HybridIterError whose message says why) out "
        "of Ray's RayTaskError: the exception raised is the cause itself, and the wrapper "
        "holds only the shard's traceback of a deliberate refusal"
    ),
}


def _hides_cause(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Raise)
        and isinstance(node.cause, ast.Constant)
        and node.cause.value is None
    )


def _hidden_causes(tree: ast.AST) -> list[tuple[str, int]]:
    """``(qualified function, line)`` of each ``raise ... from None`` in an ``except``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: tuple[str, ...], in_handler: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, (*scope, child.name), False)  # a def in a handler runs later
                continue
            if in_handler and _hides_cause(child):
                found.append((".".join(scope) or "<module>", child.lineno))
            visit(child, scope, in_handler or isinstance(child, ast.ExceptHandler))

    visit(tree, (), False)
    return found


@functools.cache
def _all_hidden_causes() -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for function, line in _hidden_causes(ast.parse(path.read_text(), str(path))):
                out.setdefault((rel, function), []).append(line)
    return out


def test_an_except_that_raises_keeps_the_caught_exception_as_the_cause():
    hidden = {k: v for k, v in _all_hidden_causes().items() if k not in HIDDEN_ON_PURPOSE}
    assert not hidden, (
        "`raise ... from None` in an except handler hides what failed; chain it "
        "(`except ... as ex: raise ... from ex`), or add (file, function) to "
        "HIDDEN_ON_PURPOSE with the reason: "
        + "; ".join(f"{f}:{lines} in {fn}" for (f, fn), lines in sorted(hidden.items()))
    )


def test_every_cause_hidden_on_purpose_is_still_there_and_says_why():
    found = _all_hidden_causes()
    gone = sorted(k for k in HIDDEN_ON_PURPOSE if k not in found)
    assert not gone, f"HIDDEN_ON_PURPOSE names what no longer hides a cause: {gone}"
    for key, why in HIDDEN_ON_PURPOSE.items():
        assert len(why.split()) >= 8, f"{key}: say why hiding the cause is right"


def test_the_lint_sees_a_hidden_cause_in_a_handler_and_only_there():
    source = """
def f():
    try:
        g()
    except KeyError:
        raise ValueError("x") from None

class C:
    def m(self):
        try:
            g()
        except KeyError:
            def later():
                raise ValueError("y") from None
            return later
    def n(self):
        raise ValueError("z") from None
"""
    assert _hidden_causes(ast.parse(source)) == [("f", 6)]


# -- messages a user can meet: each keeps its cause -----------------------------------------


def _cause(info: pytest.ExceptionInfo, kind: type[BaseException]) -> BaseException:
    cause = info.value.__cause__
    assert isinstance(cause, kind), f"{info.value!r} has cause {cause!r}, not a {kind}"
    return cause


def test_config_refusals_keep_what_refused_them():
    from hybrid_iter._body import IterationBody

    with pytest.raises(hi.IterationConfigError, match="operator_lifecycle") as info:
        hi.IterationConfig(operator_lifecycle="sometimes")
    _cause(info, ValueError)
    with pytest.raises(hi.IterationConfigError, match="IterationBody") as info:
        IterationBody(partition=object(), feedback_combine="product")  # type: ignore[arg-type]
    _cause(info, ValueError)


def test_environment_that_does_not_parse_keeps_the_parse_error(monkeypatch, tmp_path):
    from hybrid_iter._cluster import placement
    from hybrid_iter._session import ray_on_spark

    monkeypatch.setenv(placement.COORDINATOR_RESOURCES_ENV, "{head: 1}")
    with pytest.raises(hi.SessionError, match=placement.COORDINATOR_RESOURCES_ENV) as info:
        placement._configured()
    _cause(info, json.JSONDecodeError)

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(hi.SessionError, match="RAY_AUTH_TOKEN_PATH") as info:
        ray_on_spark.auth_token(starting=False)
    _cause(info, FileNotFoundError)


def test_cli_refusals_keep_what_refused_them():
    from hybrid_iter.cli import CliError
    from hybrid_iter.cli._options import _pairs, _ray_address
    from hybrid_iter.cli._runner import _check_signature, load_target

    with pytest.raises(CliError, match="Ray Client address") as info:
        _ray_address("ray://head:10001", "--address")
    _cause(info, hi.SessionError)
    with pytest.raises(CliError, match="not valid JSON") as info:
        _pairs("{params", "--params")
    _cause(info, json.JSONDecodeError)
    with pytest.raises(CliError, match="has no attribute") as info:
        load_target("json:no_such_function")
    _cause(info, AttributeError)

    def job(session, steps):
        return steps

    options = types.SimpleNamespace(target="m:job", params={"step": 3})
    with pytest.raises(CliError, match=r"it takes \(session, steps\)") as info:
        _check_signature(job, options)  # type: ignore[arg-type]
    _cause(info, TypeError)


def test_ps_refusals_keep_what_refused_them():
    from coordinator._rules import make_rule
    from hybrid_iter.ps._csr import CSR
    from hybrid_iter.ps._worker import Worker

    x = CSR("items", np.array([0, 1]), np.array([7]), None, {"items": (np.array([0]), 1)})
    with pytest.raises(hi.UsageError, match="does not key table 'users'") as info:
        x.local_in("users")
    _cause(info, KeyError)
    with pytest.raises(hi.IterationConfigError, match="unknown update rule") as info:
        make_rule("lbfgs", {}, 0, np.dtype("float64"))
    _cause(info, KeyError)

    worker = Worker.__new__(Worker)
    worker.grad_fn = lambda params, batch: ("high", 0.0)
    with pytest.raises(hi.ConfigTypeError, match="mean loss as a number") as info:
        worker._call({}, {})
    _cause(info, ValueError)


def test_damaged_files_keep_what_could_not_read_them(tmp_path):
    from coordinator._checkpoint import _read_array
    from coordinator._checkpoint_header import MAGIC, TAG, _parse
    from coordinator._ps_endpoint import unpack
    from coordinator._table_io import read_meta

    header = b"{not json"
    blob = MAGIC + struct.pack("<I", len(header)) + header + bytes(TAG)
    with pytest.raises(coordinator.CheckpointDamaged, match="not readable JSON") as info:
        _parse(blob, "ck/epoch-3")
    _cause(info, ValueError)
    with pytest.raises(coordinator.CheckpointCorrupt, match="unreadable array record") as info:
        _read_array(memoryview(b"not an npy record at all"), 0, 24, "ck/epoch-3")
    _cause(info, ValueError)
    with pytest.raises(ValueError, match="truncated message") as info:
        unpack(b"\x01")
    _cause(info, struct.error)
    with pytest.raises(FileNotFoundError, match="holds no saved model") as info:
        read_meta(str(tmp_path))
    _cause(info, FileNotFoundError)


def test_results_that_do_not_fit_the_schema_keep_arrows_refusal():
    from spark_ops.full_partition._rows import _column, conform_batch
    from spark_ops.full_partition._tasks import _results

    with pytest.raises(TypeError, match="cannot hold the value 'x'") as info:
        _column(["x"], pa.field("n", pa.int64()), None)
    _cause(info, pa.ArrowException)
    batch = pa.record_batch({"n": pa.array(["x"])})
    with pytest.raises(TypeError, match="does not cast safely") as info:
        conform_batch(batch, pa.schema([("n", pa.int64())]))
    _cause(info, pa.ArrowException)
    spec = types.SimpleNamespace(op="map_partition", fn_name="'f'")
    with pytest.raises(TypeError, match="not an iterable of results") as info:
        _results(spec, lambda records: 5, iter(()))  # type: ignore[arg-type]
    _cause(info, TypeError)


# -- decisions made by what was checked, not guessed ----------------------------------------


def test_a_model_path_is_looked_at_not_guessed_from_sparks_error(tmp_path):
    """Spark's metadata there or not decides ModelExistsError / ModelNotFoundError,
    before Spark is asked (no session needed to be refused)."""
    from hybrid_iter.ml._persist import has_spark_metadata
    from hybrid_iter.ml._stages import StageModelReader, StageModelWriter

    path = str(tmp_path / "model")
    assert not has_spark_metadata(path)
    with pytest.raises(hi.ModelNotFoundError, match="Spark's metadata is missing"):
        StageModelReader(object).load(path)
    (tmp_path / "model" / "metadata").mkdir(parents=True)
    assert has_spark_metadata(path)
    with pytest.raises(hi.ModelExistsError, match=r"write\(\)\.overwrite\(\)\.save"):
        StageModelWriter(None).saveImpl(path)


def _raising(ex: BaseException):
    def parse(_text):
        raise ex

    return parse


@pytest.fixture
def spark_parse(monkeypatch):
    """Make pyspark's DDL parser raise what a test gives it (no session needed)."""
    import pyspark.sql.types

    def use(ex: BaseException) -> None:
        monkeypatch.setattr(pyspark.sql.types, "_parse_datatype_string", _raising(ex))

    return use


def _ddl_checks():
    from spark_ops import SparkOpsConfigError
    from spark_ops.full_partition import _output_schema
    from spark_ops.local_agg import _parse_type
    from spark_ops.side_inputs import SideInputConfigError
    from spark_ops.side_inputs._plan import parse_schema

    return [
        (lambda s: _output_schema(s, "map_partition"), SparkOpsConfigError),
        (lambda s: _parse_type(s, "aggregate"), SparkOpsConfigError),
        (lambda s: parse_schema(s, "map"), SideInputConfigError),
    ]


def test_a_schema_spark_refuses_is_named_with_sparks_refusal_as_the_cause(spark_parse):
    from pyspark.errors import ParseException

    spark_parse(ParseException(message="[PARSE_SYNTAX_ERROR] Syntax error at or near '!'"))
    for check, error in _ddl_checks():
        with pytest.raises(error, match="not a") as info:
            check("id long, !")
        _cause(info, ParseException)


def test_a_schema_parser_that_fails_is_not_taken_for_a_bad_schema(spark_parse):
    """No session to parse with (or a JVM gone) is that failure, not 'not a valid DDL'."""
    from pyspark.errors import PySparkRuntimeError

    spark_parse(
        PySparkRuntimeError(errorClass="SESSION_OR_CONTEXT_NOT_EXISTS", messageParameters={})
    )
    for check, _error in _ddl_checks():
        with pytest.raises(PySparkRuntimeError):
            check("id long")


class _Gone(Exception):
    """A JVM that cannot be asked."""


def test_a_hadoop_filesystem_is_not_asked_of_a_connect_client_and_a_failure_is_not_hidden():
    from spark_ops import require_spark_filesystem

    pytest.importorskip("pyspark.sql.connect.session", exc_type=ImportError)
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    client = ConnectSession.__new__(ConnectSession)  # a client: no JVM in this process
    require_spark_filesystem(client, "s3a://bucket/ck", what="work_dir", error=ValueError)

    class Context:
        @property
        def _jsc(self):
            raise _Gone("the gateway is gone")

    classic = types.SimpleNamespace(sparkContext=Context())
    with pytest.raises(_Gone):
        require_spark_filesystem(classic, "s3a://bucket/ck", what="work_dir", error=ValueError)


def test_kept_arrays_are_lost_only_when_ray_says_so(monkeypatch):
    from hybrid_iter._runtime import array_store

    stored = array_store.StoredArrays("store", ("app", 1), array_store.READ, 2)

    def no_store(name):
        raise ValueError(f"Failed to look up actor with name {name!r}")

    monkeypatch.setattr(array_store, "_handle", no_store)
    with pytest.raises(hi.StoredArraysLost, match="partition 1's arrays") as info:
        array_store.read_arrays(stored, 1)
    _cause(info, ValueError)

    class Broken:
        @property
        def refs(self):
            raise AttributeError("a bug, not a lost array")

    monkeypatch.setattr(array_store, "_handle", lambda name: Broken())
    with pytest.raises(AttributeError, match="a bug"):
        array_store.read_arrays(stored, 1)


@pytest.mark.parametrize(
    ("error", "port_advice"),
    [
        (hi.EndpointBindError("127.0.0.1:7000 is in use by another process"), True),
        (RuntimeError("the shard's actor died"), False),
    ],
)
def test_a_shard_that_cannot_serve_again_gets_port_advice_only_for_a_port(error, port_advice):
    from hybrid_iter._errors import ShardsUnavailable
    from hybrid_iter.ps._epochs import Epochs

    epochs = Epochs.__new__(Epochs)
    epochs.serving = types.SimpleNamespace(specs=[types.SimpleNamespace(bind="127.0.0.1:7000")])

    def each(method, args):
        raise error

    epochs._each = each
    with pytest.raises(ShardsUnavailable, match=type(error).__name__) as info:
        epochs._serve()
    assert ("EndpointConfig(bind=" in str(info.value)) is port_advice
    assert info.value.__cause__ is error


# -- with a live Spark session (run with the rest of the Spark tests) -----------------------


def test_spark_a_bad_ddl_schema_is_refused_with_sparks_refusal_as_the_cause(spark):
    from pyspark.errors import AnalysisException

    for check, error in _ddl_checks():
        for text, refusal in (("id long, !", AnalysisException), ("a decimal(50, 2)", Exception)):
            with pytest.raises(error, match="not a") as info:
                check(text)
            _cause(info, refusal)


def test_spark_a_sort_column_that_does_not_resolve_keeps_sparks_analysis_error(spark):
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    from spark_ops import SparkOpsConfigError
    from spark_ops.full_partition import full_window_partition

    df = spark.createDataFrame([(1, 2.0)], "k long, v double")
    with pytest.raises(SparkOpsConfigError, match="does not resolve") as info:
        full_window_partition(df).sort_partition(F.col("nope"))
    _cause(info, AnalysisException)
