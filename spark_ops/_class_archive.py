"""A class-data-sharing archive for the local Spark driver JVMs ``Session.local`` starts.

Most of a local driver's start is its JVM loading, parsing and verifying the same
~15,000 classes every time. A JDK 13+ dynamic CDS archive keeps them ready to map: on
the 2-core machine, ``getOrCreate`` took 6.8 s and a first ``count`` 3.2 s without one,
3.9 s and 1.5 s with one.

* Key: the Java that spark-submit runs (``JAVA_HOME`` or ``java`` on the ``PATH``), its
  modules file, Spark's jars (names, sizes, times) and the conf that changes the
  driver's classpath or JVM options. One archive per key, in
  ``$HYBRID_ITER_CACHE_DIR`` or ``$XDG_CACHE_HOME/hybrid_iter`` or
  ``~/.cache/hybrid_iter``, under ``jvm/``.
* Use (``java_options``): an archive of the key that passes the checks below gives
  ``-XX:SharedArchiveFile``; none gives nothing (the JVM starts as it always did). A JVM
  that finds the archive does not fit (another classpath, a JDK update) starts without
  it.
* Making one (``Creator``): a background process at the lowest CPU priority starts a
  driver with the same key's conf, runs a small query (SQL, a shuffle, an Arrow map)
  and exits; its JVM writes what it loaded to a temporary file at exit
  (``-XX:ArchiveClassesAtExit``). Only when that JVM exited with 0 and the file starts
  with the archive's magic is it renamed into place, as ``<key>-<bytes>.jsa``: a JVM
  mapping a file cut short (a full disk, a kill mid-write) dies of SIGBUS, so the size
  is in the name and checked before every use. One creator per key at a time (a lock
  file); the two newest archives are kept.
* Trust: an archive is code the JVM runs. The directory must be this user's and
  private (0700), the archive this user's regular file, writable by no one else;
  anything else is not used.
* Off: ``HYBRID_ITER_CLASS_ARCHIVE=0``, or an ``-Xshare``, ``SharedArchiveFile`` or
  ``ArchiveClassesAtExit`` option of the user's own in ``spark.driver.extraJavaOptions``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Creator", "archive_dir", "archive_key", "java_options", "usable_archive"]

#: the first four bytes of a JDK CDS archive (little-endian 0xf00baba8)
_MAGIC = (0xF00BABA8).to_bytes(4, "little")
#: the JVM quiet about CDS (an archive that does not fit is not worth a warning)
_QUIET = "-Xlog:cds*=off"
#: for the maker only, whose JDK may predate dynamic archives: a JVM that does not know
#: the option starts anyway (and writes nothing). Never added to a user's driver, where
#: it would hide the user's own mistyped options.
_TOLERANT = "-XX:+IgnoreUnrecognizedVMOptions"
#: conf that changes the driver JVM's classpath or options: part of the key
_KEYED_CONF = (
    "spark.driver.extraClassPath",
    "spark.driver.extraJavaOptions",
    "spark.jars",
    "spark.jars.packages",
)
_USERS_OWN = ("-Xshare", "SharedArchiveFile", "ArchiveClassesAtExit")
_KEEP = 2


def _enabled(conf: Mapping[str, str]) -> bool:
    if os.environ.get("HYBRID_ITER_CLASS_ARCHIVE", "1").strip().lower() in ("0", "off", "false"):
        return False
    own = conf.get("spark.driver.extraJavaOptions", "")
    return not any(word in own for word in _USERS_OWN)


def archive_dir() -> Path:
    base = os.environ.get("HYBRID_ITER_CACHE_DIR")
    if base:
        return Path(base) / "jvm"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "hybrid_iter" / "jvm"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not os.path.exists(found):
        return None
    return Path(os.path.realpath(found))


def _spark_jars() -> Path | None:
    try:
        from pyspark.find_spark_home import _find_spark_home
    except ImportError:  # pragma: no cover - pyspark always ships it
        return None
    jars = Path(_find_spark_home()) / "jars"
    return jars if jars.is_dir() else None


def archive_key(conf: Mapping[str, str]) -> str | None:
    """The key of the archive a driver with ``conf`` can map; None when Java or Spark's
    jars cannot be found (no archive then)."""
    java, jars = _java(), _spark_jars()
    if java is None or jars is None:
        return None
    h = hashlib.sha256()
    modules = java.parent.parent / "lib" / "modules"
    for path in (java, modules):
        with contextlib.suppress(OSError):
            st = path.stat()
            h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    with os.scandir(jars) as it:
        for entry in sorted(it, key=lambda e: e.name):
            st = entry.stat()
            h.update(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for k in _KEYED_CONF:
        h.update(f"{k}={conf.get(k, '')}\n".encode())
    return h.hexdigest()[:24]


def _private_dir(path: Path, *, create: bool) -> bool:
    """Whether ``path`` is a directory of this user's that no one else can write or read
    (created 0700 when ``create``)."""
    if create:
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and (st.st_mode & 0o077) == 0


def usable_archive(directory: Path, key: str) -> Path | None:
    """The newest archive of ``key`` in ``directory`` that is this user's regular file,
    writable by no one else, as long as its name says, starting with the magic."""
    if not _private_dir(directory, create=False):
        return None
    best: tuple[float, Path] | None = None
    for path in directory.glob(f"{key}-*.jsa"):
        try:
            size = int(path.name[len(key) + 1 : -len(".jsa")])
            st = os.lstat(path)
        except (ValueError, OSError):
            continue
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.getuid()
            or st.st_mode & 0o022
            or st.st_size != size
        ):
            continue
        try:
            with open(path, "rb") as f:
                if f.read(4) != _MAGIC:
                    continue
        except OSError:
            continue
        if best is None or st.st_mtime > best[0]:
            best = (st.st_mtime, path)
    return best[1] if best else None


def java_options(conf: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(options, key)``: the driver's ``spark.driver.extraJavaOptions`` with the
    archive to map (None: leave the conf as it is) and the key to make an archive for
    (None: there is one, or none can be made)."""
    if not _enabled(conf):
        return None, None
    key = archive_key(conf)
    if key is None:
        return None, None
    found = usable_archive(archive_dir(), key)
    if found is None:
        return None, key
    with contextlib.suppress(OSError):
        os.utime(found)  # the newest used are the ones kept
    own = conf.get("spark.driver.extraJavaOptions", "")
    return f"{own} {_QUIET} -XX:SharedArchiveFile={found}".strip(), None


