"""Storage locations as Spark users spell them, read by the one helper the three packages
share (``storage_uri``): one table of URIs, pure (no Spark, no Ray, no network)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from paths import ROOT

import hybrid_iter as hi
import storage_uri
from spark_ops import SideInputConfigError

HOME = os.path.expanduser("~")

# text -> (the location as one string, as Spark is given it, pyarrow's scheme, pyarrow's
# path or None where making the filesystem would need a network or libhdfs)
TABLE = [
    # S3 in Hadoop's three spellings: one store for pyarrow, the user's scheme for Spark
    ("s3a://bkt/ckpt", "s3a://bkt/ckpt", "s3a://bkt/ckpt", "s3", None),
    ("s3n://bkt/a/b/", "s3n://bkt/a/b", "s3n://bkt/a/b", "s3", None),
    ("s3://bkt/ckpt", "s3://bkt/ckpt", "s3://bkt/ckpt", "s3", None),
    ("S3A://bkt//x/./y/../z", "s3a://bkt/x/z", "s3a://bkt/x/z", "s3", None),
    ("s3a://bkt", "s3a://bkt/", "s3a://bkt/", "s3", None),
    # pyarrow's options ride in the query: kept for our files, never given to Spark
    (
        "s3a://bkt/x?region=eu-west-1",
        "s3a://bkt/x?region=eu-west-1",
        "s3a://bkt/x",
        "s3",
        "bkt/x",
    ),
    (
        "s3://bkt/x?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1",
        "s3://bkt/x?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1",
        "s3://bkt/x",
        "s3",
        "bkt/x",
    ),
    # a path is literal, as in Hadoop: %20 is not a space
    (
        "s3a://bkt/a%20b?region=us-east-1",
        "s3a://bkt/a%20b?region=us-east-1",
        "s3a://bkt/a%20b",
        "s3",
        "bkt/a%20b",
    ),
    # Google Cloud Storage: gcs:// is fsspec's name, Spark's connector knows gs://
    ("gs://bkt/p", "gs://bkt/p", "gs://bkt/p", "gs", "bkt/p"),
    ("gcs://bkt/p/", "gcs://bkt/p", "gs://bkt/p", "gs", "bkt/p"),
    # Azure Data Lake Gen2, Hadoop's ABFS form (pyarrow.fs.AzureFileSystem)
    (
        "abfss://cont@acct.dfs.core.windows.net/p/q",
        "abfss://cont@acct.dfs.core.windows.net/p/q",
        "abfss://cont@acct.dfs.core.windows.net/p/q",
        "abfss",
        "cont/p/q",
    ),
    (
        "abfs://cont@acct.dfs.core.windows.net",
        "abfs://cont@acct.dfs.core.windows.net/",
        "abfs://cont@acct.dfs.core.windows.net/",
        "abfs",
        "cont",
    ),
    # HDFS (pyarrow needs libhdfs to make the filesystem: not resolved here)
    ("hdfs://nn:8020/user/x", "hdfs://nn:8020/user/x", "hdfs://nn:8020/user/x", "hdfs", None),
    ("hdfs:///user/x", "hdfs:///user/x", "hdfs:///user/x", "hdfs", None),
    ("hdfs:/user/x", "hdfs:///user/x", "hdfs:///user/x", "hdfs", None),
    ("viewfs://cluster/x", "viewfs://cluster/x", "viewfs://cluster/x", "viewfs", None),
    # local: Hadoop's file: forms and plain paths; Spark is told file:// explicitly
    ("file:/tmp/x", "/tmp/x", "file:///tmp/x", "file", "/tmp/x"),
    ("file:///tmp/x/", "/tmp/x", "file:///tmp/x", "file", "/tmp/x"),
    ("file://localhost/tmp/x", "/tmp/x", "file:///tmp/x", "file", "/tmp/x"),
    ("/tmp/a b/c%20d", "/tmp/a b/c%20d", "file:///tmp/a b/c%20d", "file", "/tmp/a b/c%20d"),
    ("/tmp/x?y=1", "/tmp/x?y=1", "file:///tmp/x?y=1", "file", "/tmp/x?y=1"),
    ("~/ckpt", f"{HOME}/ckpt", f"file://{HOME}/ckpt", "file", f"{HOME}/ckpt"),
]


@pytest.mark.parametrize("text, uri, spark, arrow_scheme, arrow_path", TABLE)
def test_the_table_of_spellings(text, uri, spark, arrow_scheme, arrow_path):
    loc = storage_uri.parse(text)
    assert (loc.uri, loc.spark, loc.arrow_scheme) == (uri, spark, arrow_scheme)
    assert storage_uri.parse(loc.uri) == loc  # what is sent to another process reads back
    assert storage_uri.spark_uri(text) == spark
    if arrow_path is not None:
        fs, path = storage_uri.arrow_filesystem(text)
        assert path == arrow_path
        assert fs.type_name == {"file": "local", "gs": "gcs", "abfss": "abfs"}.get(
            arrow_scheme, arrow_scheme
        )


def test_a_relative_path_is_taken_where_it_is_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage_uri.parse("runs/a").uri == f"{tmp_path}/runs/a"
    # the configs keep it absolute: the coordinator actor and Spark run elsewhere
    assert hi.CheckpointConfig("runs/a").path == f"{tmp_path}/runs/a"
    assert hi.IterationConfig(resume_from="~/r").resume_from == f"{HOME}/r"
    assert hi.OnlineConfig(checkpoint_location="c").checkpoint_location == f"{tmp_path}/c"
    # a URI is kept as the user spelled it (Spark is given that spelling)
    assert hi.CheckpointConfig("s3a://bkt/x/").path == "s3a://bkt/x/"


@pytest.mark.parametrize(
    "base, names, joined",
    [
        (
            "s3://b/x?endpoint_override=h:1&scheme=http",
            ("offsets",),
            "s3://b/x/offsets?endpoint_override=h:1&scheme=http",
        ),
        ("s3a://b/x/", ("checkpoints", "main"), "s3a://b/x/checkpoints/main"),
        ("s3a://b/x", ("checkpoints/main",), "s3a://b/x/checkpoints/main"),
        ("s3a://b", ("hybrid_iter",), "s3a://b/hybrid_iter"),
        ("/tmp/x", ("hybrid_iter",), "/tmp/x/hybrid_iter"),
        ("file:/tmp/x", ("dead_letter",), "/tmp/x/dead_letter"),
    ],
)
def test_joining_keeps_the_query_last(base, names, joined):
    assert storage_uri.join(base, *names) == joined


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "must be a path or a storage URI"),
        (3, "must be a path or a storage URI"),
        ("s3a:///x", "names no bucket"),
        ("gs://", "names no bucket"),
        ("abfss:///x", "names no container@account"),
        ("s3a://key:secret@bkt/x", "credentials do not belong in a URI"),
        ("wasbs://c@a.blob.core.windows.net/x", r"abfss://<container>@<account>"),
        ("dbfs:/mnt/x", "Databricks"),
        ("ftp://host/x", "unknown scheme 'ftp'"),
        ("my:dir/x", "unknown scheme 'my'"),  # Hadoop reads a scheme there too
        ("file://otherhost/tmp/x", "names host 'otherhost'"),
        ("file:tmp/x", "relative file: URI"),
        ("/tmp/x\n", "line break"),
    ],
)
def test_bad_locations_are_named_with_the_fix(text, words):
    with pytest.raises(hi.IterationConfigError, match=words) as info:
        storage_uri.parse(text, what="CheckpointConfig.path", error=hi.IterationConfigError)
    assert "CheckpointConfig.path" in str(info.value)


def test_pyarrow_options_are_checked_where_they_are_given():
    with pytest.raises(hi.IterationConfigError, match=r"Unexpected query parameter.*endpoit"):
        hi.CheckpointConfig("s3://bkt/x?endpoit_override=h:1")
    with pytest.raises(hi.IterationConfigError, match=r"OnlineConfig\.dead_letter_path"):
        hi.OnlineConfig(dead_letter_path="gs://bkt/x?nope=1")


def test_a_location_spark_also_uses_refuses_pyarrow_only_options(tmp_path):
    # pyarrow's options would reach our files but not Spark's: two stores, silently
    with pytest.raises(hi.IterationConfigError, match=r"spark\.hadoop\.fs\.s3a\.endpoint"):
        hi.OnlineConfig(checkpoint_location="s3a://bkt/ckpt?endpoint_override=h:9000")
    hi.OnlineConfig(dead_letter_path="s3a://bkt/dead?endpoint_override=h:9000")  # ours alone
    with pytest.raises(SideInputConfigError, match="work_dir"):
        storage_uri.check(
            "s3a://b/w?region=us-east-1",
            what="start(): work_dir",
            error=SideInputConfigError,
            spark_reads=True,
        )


def test_spark_spellings_of_s3_are_accepted_by_every_config():
    # Spark's own spellings (s3a://, s3n://, gs://) are what a Spark user writes
    assert hi.OnlineConfig(checkpoint_location="s3a://bkt/ckpt").checkpoint_location == (
        "s3a://bkt/ckpt"
    )
    assert hi.CheckpointConfig("s3n://bkt/ckpt").path == "s3n://bkt/ckpt"
    assert hi.IterationConfig(resume_from="gs://bkt/ckpt").resume_from == "gs://bkt/ckpt"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_config_constructors_make_no_network_call():
    """In a network namespace of its own (no route anywhere) a constructor that looked up
    an S3 bucket's region would fail; checking the syntax needs no network."""
    code = (
        "import hybrid_iter as hi\n"
        "hi.CheckpointConfig('s3://bkt/ckpt')\n"
        "hi.IterationConfig(resume_from='s3a://bkt/ckpt')\n"
        "hi.OnlineConfig(checkpoint_location='s3a://bkt/ckpt', dead_letter_path='s3://b/d',"
        " output_path='gs://b/o')\n"
        "print('built')\n"
    )
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"unshare -n is not allowed here: {probe.stderr.decode().strip()}")
    got = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert got.returncode == 0 and "built" in got.stdout, got.stderr[-2000:]


def test_every_local_spelling_counts_as_node_local_for_checkpoints():
    from hybrid_iter._runtime.iterate import node_local_refusal

    for uri in ("/tmp/c", "file:/tmp/c", "FILE:///tmp/c", "file://localhost/tmp/c", "~/c"):
        assert node_local_refusal(uri, 3, False), uri
    for uri in ("s3a://b/c", "gs://b/c", "hdfs://nn/c"):
        assert node_local_refusal(uri, 3, False) is None, uri
