"""What differs between the Spark lines this project runs on, and every use of Spark's
JVM internals, in one place (driver side unless a function says otherwise).

Supported: the 3.5 line (what RayDP 1.6.5 runs on) and 4.0 to 4.3. A new Spark release
is a change here: its version in ``SUPPORTED``, and whatever below reads the JVM
differently. What differs is detected by what this PySpark offers (a keyword in a
signature, an attribute, a JVM class), never guessed from the version number: only the
supported lines and RayDP's requirements are decided by version. Every function here is
run in every CI environment that can reach it (``tests/spark_lines/``, which fails when
one is run by none). Nothing else in ``hybrid_iter`` or ``spark_ops`` touches ``_jdf``,
``_jsc``, ``_jvm``, the py4j gateway, query plans or RDD storage info
(``tests/project/test_layout.py`` checks it).

* Versions: ``spark_version()``, ``check_spark_version()`` (an unsupported Spark is an
  ``UnsupportedSparkVersion`` naming it and the fix), ``raydp_problem()`` (why RayDP
  cannot run here, or None), ``dataframe_barrier_paths(spark)`` (whether the barrier
  stage's streams can be routed by DataFrame operations alone: ``repartitionById``).
* Sessions: ``is_connect(spark)`` (a Spark Connect client has no JVM in this process).
* Jobs: ``JobTag`` tags the Spark jobs a thread starts and cancels them from any thread:
  ``SparkContext`` job tags on classic Spark (3.5 and 4.x; they also reach RDD jobs),
  session tags (``addTag`` / ``interruptTag``) on Spark Connect.
* Types: ``to_arrow_schema`` / ``to_arrow_type`` (``TimestampType`` as UTC, by the keyword
  each line takes), ``python_binary_type`` (``bytes`` or ``bytearray``),
  ``observed_metrics`` (a streaming progress' observed metrics: dicts on 3.5, ``Row``s
  on 4.x), ``collect_arrow``, ``ddl_refusals`` (what a schema string Spark refuses
  raises).
* JVM internals: task slots, planned partition counts, cached relations and persisted
  RDDs, RDD storage sizes, a streaming file source's options, executor hosts, the
  process' JVM (a running SparkContext, a class on its classpath, its pid).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._errors import UnsupportedSparkVersion

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "SUPPORTED",
    "JobTag",
    "check_spark_version",
    "spark_version",
]

#: (major, minor) lines supported; a patch release of one of them is supported.
SUPPORTED: tuple[tuple[int, int], ...] = ((3, 5), (4, 0), (4, 1), (4, 2), (4, 3))
#: RayDP releases Session.raydp runs on: [low, high), and the Spark line they need.
RAYDP_RANGE = ((1, 6, 5), (1, 7))
RAYDP_SPARK = (3, 5)
RAYDP_INSTALL = "pip install 'hybrid-iter[raydp]'"
_SPARK_INSTALL = "pip install 'pyspark>=3.5,<4.4'"


def _parse(version: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return (0, 0, 0)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


@functools.cache
def spark_version_string() -> str:
    """The PySpark version of this process (``pyspark.__version__``)."""
    from pyspark.version import __version__

    return str(__version__)


def spark_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the PySpark of this process."""
    return _parse(spark_version_string())


def _lines() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)


def check_spark_version(version: str | None = None) -> None:
    """Raise ``UnsupportedSparkVersion`` unless ``version`` (default: this process'
    PySpark) is on a supported line."""
    text = spark_version_string() if version is None else version
    if _parse(text)[:2] in SUPPORTED:
        return
    raise UnsupportedSparkVersion(
        f"PySpark {text} is not supported: hybrid_iter runs on Spark {_lines()}; install "
        f"a supported one ({_SPARK_INSTALL}, or {RAYDP_INSTALL} for Spark on Ray)"
    )


