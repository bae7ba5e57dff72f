"""A class-data-sharing archive for the local Spark driver JVMs ``Session.local`` starts.

Most of a local driver's start is its JVM loading, parsing and verifying the same
~15,000 classes every time. A JDK 13+ dynamic CDS archive keeps them ready to map: on
the 2-core machine, ``getOrCreate`` took 6.8 s and a first ``count`` 3.2 s without one,
3.9 s and 1.5 s with one.

* Key: the Java that spark-submit runs (``JAVA_HOME`` or ``java`` on the ``PATH``), its
  modules file, Spark's jars (names, sizes, times) and the conf that changes the
  driver's classpath or JVM options. One archive per key, in ``jvm/`` of the cache root:
  ``$HYBRID_ITER_CACHE_DIR`` or ``$XDG_CACHE_HOME/hybrid_iter`` or
  ``~/.cache/hybrid_iter``.
* Use (``java_options``): an archive of the key that passes the checks below gives
  ``-XX:SharedArchiveFile``; none gives nothing (the JVM starts as it always did). A JVM
  that finds the archive does not fit (another classpath, a JDK update) starts without
  it.
* Making one (``Creator``): a background process at the lowest CPU priority starts a
  driver with the same key's conf, runs a small query (SQL, a shuffle, an Arrow map)
  and exits; its JVM writes what it loaded to a temporary file at exit
  (``-XX:ArchiveClassesAtExit``). Only when that JVM exited with 0 and the file starts
  with the archive's magic is it renamed into place, as ``<key>-<bytes>-<sha256>.jsa``.
  One creator per key at a time (a lock file); the two newest archives are kept.
* Never a file that could crash the JVM: a JVM mapping a damaged archive dies of SIGBUS
  before its first line of Java (tried: 256 bytes flipped in the header, a file cut
  short). So every use first checks the size and the SHA-256 that the name records.
  Reading 160 MB whole takes 0.17 s on a quiet 2-core machine (0.5-0.8 s loaded), so it
  is read whole only when it changed since it last was: a side file
  ``<name>.checked`` records what any write, truncation, rename or copy over it changes
  (device, inode, size, modification and change times; ``_intact``). One that differs
  is set aside (renamed ``<name>.damaged-<unix time>``, the newest such kept for a
  look) and the session is told (``Choice.notes``). What slips past the checks (a
  change between the check and the mapping, a JVM bug) is caught by the session: a JVM
  launched with an archive that exits before its gateway port (``gateway_exited``) is
  launched once more without it, and the archive set aside if that one starts.
* Trust: an archive is code the JVM runs. Every folder on the way to it, from ``/``,
  must be this user's or root's and writable by no one else unless sticky (as ssh's
  StrictModes; ``folder_problem``), ``jvm/`` this user's and private (0700), the archive
  this user's regular file, writable by no one else; anything else is not used, and no
  archive is made there (the session warns once, naming the folder and the fix).
* Off: ``HYBRID_ITER_CLASS_ARCHIVE=0``, or an ``-Xshare``, ``SharedArchiveFile`` or
  ``ArchiveClassesAtExit`` option of the user's own in ``spark.driver.extraJavaOptions``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import storage_uri

__all__ = [
    "Choice",
    "Creator",
    "archive_dir",
    "archive_key",
    "cache_root",
    "crashed",
    "folder_problem",
    "gateway_exited",
    "java_options",
    "set_aside",
    "usable_archive",
]

#: the first four bytes of a JDK CDS archive (little-endian 0xf00baba8)
_MAGIC = (0xF00BABA8).to_bytes(4, "little")
#: an archive's name: its key, its size in bytes and its SHA-256
_NAME = re.compile(r"^(?P<key>[0-9a-f]+)-(?P<size>[0-9]+)-(?P<sha256>[0-9a-f]{64})\.jsa$")
#: what a damaged archive's name gets (never matched as an archive again)
_DAMAGED = ".damaged-"
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
#: an archive changed less than this ago is read whole at every use (``_write_stamp``)
_RACY_SECONDS = 2.0
#: folders whose problem this process has told of already (once each)
_TOLD: set[str] = set()


@dataclass
class Choice:
    """What ``java_options`` found for a driver's conf."""

    #: the driver's ``spark.driver.extraJavaOptions`` with the archive to map (None:
    #: leave the conf as it is)
    options: str | None = None
    #: the key to make an archive for (None: there is one, or none can be made)
    key: str | None = None
    #: the archive ``options`` maps
    archive: Path | None = None
    #: what the user should be told (an archive set aside, an unsafe folder)
    notes: list[str] = field(default_factory=list)


