"""Whether Spark's Hadoop can open a storage location, asked before a query starts.

A streaming query's checkpoint location (and whatever else Spark itself reads or writes)
goes through Hadoop's ``FileSystem`` of the location's scheme; a scheme Hadoop has no
class for fails only once the query runs (``No FileSystem for scheme "s3"``,
``ClassNotFoundException: ...S3AFileSystem``). ``require_spark_filesystem`` turns that
into an error before any job, naming what to add.

The JVM is asked through the compatibility module (``_spark_compat``:
``hadoop_filesystem_class``, ``hadoop_version``), where every use of Spark's internals is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import storage_uri

from ._spark_compat import hadoop_filesystem_class, hadoop_version, is_connect

__all__ = ["require_spark_filesystem"]


def _advice(scheme: str, hadoop: str) -> str:
    s3a = f"spark.jars.packages=org.apache.hadoop:hadoop-aws:{hadoop}"
    if scheme == "s3a":
        return (
            f"add Hadoop's S3A connector when the SparkSession is created: {s3a} (the "
            f"version of Spark's Hadoop; it brings its AWS SDK)"
        )
    if scheme in ("s3", "s3n"):
        return (
            f"open-source Hadoop reads S3 as s3a://: write the location as s3a://... (our "
            f"files take that spelling too) with {s3a}, or map the scheme with "
            f"spark.hadoop.fs.{scheme}.impl=org.apache.hadoop.fs.s3a.S3AFileSystem"
        )
    if scheme == "gs":
        return (
            "add Google's Cloud Storage connector when the SparkSession is created "
            "(spark.jars.packages=com.google.cloud.bigdataoss:gcs-connector:hadoop3-<version>"
            " and spark.hadoop.fs.gs.impl=com.google.cloud.hadoop.fs.gcs."
            "GoogleHadoopFileSystem)"
        )
    if scheme in ("abfs", "abfss"):
        return (
            f"add Hadoop's ABFS driver when the SparkSession is created: "
            f"spark.jars.packages=org.apache.hadoop:hadoop-azure:{hadoop}"
        )
    return f"add a Hadoop FileSystem for {scheme}:// to Spark's classpath"


def require_spark_filesystem(
    spark: Any, uri: str, *, what: str, error: Callable[[str], Exception]
) -> None:
    """Raise ``error`` naming ``what`` when Spark's Hadoop cannot open ``uri``'s scheme.

    A local location always passes (Spark is given ``file://``). Without a JVM in this
    process (a Spark Connect client) nothing can be asked: the server reports it when the
    query starts. A classic session whose JVM cannot be asked raises that failure as it
    is, never taken for a Connect client."""
    loc = storage_uri.parse(uri, what=what, error=error)
    if loc.is_local:
        return
    scheme = loc.spark.split(":", 1)[0]
    if is_connect(spark):
        return
    found = hadoop_filesystem_class(spark, scheme)
    hadoop = hadoop_version(spark) if found is None else ""
    if found is None:
        raise error(
            f"{what}={uri!r}: Spark's Hadoop ({hadoop}) has no FileSystem for {scheme}://, "
            f"so Spark cannot keep its own files there; {_advice(scheme, hadoop)}"
        )