def raydp_problem() -> str | None:
    """Why ``Session.raydp`` cannot run in this process (RayDP missing, a RayDP outside
    the supported releases, or a Spark line RayDP does not run on), or None. Reads the
    installed distributions only: RayDP is not imported."""
    try:
        found: str | None = importlib.metadata.version("raydp")
    except importlib.metadata.PackageNotFoundError:
        found = None
    return raydp_problem_of(found, spark_version_string())


def raydp_problem_of(raydp: str | None, spark: str) -> str | None:
    """``raydp_problem`` for RayDP version ``raydp`` (None: not installed) beside PySpark
    ``spark``."""
    if raydp is None:
        return f"Session.raydp needs RayDP, which is not installed: {RAYDP_INSTALL}"
    low, high = RAYDP_RANGE
    if not low <= _parse(raydp) < (*high, 0):
        return (
            f"Session.raydp runs on RayDP >= {'.'.join(map(str, low))}, < "
            f"{'.'.join(map(str, high))}, but RayDP {raydp} is installed: {RAYDP_INSTALL}"
        )
    if _parse(spark)[:2] != RAYDP_SPARK:
        return (
            f"RayDP {raydp} runs Spark {RAYDP_SPARK[0]}.{RAYDP_SPARK[1]} only, but this "
            f"environment has PySpark {spark}; install the raydp extra in its own "
            f"environment ({RAYDP_INSTALL}, which selects Spark 3.5), or run on Spark "
            f"{spark} with Session.local, Session.on_spark or Session.attach"
        )
    return None


def dataframe_barrier_paths(spark: Any) -> bool:
    """Whether the barrier stage's multi-stream and replay paths can run through
    DataFrame operations: whether ``spark``'s DataFrames offer ``repartitionById``
    (PySpark >= 4.1, classic and Connect) rather than only RDDs."""
    if is_connect(spark):
        from pyspark.sql.connect.dataframe import DataFrame as ConnectFrame

        return hasattr(ConnectFrame, "repartitionById")
    from pyspark.sql import DataFrame

    return hasattr(DataFrame, "repartitionById")


# -- sessions ------------------------------------------------------------------------------


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect client session (no JVM in this process)."""
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError:  # Connect's client dependencies are not installed: not one
        return False
    return isinstance(spark, ConnectSession)


def is_session(spark: Any) -> bool:
    """A classic or a Spark Connect ``SparkSession``."""
    from pyspark.sql import SparkSession

    return isinstance(spark, SparkSession) or is_connect(spark)


def connect_endpoint(spark: Any) -> str:
    """``sc://host:port`` of the server a Spark Connect client session talks to (no call)."""
    builder = spark.client._builder
    return f"sc://{builder.endpoint}"


def spark_master(spark: Any) -> str:
    """What the session runs on: the master of a classic session; for a Spark Connect
    client, ``sc://host:port`` of its server (no server call, so it works on a stopped
    client too)."""
    if is_connect(spark):
        return connect_endpoint(spark)
    return str(spark.sparkContext.master)


# -- jobs ----------------------------------------------------------------------------------


class JobTag:
    """One tag on the Spark jobs a thread starts, to cancel them from another thread.

    ``with tag.on_this_thread(): ...`` tags every job the block starts (and asks Spark
    to interrupt their task threads on cancel); ``tag.cancel()`` (any thread) cancels
    the tagged jobs still running. Classic Spark: ``SparkContext`` job tags (3.5 and
    4.x), which reach RDD jobs as well as DataFrame ones. Spark Connect: the session's
    operation tags (``addTag`` / ``interruptTag``).
    """

    def __init__(self, spark: Any, tag: str) -> None:
        if not tag:
            raise ValueError("a Spark job tag must not be empty")
        self.spark = spark
        self.tag = tag.replace(",", "_")  # Spark refuses commas in tags
        self._connect = is_connect(spark)

    @contextmanager
    def on_this_thread(self, description: str | None = None) -> Iterator[None]:
        if self._connect:
            self.spark.addTag(self.tag)
            try:
                yield
            finally:
                self.spark.removeTag(self.tag)
            return
        sc = self.spark.sparkContext
        keys = ("spark.job.interruptOnCancel", "spark.job.description")
        saved = {k: sc.getLocalProperty(k) for k in keys}
        sc.addJobTag(self.tag)
        sc.setInterruptOnCancel(True)
        if description is not None:
            sc.setJobDescription(description)
        try:
            yield
        finally:
            sc.removeJobTag(self.tag)
            for key, value in saved.items():
                sc.setLocalProperty(key, value)

    def cancel(self) -> None:
        if self._connect:
            self.spark.interruptTag(self.tag)
        else:
            self.spark.sparkContext.cancelJobsWithTag(self.tag)


