"""Where files live: the storage URIs users give, read once, the way Spark reads them;
and how a file of ours is written there whole.

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
* ``atomic_output(path, fs=...)`` writes a file whole or not at all (a temporary name
  beside it, then a move), through ``pyarrow.fs`` or to a local path;
  ``temporary_path``, ``writer_pid`` and ``process_running`` let a sweeper tell an
  abandoned temporary file (``_files``).
"""

from ._files import atomic_output, process_running, temporary_path, writer_pid
from ._location import (
    Location,
    arrow_filesystem,
    check,
    join,
    parse,
    spark_uri,
)

__all__ = [
    "Location",
    "arrow_filesystem",
    "atomic_output",
    "check",
    "join",
    "parse",
    "process_running",
    "spark_uri",
    "temporary_path",
    "writer_pid",
]