class Creator:
    """The background process making the archive of ``key`` (``python -m
    spark_ops._class_archive``); ``stop()`` ends it (and its JVM) if it still runs."""

    def __init__(self, key: str, conf: Mapping[str, str]) -> None:
        self.key = key
        keyed = {k: conf[k] for k in _KEYED_CONF if k in conf}
        env = {**os.environ, "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spark_ops._class_archive", key, json.dumps(keyed)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its JVM and Python workers: one group to end
        )

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what outlived its leader


def _sweep(directory: Path) -> None:
    """Keep the ``_KEEP`` newest archives; drop temporary files whose writer is gone."""
    archives = sorted(directory.glob("*-*.jsa"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in archives[_KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()
    for tmp in directory.glob("*.tmp"):
        try:
            pid = int(tmp.name.split(".")[1])
        except (IndexError, ValueError):
            continue
        if not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                tmp.unlink()


def _create(key: str, keyed: dict[str, str]) -> int:
    """The creator's body: returns 0 when an archive of ``key`` is in place."""
    os.nice(19)  # the user's work first
    directory = archive_dir()
    if not _private_dir(directory, create=True):
        return 2
    with open(directory / f"{key}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # another process is making it
        if usable_archive(directory, key) is not None:
            return 0
        _sweep(directory)
        tmp = directory / f"{key}.{os.getpid()}.tmp"
        rc = _run_driver(keyed, tmp)
        try:
            with open(tmp, "rb") as f:
                good = rc == 0 and f.read(4) == _MAGIC
            if good:
                os.chmod(tmp, 0o600)
                os.replace(tmp, directory / f"{key}-{tmp.stat().st_size}.jsa")
                return 0
        except OSError:
            pass
        with contextlib.suppress(OSError):
            tmp.unlink()
        return 1


def _run_driver(keyed: dict[str, str], tmp: Path) -> int:
    """A local driver that loads what a session's start and first queries load, then
    exits and writes them to ``tmp``: its JVM's exit code."""
    from pyspark.sql import SparkSession

    from ._spark_compat import shut_down_jvm

    own = keyed.get("spark.driver.extraJavaOptions", "")
    builder = SparkSession.builder
    for k, v in {
        **keyed,
        "spark.master": "local[1]",
        "spark.app.name": "hybrid_iter: JVM class archive",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "1",
        "spark.driver.extraJavaOptions": (
            f"{own} {_TOLERANT} {_QUIET} -XX:ArchiveClassesAtExit={tmp}".strip()
        ),
    }.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(0, 1000, 1, 1).selectExpr("id % 7 AS k", "id").groupBy("k").count().collect()
    spark.range(0, 10, 1, 1).mapInArrow(_same, "id long").count()
    code = shut_down_jvm(timeout=3600)  # the JVM writes the archive as it exits
    return -1 if code is None else code


def _same(batches: Any) -> Any:
    yield from batches


if __name__ == "__main__":  # pragma: no cover - the creator process
    sys.exit(_create(sys.argv[1], json.loads(sys.argv[2])))