# -- types ---------------------------------------------------------------------------------


@functools.cache
def _utc_timestamps() -> dict[str, Any]:
    """The keyword PySpark's ``to_arrow_type`` / ``to_arrow_schema`` take to give
    ``TimestampType`` as UTC, read off their signature: ``timezone`` (PySpark >= 4.2),
    ``timestamp_utc`` (4.0 and 4.1, UTC by default but said here), none (3.5, always
    UTC)."""
    import inspect

    from pyspark.sql.pandas.types import to_arrow_type as convert

    params = inspect.signature(convert).parameters
    if "timezone" in params:
        return {"timezone": "UTC"}
    if "timestamp_utc" in params:
        return {"timestamp_utc": True}
    return {}


def to_arrow_schema(struct: Any) -> pa.Schema:
    """The Arrow schema Spark exchanges ``struct`` with Python as; ``TimestampType`` as
    UTC microseconds on every line (``_utc_timestamps``)."""
    from pyspark.sql.pandas.types import to_arrow_schema as convert

    return convert(struct, **_utc_timestamps())


def to_arrow_type(data_type: Any) -> pa.DataType:
    """The Arrow type of one Spark data type (``TimestampType``: UTC, as above)."""
    from pyspark.sql.pandas.types import to_arrow_type as convert

    return convert(data_type, **_utc_timestamps())


def from_arrow_schema(schema: pa.Schema) -> Any:
    """The Spark ``StructType`` of an Arrow schema (a time-zone-less timestamp is
    ``TimestampNTZType`` on every line)."""
    from pyspark.sql.pandas.types import from_arrow_schema as convert

    return convert(schema, prefer_timestamp_ntz=True)


@functools.cache
def ddl_refusals() -> tuple[type[BaseException], ...]:
    """What PySpark raises for a schema or type string Spark refuses
    (``_parse_datatype_string``), classic and Connect: its parser's ``ParseException``
    (an ``AnalysisException``), a type it cannot make (a decimal's precision:
    ``ArithmeticException``; an argument out of range: ``IllegalArgumentException``),
    and, classic only, any other Java exception the JVM threw parsing it (an unsupported
    precision or collation), which PySpark leaves a ``Py4JJavaError``. Not in it: no
    session to parse with, a JVM or server that cannot be reached. The pyspark.errors
    classes are taken where this PySpark has them."""
    import pyspark.errors
    from py4j.protocol import Py4JJavaError

    names = ("AnalysisException", "ArithmeticException", "IllegalArgumentException")
    found = [getattr(pyspark.errors, name, None) for name in names]
    return (*(t for t in found if isinstance(t, type)), Py4JJavaError)


@functools.cache
def python_binary_type() -> type:
    """What ``df.collect()`` gives a ``BinaryType`` value as (driver and tasks): ``bytes``
    where PySpark's Arrow-to-rows conversion takes ``binary_as_bytes`` and defaults it to
    true (4.1 on: ``spark.sql.execution.pyspark.binaryAsBytes``; a session that turns
    it off is not followed), ``bytearray`` where it has no such keyword (3.5, 4.0)."""
    import inspect

    try:
        from pyspark.sql.conversion import ArrowTableToRowsConversion
    except ImportError:  # PySpark 3.5 has no such module: Rows carry bytearray
        return bytearray
    param = inspect.signature(ArrowTableToRowsConversion.convert).parameters.get("binary_as_bytes")
    return bytes if param is not None and param.default is True else bytearray


