"""One storage location: parsing (pure), joining, Spark's spelling, pyarrow's filesystem.

The rules follow Hadoop's ``Path``, because the same string reaches Spark:

* ``scheme:`` before the first ``/`` is a scheme (``file:/x``, ``s3a://b/x``); anything
  else is a local path (``~`` expanded, made absolute where it is parsed).
* The path is literal and normalised as Hadoop does (``//`` and ``.``/``..`` resolved):
  ``%20`` is three characters, not a space (pyarrow's own ``from_uri`` would decode it,
  and then our files and Spark's would differ).
* Object stores and HDFS take pyarrow's options as a query string
  (``s3://b/x?endpoint_override=host:9000&scheme=http``); ``join`` keeps it last. Spark
  never sees it: a location Spark also reads or writes (``spark_reads=True``) refuses
  one, since Spark would reach the store with its own settings, maybe another one.
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Location", "arrow_filesystem", "check", "join", "parse", "spark_uri"]

ErrorFactory = Callable[[str], Exception]

#: Spark's (Hadoop's) scheme -> the ``pyarrow.fs`` scheme of the same store
_ARROW = {
    "s3": "s3",
    "s3a": "s3",
    "s3n": "s3",
    "gs": "gs",
    "gcs": "gs",
    "abfs": "abfs",
    "abfss": "abfss",
    "hdfs": "hdfs",
    "viewfs": "viewfs",
}
#: the scheme Spark is given where it differs (``gcs://`` is fsspec's name; Hadoop's GCS
#: connector registers ``gs``)
_SPARK = {"gcs": "gs"}
_OBJECT_STORES = {"s3", "gs", "abfs", "abfss"}
_AZURE = (
    "address the same storage account as abfss://<container>@<account>.dfs.core.windows.net"
    "/<path> (pyarrow.fs.AzureFileSystem, and Hadoop's ABFS driver for Spark)"
)
#: schemes users meet around Spark that ``pyarrow.fs`` cannot open, and what to write
_ADVICE = {
    "wasb": f"pyarrow.fs cannot open wasb:// (Hadoop's legacy Azure Blob driver): {_AZURE}",
    "wasbs": f"pyarrow.fs cannot open wasbs:// (Hadoop's legacy Azure Blob driver): {_AZURE}",
    "adl": f"adl:// (Azure Data Lake Gen1) is retired and pyarrow.fs cannot open it: {_AZURE}",
    "dbfs": (
        "pyarrow.fs cannot open dbfs:/ (Databricks' own filesystem): give the cloud URI "
        "under it (s3a://, abfss://, gs://) or its /dbfs/... mount path"
    ),
    "http": "http:// is not a filesystem: give a local path or an object store URI",
    "https": "https:// is not a filesystem: give a local path or an object store URI",
}
SUPPORTED = (
    "a local path, file:/..., s3a://, s3://, s3n://, gs://, abfss://, abfs://, hdfs:// or viewfs://"
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")


@dataclass(frozen=True)
class Location:
    """A parsed location. ``scheme`` is ``""`` for the local filesystem (``path`` is then
    absolute), else lower case as given (``s3a``, ``gs``, ...); ``authority`` is the
    bucket, ``container@account.host`` or ``namenode:port``; ``path`` is absolute and
    normalised (``/`` for the root); ``query`` holds pyarrow's options (without ``?``).
    """

    scheme: str
    authority: str
    path: str
    query: str = ""

    @property
    def is_local(self) -> bool:
        """On the local filesystem of whichever process opens it."""
        return not self.scheme

    @property
    def uri(self) -> str:
        """The location as one string (parses back to this location): what is stored and
        sent to other processes. A local path is given as an absolute path."""
        if self.is_local:
            return self.path
        query = f"?{self.query}" if self.query else ""
        return f"{self.scheme}://{self.authority}{self.path}{query}"

    @property
    def spark(self) -> str:
        """The location as Spark is given it: the user's scheme (``gcs`` as ``gs``), no
        query; a local path as ``file://`` + the path, so that Spark does not read it on
        its default filesystem (HDFS on a Hadoop cluster) while our files are local."""
        if self.is_local:
            return f"file://{self.path}"
        return f"{_SPARK.get(self.scheme, self.scheme)}://{self.authority}{self.path}"

    @property
    def arrow_scheme(self) -> str:
        """The ``pyarrow.fs`` scheme (``file`` for a local path)."""
        return _ARROW[self.scheme] if self.scheme else "file"

    def join(self, *names: str) -> Location:
        """This location with path segments appended (``a/b`` allowed); the query stays."""
        parts = []
        for name in names:
            if not isinstance(name, str) or not name.strip("/") or "?" in name:
                raise ValueError(f"cannot join {name!r} to a path: give a relative name")
            parts.append(name.strip("/"))
        return Location(
            self.scheme, self.authority, _normalize("/".join([self.path, *parts])), self.query
        )

    def filesystem(self) -> tuple[Any, str]:
        """``(pyarrow.fs filesystem, path in it)``; the filesystem is made at first use
        and cached per process (an S3 bucket's region lookup happens here)."""
        if self.is_local:
            return _local(), self.path
        arrow = _ARROW[self.scheme]
        fs, root = _store(arrow, self.authority, self.query, _endpoint_env(arrow))
        if arrow in _OBJECT_STORES:  # pyarrow's paths start with the bucket / container
            base = root.rstrip("/")
            return fs, base if self.path == "/" else base + self.path
        return fs, self.path

    def __str__(self) -> str:
        return self.uri


def _normalize(path: str) -> str:
    """Absolute, no repeated or trailing ``/``, ``.`` and ``..`` resolved (as Hadoop's
    ``Path`` does)."""
    return posixpath.normpath("/" + re.sub("/+", "/", path).lstrip("/"))


def _split_scheme(text: str) -> tuple[str | None, str]:
    """Hadoop's rule: a ``:`` before the first ``/`` ends a scheme."""
    colon, slash = text.find(":"), text.find("/")
    if colon > 0 and (slash == -1 or colon < slash) and _SCHEME.fullmatch(text[:colon]):
        return text[:colon].lower(), text[colon + 1 :]
    return None, text


def parse(
    text: object,
    *,
    what: str = "path",
    error: ErrorFactory = ValueError,
    spark_reads: bool = False,
) -> Location:
    """Read a location (syntax only: no network, no filesystem made).

    ``what`` names the argument in errors, raised as ``error(message)``.
    ``spark_reads``: Spark reads or writes there too (a streaming checkpoint location),
    so pyarrow's query options, which Spark would not see, are refused.
    """
    if not isinstance(text, str) or not text:
        raise error(f"{what} must be a path or a storage URI ({SUPPORTED}), got {text!r}")
    if "\x00" in text or "\n" in text or "\r" in text:
        raise error(f"{what}={text!r} holds a NUL or line break: give the path on one line")
    scheme, rest = _split_scheme(text)
    if scheme is None:
        return Location("", "", os.path.abspath(os.path.expanduser(text)))
    if scheme == "file":
        return Location("", "", _file_path(text, rest, what, error))
    if scheme in _ADVICE:
        raise error(f"{what}={text!r}: {_ADVICE[scheme]}")
    if scheme not in _ARROW:
        raise error(
            f"{what}={text!r}: unknown scheme {scheme!r}, which neither pyarrow.fs nor Spark's "
            f"Hadoop opens here; use {SUPPORTED}"
        )
    rest, _, query = rest.partition("?")
    if rest.startswith("//"):
        authority, _, path = rest[2:].partition("/")
    else:
        authority, path = "", rest
    arrow = _ARROW[scheme]
    if arrow in _OBJECT_STORES and not authority:
        names = "container@account" if arrow.startswith("abfs") else "bucket"
        raise error(f"{what}={text!r} names no {names}: write {scheme}://<{names}>/<path>")
    if arrow in ("s3", "gs") and "@" in authority:
        raise error(
            f"{what}={text!r}: credentials do not belong in a URI (they end up in logs and "
            f"Spark's Hadoop refuses them): use the cloud's usual credentials (environment "
            f"variables, instance roles, spark.hadoop.fs.s3a.* settings for Spark)"
        )
    if query and spark_reads:
        raise error(
            f"{what}={text!r}: Spark reads and writes this location too, and it does not "
            f"take pyarrow's URI options ({query!r}): give the location without '?...' and "
            f"configure the store for both, e.g. for an S3-compatible endpoint Spark's "
            f"spark.hadoop.fs.s3a.endpoint and pyarrow's AWS_ENDPOINT_URL environment "
            f"variable (on the driver, the Ray workers and the Spark executors)"
        )
    return Location(scheme, authority, _normalize(path), query)


def _file_path(text: str, rest: str, what: str, error: ErrorFactory) -> str:
    """The path of a ``file:`` URI: ``file:/x``, ``file:///x``, ``file://localhost/x``."""
    if rest.startswith("//"):
        host, _, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise error(
                f"{what}={text!r} names host {host!r}: a file: URI is read on the local "
                f"filesystem of each process; write file:///<path> (three slashes) or use "
                f"shared storage"
            )
        return _normalize(path)
    if not rest.startswith("/"):
        raise error(f"{what}={text!r} is a relative file: URI: write file:/<absolute path>")
    return _normalize(rest)


def check(
    text: object,
    *,
    what: str = "path",
    error: ErrorFactory = ValueError,
    spark_reads: bool = False,
) -> Location:
    """``parse``, then pyarrow's own reading of an object store's options, still without
    network (an S3 region is assumed for the check, never looked up), so a bad option or
    a pyarrow built without that store fails here, where the argument is given."""
    loc = parse(text, what=what, error=error, spark_reads=spark_reads)
    if loc.is_local or _ARROW[loc.scheme] not in _OBJECT_STORES:
        return loc  # HDFS: pyarrow connects to the namenode when it makes the filesystem
    import pyarrow
    import pyarrow.fs as pafs

    arrow = _ARROW[loc.scheme]
    needs = {"s3": "S3FileSystem", "gs": "GcsFileSystem"}.get(arrow, "AzureFileSystem")
    if not hasattr(pafs, needs):
        raise error(
            f"{what}={text!r}: this pyarrow ({pyarrow.__version__}) has no pyarrow.fs."
            f"{needs}" + (" (it came in pyarrow 16)" if needs == "AzureFileSystem" else "")
        )
    query = loc.query
    if arrow == "s3" and "region=" not in query:
        query = "&".join(q for q in (query, "region=us-east-1") if q)  # no lookup: a check
    try:
        pafs.FileSystem.from_uri(f"{arrow}://{loc.authority}/" + (f"?{query}" if query else ""))
    except Exception as ex:
        raise error(f"{what}={text!r}: pyarrow.fs cannot open it ({ex})") from ex
    return loc


def join(uri: str, *names: str) -> str:
    """``uri`` with path segments appended before any query string."""
    return parse(uri).join(*names).uri


def spark_uri(uri: str) -> str:
    """The location as Spark is given it (``Location.spark``)."""
    return parse(uri).spark


def arrow_filesystem(
    uri: str, *, what: str = "path", error: ErrorFactory = ValueError
) -> tuple[Any, str]:
    """``(pyarrow.fs filesystem, path in it)`` of a location (made at first use, cached).
    A location pyarrow cannot open raises ``error`` naming ``what``; I/O errors (a
    missing bucket, no network, no credentials) are pyarrow's ``OSError``."""
    loc = parse(uri, what=what, error=error)
    try:
        return loc.filesystem()
    except OSError:
        raise
    except Exception as ex:  # pyarrow's ArrowInvalid: a bad option, a store it lacks
        raise error(f"{what}={uri!r}: pyarrow.fs cannot open it ({ex})") from ex


@functools.cache
def _local() -> Any:
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def _endpoint_env(arrow: str) -> tuple[str | None, ...]:
    """The environment pyarrow reads an S3 endpoint from (part of the cache key)."""
    if arrow != "s3":
        return ()
    return (os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL"))


@functools.lru_cache(maxsize=64)
def _store(arrow: str, authority: str, query: str, env: tuple[str | None, ...]) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    host = authority or "default"  # hdfs:///x: the namenode of fs.defaultFS, as in Hadoop
    fs, root = pafs.FileSystem.from_uri(f"{arrow}://{host}/" + (f"?{query}" if query else ""))
    return fs, str(root)