def _enabled(conf: Mapping[str, str]) -> bool:
    if os.environ.get("HYBRID_ITER_CLASS_ARCHIVE", "1").strip().lower() in ("0", "off", "false"):
        return False
    own = conf.get("spark.driver.extraJavaOptions", "")
    return not any(word in own for word in _USERS_OWN)


def cache_root() -> Path:
    base = os.environ.get("HYBRID_ITER_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "hybrid_iter"


def archive_dir() -> Path:
    return cache_root() / "jvm"


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


def _folders_to(directory: Path) -> list[Path]:
    """Every folder the kernel passes through to reach ``directory``, from ``/``: the
    prefixes of its absolute path (a link among them is followed where it points: the
    folder holding the link is the one before it) and of its real path."""
    out: list[Path] = []
    for path in (Path(os.path.abspath(directory)), Path(os.path.realpath(directory))):
        for folder in (*reversed(path.parents), path):
            if folder not in out:
                out.append(folder)
    return out


def folder_problem(directory: Path) -> str | None:
    """Why someone else could change what ``directory`` holds, naming the folder and the
    fix; None when no one can. Every folder on the way (from ``/``) must be this user's
    or root's and writable by no one else unless sticky (like ``/tmp``), and
    ``directory`` this user's and private (0700), not a link. Folders not made yet are
    no problem (they are made private)."""
    uid = os.getuid()
    itself = (Path(os.path.abspath(directory)), Path(os.path.realpath(directory)))
    for folder in _folders_to(directory):
        if folder in itself:
            continue
        try:
            st = os.stat(folder)
        except OSError:
            continue
        if st.st_uid not in (uid, 0):
            return (
                f"folder {folder} belongs to user id {st.st_uid}, neither you ({uid}) nor "
                f"root: set HYBRID_ITER_CACHE_DIR to a folder of your own"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (
                f"folder {folder} can be written by others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, no sticky bit): chmod go-w {folder}, or "
                f"set HYBRID_ITER_CACHE_DIR to a private folder"
            )
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as ex:
        return f"folder {directory} cannot be read ({ex})"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return (
            f"{directory} is not a folder of yours (a link, a file or another user's): "
            f"remove it (a session makes it again)"
        )
    if st.st_mode & 0o077:
        return (
            f"folder {directory} is open to others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"chmod 700 {directory}"
        )
    return None


def _make_private_folders(directory: Path) -> None:
    """``directory`` and the folders above it that are missing, each made 0700."""
    missing = []
    folder = Path(os.path.abspath(directory))
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)


def _sha256(path: Path) -> str:
    """The file's SHA-256, read (never mapped: a file cut short meanwhile would end this
    process with SIGBUS)."""
    h = hashlib.sha256()
    buffer = bytearray(4 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    """The side file saying ``path`` was read whole and matched its digest: its
    identity then, and (its time) when the archive was last used."""
    return path.with_name(f"{path.name}.checked")


def _identity(st: os.stat_result) -> str:
    """What any write, truncation, rename or copy over a file changes (the change time
    cannot be set back without root)."""
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def _write_stamp(path: Path) -> None:
    """Record ``path`` as read whole and intact, unless it changed less than
    ``_RACY_SECONDS`` ago: file times come from a coarse clock, and a change right after
    this one could keep them (git's "racily clean" files); it is read whole again then."""
    st = os.stat(path)
    if time.time() - st.st_ctime < _RACY_SECONDS:
        return
    with storage_uri.atomic_output(_stamp(path)) as f:
        f.write(_identity(st).encode())


def _intact(path: Path, digest: str) -> bool:
    """Whether ``path`` holds what its ``digest`` says: unchanged since it was last
    read whole (its stamp), else read whole now (0.17 s for 160 MB on a quiet 2-core
    machine) and stamped."""
    with contextlib.suppress(OSError):
        if _stamp(path).read_text() == _identity(os.stat(path)):
            return True
    if _sha256(path) != digest:
        return False
    with contextlib.suppress(OSError):
        _write_stamp(path)
    return True


def _last_used(path: Path) -> float:
    for p in (_stamp(path), path):
        with contextlib.suppress(OSError):
            return p.stat().st_mtime
    return 0.0


def set_aside(path: Path) -> Path | None:
    """Rename a damaged archive so that it is never mapped again (removed if it cannot
    be renamed): its new path, None when it was removed or is gone."""
    with contextlib.suppress(OSError):
        _stamp(path).unlink()
    moved = path.with_name(f"{path.name}{_DAMAGED}{int(time.time())}")
    try:
        os.replace(path, moved)
        return moved
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _set_aside_note(path: Path, what: str) -> str:
    """Set ``path`` aside; what to tell the user (``what`` is wrong with it)."""
    moved = set_aside(path)
    where = f"moved to {moved}" if moved is not None else "removed"
    return f"the JVM class archive {path} {what}: {where}, never to be used again"


def usable_archive(directory: Path, key: str, notes: list[str] | None = None) -> Path | None:
    """The newest archive of ``key`` in ``directory`` that is this user's regular file,
    writable by no one else, as long and with the SHA-256 its name says, starting with
    the magic. One whose size or digest differs is set aside (said in ``notes``)."""
    if folder_problem(directory) is not None or not directory.is_dir():
        return None
    found: list[tuple[Path, str]] = []
    for path in directory.glob(f"{key}-*.jsa"):
        m = _NAME.match(path.name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (
            m is None
            or m["key"] != key
            or not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.getuid()
            or st.st_mode & 0o022
        ):
            continue
        try:
            with open(path, "rb") as f:
                magic = f.read(4) == _MAGIC
        except OSError:
            continue
        if st.st_size != int(m["size"]):
            wrong = f"holds {st.st_size} bytes, not the {m['size']} its name records"
        elif not magic:
            wrong = "does not start with the archive's magic"
        else:
            found.append((path, m["sha256"]))
            continue
        said = _set_aside_note(path, wrong)
        if notes is not None:
            notes.append(said)
    for path, digest in sorted(found, key=lambda f: _last_used(f[0]), reverse=True):
        try:
            if _intact(path, digest):
                return path
        except OSError:
            continue
        said = _set_aside_note(path, "does not match the SHA-256 its name records")
        if notes is not None:
            notes.append(said)
    return None


def java_options(conf: Mapping[str, str]) -> Choice:
    """The archive for a driver of ``conf``: the options that map it, or the key to make
    one for (see ``Choice``). An unsafe folder on the way (``folder_problem``) gives
    neither, and a note the first time in this process."""
    if not _enabled(conf):
        return Choice()
    key = archive_key(conf)
    if key is None:
        return Choice()
    directory = archive_dir()
    problem = folder_problem(directory)
    if problem is not None:
        first = problem not in _TOLD
        _TOLD.add(problem)
        told = f"no JVM class archive is used or made in {directory}: {problem}"
        return Choice(notes=[told] if first else [])
    notes: list[str] = []
    found = usable_archive(directory, key, notes)
    instead = (
        "this session's JVM starts without an archive (a session's warm-up makes a new one)"
        if found is None
        else f"this session's JVM maps {found} instead"
    )
    notes = [f"{note}; {instead}" for note in notes]
    if found is None:
        return Choice(key=key, notes=notes)
    with contextlib.suppress(OSError):
        os.utime(_stamp(found))  # the last used are the ones kept
    own = conf.get("spark.driver.extraJavaOptions", "")
    options = f"{own} {_QUIET} -XX:SharedArchiveFile={found}".strip()
    return Choice(options=options, archive=found, notes=notes)


def gateway_exited(ex: BaseException) -> bool:
    """PySpark's error for a JVM that exited before it sent its gateway port (its error
    class, not its text)."""
    from pyspark.errors import PySparkRuntimeError

    if not isinstance(ex, PySparkRuntimeError):
        return False
    # getCondition from Spark 4.0 (getErrorClass warns there), getErrorClass before
    condition = getattr(ex, "getCondition", None) or ex.getErrorClass
    return bool(condition() == "JAVA_GATEWAY_EXITED")


def crashed(archive: Path, since: float) -> str:
    """Set aside ``archive``, which a JVM launched at ``since`` (``time.time()``) with it
    died of (``gateway_exited``) where one launched without it started: what to tell the
    user, with the JVM's crash report if it left one in the working directory."""
    report = ""
    with contextlib.suppress(OSError):
        for path in Path.cwd().glob("hs_err_pid*.log"):
            if path.stat().st_mtime >= since:
                with open(path, "rb") as f:
                    if str(archive).encode() in f.read(16384):
                        report = f" (its crash report: {path})"
                        break
    what = "crashed the driver JVM that mapped it: the JVM exited before its gateway port"
    said = _set_aside_note(archive, what + report)
    return (
        f"{said}; this session started its JVM once more, without it, and goes on (a "
        f"session's warm-up makes a new one)"
    )


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
    """Keep the ``_KEEP`` last used archives and the newest damaged one; drop files
    named as no archive is (an earlier naming), stamps without their archive and
    temporary files whose writer is gone."""
    named = [p for p in directory.glob("*-*.jsa") if _NAME.match(p.name)]
    doomed = sorted(named, key=_last_used, reverse=True)[_KEEP:]
    doomed += [_stamp(p) for p in doomed]
    doomed += [p for p in directory.glob("*-*.jsa") if not _NAME.match(p.name)]
    damaged = directory.glob(f"*.jsa{_DAMAGED}*")
    doomed += sorted(damaged, key=lambda p: p.stat().st_mtime, reverse=True)[1:]
    doomed += [p for p in directory.glob("*.jsa.checked") if not p.with_suffix("").exists()]
    for old in doomed:
        with contextlib.suppress(OSError):
            old.unlink()
    for tmp in directory.iterdir():
        pid = storage_uri.writer_pid(tmp.name)
        if pid is None and tmp.name.endswith(".tmp"):  # <key>.<pid>.tmp: an older naming
            with contextlib.suppress(IndexError, ValueError):
                pid = int(tmp.name.split(".")[1])
        if pid is not None and not storage_uri.process_running(pid):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _create(key: str, keyed: dict[str, str]) -> int:
    """The creator's body: returns 0 when an archive of ``key`` is in place."""
    os.nice(19)  # the user's work first
    directory = archive_dir()
    with contextlib.suppress(OSError):
        _make_private_folders(directory)
    if folder_problem(directory) is not None or not directory.is_dir():
        return 2
    with open(directory / f"{key}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # another process is making it
        if usable_archive(directory, key) is not None:
            return 0
        _sweep(directory)
        # the JVM writes the archive under a temporary name; only a whole one is moved
        # into place, under a name that records its size and digest
        tmp = Path(storage_uri.temporary_path(directory / f"{key}.jsa"))
        rc = _run_driver(keyed, tmp)
        try:
            with open(tmp, "rb") as f:
                good = rc == 0 and f.read(4) == _MAGIC
            if good:
                os.chmod(tmp, 0o600)
                path = directory / f"{key}-{tmp.stat().st_size}-{_sha256(tmp)}.jsa"
                os.replace(tmp, path)
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