def observed_metrics(progress: Any, name: str) -> dict[str, Any] | None:
    """The observed metrics ``name`` of a streaming progress (a ``StreamingQuery``'s
    ``lastProgress``, or its dict) as a plain dict; None when absent or empty. Spark 3.5
    gives dicts, 4.x ``Row``s."""
    if progress is None:
        return None
    observed = progress.get("observedMetrics") if hasattr(progress, "get") else None
    if not observed:
        return None
    metrics = observed.get(name)
    if not metrics:
        return None
    if hasattr(metrics, "asDict"):
        return dict(metrics.asDict())
    return dict(metrics)


def collect_arrow(df: DataFrame) -> pa.Table:
    """Run ``df`` and return its rows as one Arrow table (Arrow all the way, no Rows)."""
    import pyarrow as pa

    frame: Any = df  # typed by whichever PySpark is installed
    if hasattr(frame, "toArrow"):  # PySpark >= 4.0, classic and Connect
        return frame.toArrow()
    batches = frame._collect_as_arrow()
    if batches:
        return pa.Table.from_batches(batches)
    from pyspark.sql.pandas.types import to_arrow_schema as convert

    return convert(df.schema).empty_table()


# -- JVM internals (classic Spark only) ----------------------------------------------------


def _jsc(spark: SparkSession) -> Any:
    if is_connect(spark):
        raise UnsupportedSparkVersion(
            "this step reads the Spark driver's JVM, which a Spark Connect client "
            "session does not have; use a classic SparkSession"
        )
    return spark.sparkContext._jsc


def connect_task_slots(spark: Any) -> int | None:
    """The task slots of a Spark Connect server's application as its configuration
    states them (one configuration read, no job): ``local[N]`` -> N, else
    ``spark.executor.instances`` x ``spark.executor.cores`` / ``spark.task.cpus`` when
    all are set. None when the configuration does not say (``local[*]``, dynamic
    allocation, executors sized by the cluster manager): a client cannot list executors."""
    conf = spark.conf
    master = str(conf.get("spark.master", None) or "")
    if master == "local":
        return 1
    if master.startswith("local[") and master.endswith("]"):
        inner = master[len("local[") : -1].split(",")[0]
        return int(inner) if inner.isdigit() else None
    instances = conf.get("spark.executor.instances", None)
    cores = conf.get("spark.executor.cores", None)
    task_cpus = conf.get("spark.task.cpus", None) or "1"
    dynamic = str(conf.get("spark.dynamicAllocation.enabled", None) or "false").lower()
    if dynamic == "true" or not instances or not cores:
        return None
    try:
        return int(instances) * int(cores) // max(1, int(task_cpus))
    except ValueError:
        return None


def available_task_slots(spark: SparkSession) -> int:
    """How many tasks can run at once right now (what a barrier stage may use). A Spark
    Connect client sees only what the server's configuration says (``connect_task_slots``);
    when it says nothing, the caller must be told the subtask count."""
    if is_connect(spark):
        slots = connect_task_slots(spark)
        if slots is None:
            raise UnsupportedSparkVersion(
                f"a Spark Connect client cannot see the task slots of the server "
                f"{connect_endpoint(spark)} (its spark.master and spark.executor.instances "
                f"x spark.executor.cores do not state them): pass the number of subtasks, "
                f"IterationConfig(parallelism=N) or the estimator's parallelism=N, at most "
                f"the cluster's free task slots"
            )
        return slots
    jsc = _jsc(spark).sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def executor_hosts(spark: SparkSession) -> tuple[list[str], int]:
    """(the hosts of the driver and every executor, sorted; the executor count)."""
    sc = _jsc(spark).sc()
    infos = sc.statusTracker().getExecutorInfos()  # the driver is one of them
    return sorted(str(e.host()) for e in infos), int(sc.getExecutorIds().size())


