"""The JVM class archive ``Session.local`` maps (``spark_ops._class_archive``): the suite's
session made one in the background (its cache directory is the suite's own, set in
conftest.py), a later driver maps it and answers the same, and a file that could crash
a JVM that mapped it (cut short, someone else's, writable by others, a link) or a user's
own CDS options are never combined with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spark_ops import _class_archive as ca

MAGIC = (0xF00BABA8).to_bytes(4, "little")


def _archive(directory: Path, key: str, body: bytes = MAGIC + b"\0" * 60, *, size=None) -> Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{key}-{len(body) if size is None else size}.jsa"
    path.write_bytes(body)
    path.chmod(0o600)
    return path


def test_a_complete_private_archive_is_found(tmp_path):
    d = tmp_path / "jvm"
    good = _archive(d, "k1")
    assert ca.usable_archive(d, "k1") == good
    assert ca.usable_archive(d, "other") is None


@pytest.mark.parametrize(
    "spoil",
    [
        "cut short",
        "longer than its name",
        "no magic",
        "group-writable",
        "a symlink",
        "directory readable by others",
    ],
)
def test_an_archive_that_could_crash_or_subvert_the_jvm_is_not_used(tmp_path, spoil):
    d = tmp_path / "jvm"
    path = _archive(d, "k1")
    if spoil == "cut short":  # a write that ended early: the JVM would die of SIGBUS
        path.write_bytes(path.read_bytes()[:20])
    elif spoil == "longer than its name":
        path.write_bytes(path.read_bytes() + b"\0")
    elif spoil == "no magic":
        path.write_bytes(b"\0" * 64)
    elif spoil == "group-writable":
        path.chmod(0o620)
    elif spoil == "a symlink":
        real = tmp_path / "elsewhere.jsa"
        real.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(real)
    else:
        d.chmod(0o755)
    assert ca.usable_archive(d, "k1") is None


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_someone_elses_archive_is_not_used(tmp_path):
    d = tmp_path / "jvm"
    path = _archive(d, "k1")
    os.chown(path, 12345, 12345)
    assert ca.usable_archive(d, "k1") is None


def test_the_users_own_cds_options_or_the_switch_turn_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_ITER_CACHE_DIR", str(tmp_path))
    conf = {"spark.master": "local[1]"}
    key = ca.archive_key(conf)
    assert key is not None
    assert ca.java_options(conf) == (None, key)  # none yet: one to make
    _archive(tmp_path / "jvm", key)
    options, missing = ca.java_options(conf)
    assert missing is None and f"-XX:SharedArchiveFile={tmp_path / 'jvm'}" in options
    # the user's own options stay, first, and the key follows them
    mine = {**conf, "spark.driver.extraJavaOptions": "-Dmine=1"}
    assert ca.archive_key(mine) != key
    for own in ("-Xshare:off", "-XX:SharedArchiveFile=/x.jsa", "-XX:ArchiveClassesAtExit=/x"):
        assert ca.java_options({**conf, "spark.driver.extraJavaOptions": own}) == (None, None)
    monkeypatch.setenv("HYBRID_ITER_CLASS_ARCHIVE", "0")
    assert ca.java_options(conf) == (None, None)


def test_the_sessions_archive_is_mapped_by_the_next_driver_which_answers_the_same(session):
    wanted = session._class_archive
    warm = session._warm
    if wanted is not None:  # the suite's session found none: its warm-up is making it
        assert warm is not None and warm._creator is not None
        assert warm._creator.wait(900) == 0
    conf = {"spark.master": "local[1]"}
    options, missing = ca.java_options(conf)
    assert missing is None and options is not None
    code = (
        "import os, sys\n"
        "from pyspark.sql import SparkSession\n"
        "from spark_ops._class_archive import java_options\n"
        "conf = {'spark.master': 'local[1]', 'spark.ui.enabled': 'false',\n"
        "        'spark.driver.host': '127.0.0.1', 'spark.driver.bindAddress': '127.0.0.1'}\n"
        "options, _ = java_options(conf)\n"
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
