"""Where files live: the storage URIs users give, read once, the way Spark reads them.

A leaf package shared by ``hybrid_iter``, ``coordinator`` and ``spark_ops`` (which may not
import each other): pure Python plus ``pyarrow.fs``, never pyspark or Ray. One string a
user gives (``s3a://bucket/ckpt``, ``gs://...``, ``file:/x``, ``~/runs/x``) names one
place for Spark's files (``Location.spark``, e.g. a streaming ``checkpointLocation``)
and for ours (``Location.filesystem()``: a ``pyarrow.fs`` filesystem and a path in it).

* ``parse(text, what=..., error=...)`` checks the syntax only (no network, no
  filesystem is created) and raises the caller's error class naming ``what``.
* ``check(...)`` also runs pyarrow's own parser of the URI's options, still without
  network (for config constructors).
* ``join(uri, *names)`` appends path segments before any query string.
* ``arrow_filesystem(uri)`` resolves the ``pyarrow.fs`` filesystem at first use (an S3
  bucket's region lookup happens here, not in a constructor), cached per process.
"""

from ._location import (
    Location,
    arrow_filesystem,
    check,
    join,
    parse,
    spark_uri,
)

__all__ = ["Location", "arrow_filesystem", "check", "join", "parse", "spark_uri"]