def executor_statuses(spark: SparkSession) -> list[tuple[str, str, int, int]]:
    """The live executors, the driver left out, from Spark's status store: (id, host,
    cores, tasks running now) each."""
    summaries = _jsc(spark).sc().statusStore().executorList(True)
    found = []
    for i in range(summaries.size()):
        s = summaries.apply(i)
        if str(s.id()) == "driver":
            continue
        host = str(s.hostPort()).rsplit(":", 1)[0].strip("[]")
        found.append((str(s.id()), host, int(s.totalCores()), int(s.activeTasks())))
    return found


def make_active_session(spark: SparkSession) -> None:
    """Make ``spark`` the JVM's active SparkSession on this thread."""
    _jsc(spark)  # a classic session (a Connect one is refused, naming why)
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a started classic SparkContext has its gateway
    jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)


def _executed_plan(df: DataFrame) -> Any:
    return df._jdf.queryExecution().executedPlan()


def rdd_num_partitions(df: DataFrame) -> int:
    """The partition count of ``df``'s RDD. Under adaptive execution with a shuffle this
    runs the shuffle-map stages first."""
    return int(df._jdf.rdd().getNumPartitions())


def exact_num_partitions(df: DataFrame) -> int | None:
    """The partition count ``df``'s tasks will have when the plan tells it without a
    Spark job (no adaptive shuffle still to run), else None (always for a Spark Connect
    client, which has no plan objects)."""
    if is_connect(df.sparkSession):
        return None
    try:  # a scan of a cached relation as it is (``cached_relation``): no planning
        scan = _cache_scan(df._jdf.queryExecution().analyzed())
    except Exception:  # a plan shape this Spark version builds differently
        scan = None
    if scan is not None:
        return int(scan[0].cacheBuilder().cachedColumnBuffers().getNumPartitions())
    plan = _executed_plan(df)
    if plan.getClass().getSimpleName() != "AdaptiveSparkPlanExec":
        return rdd_num_partitions(df)
    if plan.isFinalPlan():  # already executed: its RDD exists
        return int(plan.execute().getNumPartitions())
    return None


def planned_num_partitions(df: DataFrame) -> int | None:
    """The partition count of the adaptive plan's input partitioning (exact for
    ``repartition(n)``, the planned count for a shuffle Spark inserted), None when the
    plan does not know it (``UnknownPartitioning``) or is out of reach (Spark Connect)."""
    if is_connect(df.sparkSession):
        return None
    plan = _executed_plan(df)
    if plan.getClass().getSimpleName() != "AdaptiveSparkPlanExec":
        return rdd_num_partitions(df)
    partitioning = plan.inputPlan().outputPartitioning()
    if partitioning.getClass().getSimpleName() == "UnknownPartitioning":
        return None
    return int(partitioning.numPartitions())


def rdd_storage(spark: SparkSession, rdd_id: int) -> tuple[int, int]:
    """(bytes in memory, bytes on disk) of persisted RDD ``rdd_id``; (0, 0) if unknown."""
    for info in _jsc(spark).sc().getRDDStorageInfo():
        if info.id() == rdd_id:
            return int(info.memSize()), int(info.diskSize())
    return 0, 0


def persisted_rdd_ids(spark: SparkSession) -> frozenset[int]:
    """The ids of the RDDs the application keeps persisted now (no job)."""
    keys = _jsc(spark).getPersistentRDDs().keySet().toArray()
    return frozenset(int(k) for k in keys)


def _seq(s: Any) -> list[Any]:
    return [s.apply(i) for i in range(s.length())]


