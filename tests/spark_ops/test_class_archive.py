"""The JVM class archive ``Session.local`` maps (``spark_ops._class_archive``): the suite's
session made one in the background (its cache directory is the suite's own, set in
conftest.py), a later driver maps it and answers the same, and a file that could crash
a JVM that mapped it (cut short, its bytes changed, someone else's, writable by others,
a link, under a folder others can change) or a user's own CDS options are never
combined with it. A damaged archive never stops a session: two sessions in a row, in
processes of their own (``class_archive_job.py``), start with it damaged, the first
setting it aside with a warning naming it (each the Spark half of ``Session.local``, which
alone chooses and maps the archive; the Ray beside it takes no part)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fresh_process import run_job

from spark_ops import _class_archive as ca

pytestmark = pytest.mark.integration  # each test starts its own Spark or Ray

MAGIC = (0xF00BABA8).to_bytes(4, "little")


def _name(key: str, body: bytes, size: int | None = None) -> str:
    n = len(body) if size is None else size
    return f"{key}-{n}-{hashlib.sha256(body).hexdigest()}.jsa"


def _archive(directory: Path, key: str, body: bytes = MAGIC + b"\0" * 60) -> Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / _name(key, body)
    path.write_bytes(body)
    path.chmod(0o600)
    return path


def test_a_complete_private_archive_is_found(tmp_path):
    d = tmp_path / "jvm"
    good = _archive(d, "a1")
    assert ca.usable_archive(d, "a1") == good
    assert ca.usable_archive(d, "b2") is None


@pytest.mark.parametrize(
    "spoil",
    [
        "cut short",
        "longer than its name",
        "no magic",
        "a byte changed in place",
        "group-writable",
        "a symlink",
        "directory readable by others",
    ],
)
def test_an_archive_that_could_crash_or_subvert_the_jvm_is_not_used(tmp_path, spoil):
    d = tmp_path / "jvm"
    path = _archive(d, "a1")
    assert ca.usable_archive(d, "a1") == path  # read whole once: its digest matched
    if spoil == "cut short":  # a write that ended early: the JVM would die of SIGBUS
        path.write_bytes(path.read_bytes()[:20])
    elif spoil == "longer than its name":
        path.write_bytes(path.read_bytes() + b"\0")
    elif spoil == "no magic":
        path.write_bytes(b"\0" * 64)
    elif spoil == "a byte changed in place":  # same size and magic: only the digest tells
        with open(path, "r+b") as f:
            f.seek(40)
            f.write(b"\1")
    elif spoil == "group-writable":
        path.chmod(0o620)
    elif spoil == "a symlink":
        real = tmp_path / "elsewhere.jsa"
        real.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(real)
    else:
        d.chmod(0o755)
    notes: list[str] = []
    assert ca.usable_archive(d, "a1", notes) is None
    if spoil in ("cut short", "longer than its name", "no magic", "a byte changed in place"):
        # set aside under a name no use matches, and said
        (moved,) = d.glob(f"{path.name}.damaged-*")
        assert not path.exists() and len(notes) == 1 and str(path) in notes[0]
        assert str(moved) in notes[0]


def test_an_archive_renamed_to_the_size_it_was_cut_to_is_set_aside(tmp_path):
    d = tmp_path / "jvm"
    path = _archive(d, "a1", MAGIC + bytes(range(200)))
    short = d / _name("a1", path.read_bytes(), size=100)  # the old digest, the new size
    short.write_bytes(path.read_bytes()[:100])
    short.chmod(0o600)
    path.unlink()
    notes: list[str] = []
    assert ca.usable_archive(d, "a1", notes) is None
    assert not short.exists() and "SHA-256" in notes[0] and str(short) in notes[0]


def test_the_sweep_keeps_the_last_used_archives_and_the_newest_damaged_one(tmp_path):
    d = tmp_path / "jvm"
    archives = [_archive(d, "a1", MAGIC + bytes([i]) * 60) for i in range(3)]
    for age, path in zip((300, 100, 200), archives):  # the first used longest ago
        os.utime(path, (time.time() - age, time.time() - age))
    ca._stamp(archives[0]).write_text("")  # used just now: its stamp's time says so
    damaged = [d / f"a1-9-{'0' * 64}.jsa.damaged-{t}" for t in (1, 2)]
    for age, path in zip((50, 10), damaged):
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age, time.time() - age))
    earlier = d / "a1-64.jsa"  # the naming before the digest: never used again
    earlier.write_bytes(MAGIC)
    orphan = d / f"a1-1-{'1' * 64}.jsa.checked"
    orphan.write_text("")
    ca._sweep(d)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [archives[0].name, ca._stamp(archives[0]).name, archives[1].name, damaged[1].name]
    )


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_someone_elses_archive_is_not_used(tmp_path):
    d = tmp_path / "jvm"
    path = _archive(d, "a1")
    os.chown(path, 12345, 12345)
    assert ca.usable_archive(d, "a1") is None


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757], ids=["0777", "0775", "0757"])
def test_no_archive_is_used_or_made_under_a_folder_others_can_write(tmp_path, monkeypatch, mode):
    open_folder = tmp_path / "shared"
    root = open_folder / "me" / "cache"
    monkeypatch.setenv("HYBRID_ITER_CACHE_DIR", str(root))
    conf = {"spark.master": "local[1]"}
    key = ca.archive_key(conf)
    assert key is not None
    _archive(root / "jvm", key)
    assert ca.java_options(conf).archive is not None
    open_folder.chmod(mode)  # a parent of the cache root, not the archive's own folder
    choice = ca.java_options(conf)
    assert choice.options is None and choice.archive is None
    assert choice.key is None  # not made there either
    (note,) = choice.notes
    assert f"folder {open_folder} can be written by others" in note
    assert f"chmod go-w {open_folder}" in note
    assert ca.java_options(conf).notes == []  # said once
    open_folder.chmod(mode | 0o1000)  # sticky, as /tmp: others cannot replace our folder
    assert ca.java_options(conf).archive is not None


def test_the_folders_of_the_cache_root_are_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_ITER_CACHE_DIR", str(tmp_path / "a" / "b"))
    old = os.umask(0o002)  # a umask that would leave new folders group-writable
    try:
        ca._make_private_folders(ca.archive_dir())
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "jvm"):
        assert folder.stat().st_mode & 0o777 == 0o700
    assert ca.folder_problem(ca.archive_dir()) is None


def test_the_users_own_cds_options_or_the_switch_turn_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_ITER_CACHE_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    conf = {"spark.master": "local[1]"}
    key = ca.archive_key(conf)
    assert key is not None
    assert ca.java_options(conf) == ca.Choice(key=key)  # none yet: one to make
    _archive(tmp_path / "jvm", key)
    choice = ca.java_options(conf)
    assert choice.key is None
    assert f"-XX:SharedArchiveFile={tmp_path / 'jvm'}" in str(choice.options)
    # the user's own options stay, first, and the key follows them
    mine = {**conf, "spark.driver.extraJavaOptions": "-Dmine=1"}
    assert ca.archive_key(mine) != key
    for own in ("-Xshare:off", "-XX:SharedArchiveFile=/x.jsa", "-XX:ArchiveClassesAtExit=/x"):
        assert ca.java_options({**conf, "spark.driver.extraJavaOptions": own}) == ca.Choice()
    monkeypatch.setenv("HYBRID_ITER_CLASS_ARCHIVE", "0")
    assert ca.java_options(conf) == ca.Choice()


@pytest.fixture(scope="module")
def made_archive(session) -> Path:
    """The archive the suite's session made (or found) for a ``Session.local(1)``."""
    wanted = session._class_archive
    warm = session._warm
    if wanted is not None:  # the suite's session found none: its warm-up is making it
        assert warm is not None and warm._creator is not None
        assert warm._creator.wait(900) == 0
    key = ca.archive_key({})
    assert key is not None
    found = ca.usable_archive(ca.archive_dir(), key)
    assert found is not None
    return found


