"""Our files on a real S3-compatible server on loopback (moto's server mode), reached
through ``pyarrow.fs`` in both of Spark's spellings (``s3://`` and ``s3a://``):
checkpoints and resuming, the online coordinator's snapshots and journal, dead letters
and outputs, side-input spills and keyed stores, saved models. Each test lists the
bucket to see the files really landed there.

Spark's own files need Hadoop's S3A connector, which this Spark does not bundle: where a
location is Spark's too (a streaming checkpoint location), the test asserts the error
that says what to add, raised before any job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid

import numpy as np
import pyarrow as pa
import pytest
from checkpoint_job import EPOCHS, data, iterate
from online_ops import SCHEMA, Grad, Step, Total, reference, write_file

import hybrid_iter as hi
import storage_uri
from hybrid_iter import ml
from hybrid_iter.testing import FaultInjection
from spark_ops import MapSideInput, RecordBuffer, SideInputConfigError, with_side_inputs

# Credentials for the server (it takes any). Set when this module is collected, before
# the session fixture starts Spark and Ray, so the coordinator actor and Spark's Python
# workers inherit them; the endpoint travels in each URI's query string.
os.environ["AWS_ACCESS_KEY_ID"] = "hybrid-iter-test"
os.environ["AWS_SECRET_ACCESS_KEY"] = "hybrid-iter-test"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # never probe an instance-metadata service

SPELLINGS = ["s3", "s3a"]


class S3:
    """The server's endpoint, a bucket per test, URIs in a chosen spelling."""

    def __init__(self, endpoint: str):
        import boto3

        self.endpoint = endpoint
        self.client = boto3.client("s3", endpoint_url=f"http://{endpoint}")

    def bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def uri(self, scheme: str, bucket: str, path: str) -> str:
        return f"{scheme}://{bucket}/{path}?endpoint_override={self.endpoint}&scheme=http"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        found = (o["Key"] for page in pages for o in page.get("Contents", ()))
        return sorted(k for k in found if not k.endswith("/"))  # pyarrow's directory markers