def _cache_scan(plan: Any) -> tuple[Any, tuple[int, ...]] | None:
    """(the ``InMemoryRelation``, column ordinals) when logical ``plan`` is Spark's cache
    relation alone or a projection of plain columns of it; None otherwise."""
    kind = plan.getClass().getSimpleName()
    if kind == "Project":
        relation = plan.child()
        items = _seq(plan.projectList())
    elif kind == "InMemoryRelation":
        relation, items = plan, None
    else:
        return None
    if relation.getClass().getSimpleName() != "InMemoryRelation":
        return None
    output = [a.exprId().id() for a in _seq(relation.output())]
    if items is None:
        return relation, tuple(range(len(output)))
    if any(i.getClass().getSimpleName() != "AttributeReference" for i in items):
        return None  # an expression or an alias: computed on the cached rows
    where = {e: k for k, e in enumerate(output)}
    ids = [i.exprId().id() for i in items]
    if any(e not in where for e in ids):
        return None
    return relation, tuple(where[e] for e in ids)


def cached_relation(df: DataFrame) -> tuple[int, tuple[int, ...], int, DataFrame] | None:
    """(rdd id, column ordinals, partition count, a DataFrame of the same rows) when
    ``df``'s optimized plan is Spark's ``InMemoryRelation`` alone or a projection of
    plain columns of it; None otherwise, and for a plan shape this Spark builds
    differently. Defines the cached RDD without a job.

    The DataFrame returned is planned on that optimized plan: what ``df`` reads, minus
    the analysis and optimization of the plan the cache was made from (a DataFrame made
    from a pandas frame holds all its rows in the plan, and each query over it pays tens
    of milliseconds for them); its partition count is known without planning
    (``exact_num_partitions``). None for a Spark Connect client (no plan objects)."""
    if is_connect(df.sparkSession):
        return None
    try:
        plan = df._jdf.queryExecution().optimizedPlan()
        found = _cache_scan(plan)
        if found is None:
            return None
        relation, ordinals = found
        rdd = relation.cacheBuilder().cachedColumnBuffers()  # defines the RDD, no job
        return int(rdd.id()), ordinals, int(rdd.getNumPartitions()), _of_plan(df, plan)
    except Exception:  # a plan shape this Spark version builds differently: not cached
        return None


def _of_plan(df: DataFrame, plan: Any) -> DataFrame:
    """A DataFrame of ``df``'s session over the resolved logical ``plan``."""
    from pyspark.sql import DataFrame as PyDataFrame

    spark = df.sparkSession
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a started classic SparkContext has its gateway
    jdf = _dataset_class(jvm).ofRows(spark._jsparkSession, plan)
    return PyDataFrame(jdf, spark)


def _dataset_class(jvm: Any) -> Any:
    """The JVM class whose ``ofRows`` makes a classic ``Dataset``: the
    ``org.apache.spark.sql.classic`` one where the JVM has that package (Spark 4), else
    ``org.apache.spark.sql.Dataset`` (3.5)."""
    from py4j.java_gateway import JavaClass

    classic = jvm.org.apache.spark.sql.classic.Dataset
    return classic if isinstance(classic, JavaClass) else jvm.org.apache.spark.sql.Dataset


def streaming_file_source(df: DataFrame) -> tuple[str, dict[str, str]] | None:
    """(data source class name, options) when ``df`` is a file source as it came from
    ``spark.readStream`` (nothing applied on top); None otherwise."""
    try:
        # analyzed: Spark 4's unanalyzed plan holds an unresolved NamedStreamingRelation
        plan = df._jdf.queryExecution().analyzed()
        if plan.getClass().getSimpleName() != "StreamingRelation":
            return None
        source = plan.dataSource()
        options: dict[str, str] = {}
        it = source.options().iterator()
        while it.hasNext():
            kv = it.next()
            options[str(kv._1())] = str(kv._2())
        return str(source.className()), options
    except Exception:  # not the JVM plan we know
        return None


def running_spark_master() -> str | None:
    """The master of the SparkContext running in this process, or None."""
    from pyspark import SparkContext

    active = SparkContext._active_spark_context
    return None if active is None else str(active.master)