def _damage(made: Path, jvm: Path, how: str) -> Path:
    body = bytearray(made.read_bytes())
    key = made.name.split("-")[0]
    if how == "bytes flipped":  # size and magic unchanged, its name the good one's
        body[64:320] = bytes(b ^ 0xFF for b in body[64:320])
        path = jvm / made.name
    elif how == "cut short, renamed to its size":
        path = jvm / _name(key, bytes(body), size=len(body) // 2)
        body = body[: len(body) // 2]
    else:  # its name matching what is left: only the JVM finds out (SIGBUS as it maps it)
        body = body[: len(body) // 2]
        path = jvm / _name(key, bytes(body))
    path.write_bytes(body)
    path.chmod(0o600)
    return path


#: the suite's archive may still be in the making (minutes on a loaded machine), then
#: sessions start, each in a process of its own
SESSIONS_TIMEOUT = 1800


@pytest.mark.timeout(SESSIONS_TIMEOUT)
@pytest.mark.parametrize(
    "how", ["bytes flipped", "cut short, renamed to its size", "cut short, its name matching"]
)
def test_a_damaged_archive_is_set_aside_and_the_sessions_after_it_start(
    made_archive, tmp_path, how
):
    cache = tmp_path / "cache"
    jvm = cache / "jvm"
    jvm.mkdir(mode=0o700, parents=True)
    cache.chmod(0o700)
    damaged = _damage(made_archive, jvm, how)
    env = {"HYBRID_ITER_CACHE_DIR": str(cache)}
    # the first session sets the file aside and says so; the next starts as if it never
    # was (a third would repeat the second: no warm-up makes a new archive here)
    for i in range(2):
        # in tmp_path: where a JVM that crashed writes its hs_err_pid file
        # Spark's half of Session.local(1): where the archive is chosen and set aside
        got = run_job("class_archive_job", "spark", timeout=600, extra_env=env, cwd=tmp_path)
        assert got["count"] == 100  # the session works
        # the damaged file is never what the session's JVM maps
        assert not any(m.startswith(str(damaged)) for m in got["mapped"]), got
        assert got["option"] == [] and got["mapped"] == [], got
        assert got["remakes"] is True  # its warm-up would make a new one
        if i == 0:
            (said,) = got["warnings"]
            (moved,) = jvm.glob(f"{damaged.name}.damaged-*")
            assert str(damaged) in said and str(moved) in said, said
            if how == "cut short, its name matching":
                assert "crashed the driver JVM" in said and "without it" in said
            else:
                assert "does not match the SHA-256 its name records" in said
        else:
            assert got["warnings"] == [], got
        assert not damaged.exists()


@pytest.mark.timeout(SESSIONS_TIMEOUT)
def test_a_session_under_a_folder_others_can_write_maps_nothing_and_says_so(made_archive, tmp_path):
    shared = tmp_path / "shared"
    jvm = shared / "cache" / "jvm"
    jvm.mkdir(mode=0o700, parents=True)
    (shared / "cache").chmod(0o700)
    good = jvm / made_archive.name
    good.write_bytes(made_archive.read_bytes())
    good.chmod(0o600)
    shared.chmod(0o777)
    env = {"HYBRID_ITER_CACHE_DIR": str(shared / "cache")}
    got = run_job("class_archive_job", "local", timeout=600, extra_env=env, cwd=tmp_path)
    assert got["count"] == 100 and got["mapped"] == [] and got["option"] == []
    (said,) = got["warnings"]
    assert f"chmod go-w {shared}" in said
    assert got["remakes"] is False  # nor made there
    assert good.exists()  # not ours to move: the folder is the problem


@pytest.mark.timeout(SESSIONS_TIMEOUT)
def test_the_sessions_archive_is_mapped_by_the_next_driver_which_answers_the_same(
    made_archive,
):
    conf = {"spark.master": "local[1]"}
    choice = ca.java_options(conf)
    assert choice.key is None and choice.options is not None and choice.notes == []
    code = (
        "import os, sys\n"
        "from pyspark.sql import SparkSession\n"
        "from spark_ops._class_archive import java_options\n"
        "conf = {'spark.master': 'local[1]', 'spark.ui.enabled': 'false',\n"
        "        'spark.driver.host': '127.0.0.1', 'spark.driver.bindAddress': '127.0.0.1'}\n"
        "options = java_options(conf).options\n"
        "b = SparkSession.builder\n"
        "for k, v in {**conf, 'spark.driver.extraJavaOptions': options}.items():\n"
        "    b = b.config(k, v)\n"
        "spark = b.getOrCreate()\n"
        "n = spark.range(0, 1000, 1, 2).selectExpr('id % 7 AS k').groupBy('k').count()\n"
        "got = sorted((r.k, r['count']) for r in n.collect())\n"
        "pid = spark.sparkContext._gateway.proc.pid\n"
        "cmd = open(f'/proc/{pid}/cmdline').read().split(chr(0))\n"
        "print('RESULT', got, any(a.startswith('-XX:SharedArchiveFile=') for a in cmd))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    expected = sorted((k, len(range(k, 1000, 7))) for k in range(7))
    assert line == f"RESULT {expected} True"