@pytest.fixture(scope="session")
def s3(session):
    """moto's S3 on 127.0.0.1 (a port the OS picks). Depends on ``session`` so that it
    stops before the session's leak check."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"  # nothing listens beyond loopback
    try:
        yield S3(f"{host}:{port}")
    finally:
        server.stop()
        server._server.server_close()  # stop() leaves the listening socket open


@contextlib.contextmanager
def no_spark_job(spark):
    """Fails when a Spark job ran inside the block."""
    sc = spark.sparkContext
    group = f"must-not-run-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "no job may run here")
    try:
        yield
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        assert not sc.statusTracker().getJobIdsForGroup(group), "a Spark job ran"


@pytest.fixture(scope="module")
def df(spark):
    frame = data(spark).cache()
    frame.count()
    yield frame
    frame.unpersist()


@pytest.fixture(scope="module")
def clean(df):
    return iterate(df)


# -- bounded checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_checkpoints_restore_and_resume_from_the_bucket(s3, df, clean, scheme):
    bucket = s3.bucket()
    where = s3.uri(scheme, bucket, "runs/ckpt")
    result = iterate(
        df,
        checkpoint=hi.CheckpointConfig(where, every_epochs=4),
        hooks=FaultInjection(fail_partition=1, at_epoch=10),
    )
    # the relaunch restored epoch 8 from the bucket and ended bit for bit as without fault
    assert result.variables["w"].tobytes() == clean.variables["w"].tobytes()
    assert result.outputs["w0"] == clean.outputs["w0"]
    assert result.checkpoint["restored_from"] == f"{bucket}/runs/ckpt/chk-0000000008.ckpt"
    keys = s3.keys(bucket)
    assert [k for k in keys if "/chk-" in k] == [  # keep_last=2, pruned in the bucket too
        "runs/ckpt/chk-0000000032.ckpt",
        "runs/ckpt/chk-0000000036.ckpt",
    ]
    assert "runs/ckpt/out-0000000036.pkl" in keys  # the outputs saved with the checkpoints
    # a finished run resumed from the bucket: restored, nothing run again, same answer
    resumed = iterate(df, resume_from=where)
    assert resumed.variables["w"].tobytes() == clean.variables["w"].tobytes()
    assert resumed.outputs["w0"] == clean.outputs["w0"]
    assert resumed.epochs == EPOCHS


# -- online --------------------------------------------------------------------------------


def _online(spark, source, **config):
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).csv(str(source))
    return hi.iterate_unbounded_streams(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(stream, ["x0", "x1", "x2", "y"])),
        hi.IterationBody(Grad(), Step()),
        hi.OnlineConfig(trigger={"availableNow": True}, **config),
    )


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_online_dead_letters_and_outputs_land_in_the_bucket(s3, spark, tmp_path, scheme):
    source = tmp_path / "in"
    source.mkdir()
    bad = "abc,1,2,3\nNaN,1,2,3\n1,2,3\n4,5,,6\n"  # wrong type, NaN, missing column, null
    batches = [write_file(source, i, extra_lines=bad if i == 1 else "") for i in range(3)]
    bucket = s3.bucket()
    with _online(
        spark,
        source,
        checkpoint_location=str(tmp_path / "ckpt"),  # Spark's files: local (no S3A here)
        dead_letter_path=s3.uri(scheme, bucket, "dead"),
        output_path=s3.uri(scheme, bucket, "out"),
    ) as it:
        it.await_termination(300)
        assert it.exception() is None, it.exception()
        w = it.latest_variables()["w"]
        assert it.progress.dead_letters == 4
    np.testing.assert_allclose(w, reference(batches), rtol=0, atol=1e-12)
    assert s3.keys(bucket, "out/") == [f"out/batch-{b:012d}.json" for b in range(3)]
    dead = s3.keys(bucket, "dead/")
    assert dead and all(k.startswith("dead/batch_id=1/part-") for k in dead)
    import pyarrow.parquet as pq

    fs, path = storage_uri.arrow_filesystem(s3.uri(scheme, bucket, "dead/batch_id=1"))
    assert pq.read_table(path, filesystem=fs).num_rows == 4


@pytest.mark.usefixtures("session")
@pytest.mark.parametrize("scheme", SPELLINGS)
def test_the_online_coordinators_snapshots_and_journal_restore_from_the_bucket(s3, scheme):
    import asyncio

    import cloudpickle

    from coordinator import CheckpointSpec, CoordinatorSpec, Emissions, OnlineCoordinator

    bucket = s3.bucket()
    where = s3.uri(scheme, bucket, "ckpt/hybrid_iter")

    def coordinator():
        spec = CoordinatorSpec(
            num_subtasks=1,
            num_streams=1,
            staleness=0,
            max_epochs=None,
            has_criteria=False,
            init_variables={"total": np.zeros(5)},
            operators=cloudpickle.dumps((Total(), None, [])),
            checkpoint=CheckpointSpec(uri=where, keep_last=2, fingerprint={"t": 1}, restore=True),
        )
        return OnlineCoordinator(spec, put=None)

    first = coordinator()
    for batch_id in range(4):
        value = np.array([1.0, batch_id, 0, 0, 0])
        asyncio.run(first.online_report(batch_id, 0, Emissions(feedback=[value])))
        assert first.commit_batch(batch_id, 1, 0).applied
    assert s3.keys(bucket) == [
        "ckpt/hybrid_iter/chk-0000000002.ckpt",
        "ckpt/hybrid_iter/chk-0000000003.ckpt",
        "ckpt/hybrid_iter/jrn-000000000003.ckpt",
    ]
    again = coordinator()  # a restarted query's coordinator reads them back
    state = again.online_state()
    assert state.committed == 3
    np.testing.assert_array_equal(again.latest_variables()["total"], [4, 6, 0, 0, 0])


@pytest.mark.parametrize(
    "location, words",
    [
        ("s3a://bkt/ckpt", r"spark\.jars\.packages=org\.apache\.hadoop:hadoop-aws:3\.\d+\.\d+"),
        ("s3://bkt/ckpt", r"write the location as s3a://"),
        ("gs://bkt/ckpt", r"gcs-connector"),
    ],
)
def test_a_checkpoint_location_spark_cannot_open_fails_before_any_job(
    spark, tmp_path, location, words
):
    """Spark keeps its offsets and commits in the checkpoint location: without the Hadoop
    connector of its scheme the error says what to add, before any job or actor."""
    import ray

    from hybrid_iter._cluster.ray_util import NAMESPACE

    def online_actors():
        return {
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and ".online." in a["name"]
        }

    before = online_actors()
    with no_spark_job(spark), pytest.raises(hi.IterationConfigError, match=words) as info:
        _online(spark, tmp_path, checkpoint_location=location)
    assert "OnlineConfig.checkpoint_location" in str(info.value)
    assert online_actors() == before


def test_a_side_input_work_dir_spark_cannot_open_fails_before_any_query(spark, tmp_path):
    main = spark.readStream.schema("k long, v double").parquet(str(tmp_path))
    side = spark.createDataFrame([(1, 2.0)], "k long, w double")
    lookup = MapSideInput(side, key="k", value="w")
    op = with_side_inputs(main, lookup).map(lambda row, ctx: row, "k long, v double")
    active = len(spark.streams.active)
    with no_spark_job(spark), pytest.raises(SideInputConfigError, match="hadoop-aws") as info:
        op.start(foreach_batch=lambda d, i: None, work_dir="s3a://bkt/work")
    assert "work_dir" in str(info.value)
    assert len(spark.streams.active) == active


# -- side inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_side_input_records_spill_to_the_bucket_and_read_back(s3, scheme):
    bucket = s3.bucket()
    buffer = RecordBuffer(s3.uri(scheme, bucket, "work/buffer"), memory_budget=0)
    batches = [pa.record_batch({"k": [i, i + 1], "v": [0.5 * i, 1.0]}) for i in range(3)]
    for b in batches:
        buffer.add("w1", b)  # over a budget of 0 bytes: each goes to a Parquet file
    keys = s3.keys(bucket, "work/buffer/")
    assert len(keys) == 3 and all(k.endswith(".parquet") for k in keys)
    got = pa.Table.from_batches(list(buffer.records("w1")))
    assert got.equals(pa.Table.from_batches(batches))
    # Spark is given the files in the directory's spelling, without pyarrow's options
    files = buffer.files("w1")
    assert [f.split("?")[0] for f in files] == files
    assert sorted(f[len(f"{scheme}://{bucket}/") :] for f in files) == keys
    assert all(f.startswith(f"{scheme}://{bucket}/work/buffer/ns-") for f in files)
    buffer.clear("w1")
    assert s3.keys(bucket, "work/buffer/") == []


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_keyed_side_input_versions_are_written_and_read_by_spark_tasks_in_the_bucket(
    s3, spark, scheme
):
    from pyspark.sql import functions as F

    from spark_ops.side_inputs._plan import col, layout_columns
    from spark_ops.side_inputs._store import (
        SUMMARY_SCHEMA,
        Delta,
        KeyedSource,
        load_shard,
        write_delta_task,
    )
    from spark_ops.side_inputs._task import BUCKET

    bucket = s3.bucket()
    root = s3.uri(scheme, bucket, "work/state")
    side = spark.createDataFrame([(k, 10.0 * k) for k in range(12)], "k long, w double")
    spec = MapSideInput(side, key="k", value="w", keyed=True)._spec
    groups = 3
    laid = side.select(
        F.pmod(F.hash(col("k")), F.lit(groups)).alias(BUCKET), *layout_columns(spec)
    ).repartition(2, BUCKET)
    summary = laid.mapInArrow(write_delta_task(spec, root, 1), SUMMARY_SCHEMA).collect()
    buckets = sorted(int(r["bucket"]) for r in summary if r["rows"])
    assert sum(r["rows"] for r in summary) == 12
    keys = s3.keys(bucket)
    assert keys and all(k.startswith(f"work/state/{spec.view_id}/v00000001/bucket=") for k in keys)
    source = KeyedSource(spec, root, 1, (Delta(1, False, frozenset(buckets)),))
    shards = (
        spark.sparkContext.parallelize(buckets, len(buckets))
        .map(lambda b: repr(load_shard(source, b)))
        .collect()
    )
    for k in range(12):  # every key's value, read back by a task, in one shard
        assert sum(f"{k}: {10.0 * k}" in s or f"({k},): {10.0 * k}" in s for s in shards) == 1


# -- models --------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_a_model_saves_to_and_loads_from_the_bucket(s3, df, scheme):
    bucket = s3.bucket()
    model = ml.LinearRegression(features_col=["x0", "x1", "x2"], label_col="y", max_iter=5).fit(df)
    where = s3.uri(scheme, bucket, "models/lr")
    model.save(where)
    assert s3.keys(bucket) == ["models/lr/arrays.npz", "models/lr/metadata.json"]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        model.save(where)
    loaded = ml.Model.load(where)
    assert isinstance(loaded, ml.LinearRegressionModel)
    assert np.array_equal(loaded.coefficients, model.coefficients)
    assert loaded.intercept == model.intercept