def jvm_launched() -> bool:
    """Whether this process has launched its Spark JVM (PySpark keeps one per process)."""
    from pyspark import SparkContext

    return SparkContext._gateway is not None


def shut_down_jvm(timeout: float = 30.0) -> int | None:
    """Stop this process's SparkContext and end the JVM PySpark launched for it (a later
    SparkSession launches a new one). For a start that failed: nothing of Spark is left.
    The JVM's exit code (killed when it has not exited ``timeout`` s after its stdin
    closed), None when there was none."""
    from pyspark import SparkContext

    active = SparkContext._active_spark_context
    if active is not None:
        with contextlib.suppress(Exception):  # tearing down a start that failed already
            active.stop()
    gateway = SparkContext._gateway
    if gateway is None:
        return None
    proc = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):  # the JVM may be gone already
        gateway.shutdown()
    code = None
    if proc is not None:
        if proc.stdin is not None:
            proc.stdin.close()  # PySpark's JVM exits when its stdin closes
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    SparkContext._gateway = None
    SparkContext._jvm = None
    return code


def jvm_has_class(name: str) -> bool | None:
    """Whether this process' Spark JVM has class ``name`` on its classpath; None when
    no JVM was launched yet."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return None
    from py4j.java_gateway import JavaClass

    node: Any = gateway.jvm
    for part in name.split("."):
        node = getattr(node, part)
    return isinstance(node, JavaClass)


def jvm_pid(spark: SparkSession) -> int:
    """The pid of the driver JVM py4j launched for ``spark``."""
    gateway: Any = spark.sparkContext._gateway
    return int(gateway.proc.pid)


def hadoop_filesystem_class(spark: SparkSession, scheme: str) -> str | None:
    """The Hadoop ``FileSystem`` class Spark's driver uses for ``scheme`` (its
    ``spark.hadoop.fs.<scheme>.impl`` or Hadoop's default), or None when it has none or
    the class is missing. Makes no filesystem and no network call. Raises when this
    SparkSession has no JVM in this process (Spark Connect)."""
    from py4j.protocol import Py4JJavaError

    sc = spark.sparkContext
    conf = _jsc(spark).hadoopConfiguration()
    jvm: Any = sc._jvm
    try:
        klass = jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, conf)
    except Py4JJavaError:  # UnsupportedFileSystemException, or ClassNotFoundException
        return None
    return str(klass.getName())


def hadoop_version(spark: SparkSession) -> str:
    """The version of the Hadoop client Spark runs with (e.g. ``3.3.4``)."""
    jvm: Any = spark.sparkContext._jvm
    return str(jvm.org.apache.hadoop.util.VersionInfo.getVersion())


def translate_converted_errors(translate: Callable[[Any], Any]) -> None:
    """Wrap pyspark's ``convert_exception`` (idempotent): the exception pyspark makes of a
    failed job's Java error is passed to ``translate``, and its non-None answer raised
    instead. Classic sessions only (a Connect client converts errors elsewhere)."""
    from pyspark.errors.exceptions import captured

    original = captured.convert_exception
    if getattr(original, "_hybrid_iter_translation", False):
        return

    def convert_exception(e: Any) -> Any:
        converted = original(e)
        translated = translate(converted)
        return converted if translated is None else translated

    convert_exception._hybrid_iter_translation = True  # type: ignore[attr-defined]
    convert_exception.__wrapped__ = original  # type: ignore[attr-defined]
    captured.convert_exception = convert_exception


def session_stopped(spark: Any) -> bool:
    """Whether ``spark`` (a classic or a Spark Connect session) was stopped, so that its
    DataFrames can run no job any more: a classic session's SparkContext lets go of the
    JVM's context when stopped (``_jsc`` None), a Connect client says so itself."""
    if is_connect(spark):
        return bool(getattr(spark, "is_stopped", False))
    sc = getattr(spark, "_sc", None)
    return sc is not None and getattr(sc, "_jsc", None) is None
