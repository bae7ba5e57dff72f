"""``storage_uri``'s files written whole (``atomic_output``) and the test of whether the
process writing one still runs (``process_running``): the one rule every writer of ours
uses, locally and through ``pyarrow.fs``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest

import storage_uri
from spark_ops import _class_archive as ca


@pytest.fixture(params=["local", "pyarrow"])
def fs(request):
    return None if request.param == "local" else pafs.LocalFileSystem()


def test_a_file_appears_whole_and_replaces_the_previous_one(tmp_path, fs):
    path = str(tmp_path / "a" / "f.bin")
    with storage_uri.atomic_output(path, fs=fs, parents=True) as f:
        f.write(b"first")
        assert not os.path.exists(path)  # nothing under the final name while written
    with storage_uri.atomic_output(path, fs=fs) as f:
        f.write(b"second")
    assert open(path, "rb").read() == b"second"
    assert os.listdir(tmp_path / "a") == ["f.bin"]


def test_a_block_that_raises_leaves_the_previous_file(tmp_path, fs):
    path = str(tmp_path / "f.bin")
    with storage_uri.atomic_output(path, fs=fs) as f:
        f.write(b"kept")
    with pytest.raises(RuntimeError), storage_uri.atomic_output(path, fs=fs) as f:
        f.write(b"half")
        raise RuntimeError("the writer failed")
    assert open(path, "rb").read() == b"kept"
    (tmp,) = [n for n in os.listdir(tmp_path) if n != "f.bin"]
    assert tmp.startswith(".f.bin.tmp-") and storage_uri.writer_pid(tmp) == os.getpid()


def test_without_parents_a_missing_folder_is_an_error(tmp_path, fs):
    with pytest.raises(OSError), storage_uri.atomic_output(str(tmp_path / "no" / "f"), fs=fs):
        pass


def test_a_temporary_name_is_hidden_beside_its_file_and_names_its_writer():
    tmp = storage_uri.temporary_path("/x/y/part-00001.parquet")
    folder, name = tmp.rsplit("/", 1)
    assert folder == "/x/y" and name.startswith(".part-00001.parquet.tmp-")
    assert storage_uri.writer_pid(name) == os.getpid()
    assert tmp != storage_uri.temporary_path("/x/y/part-00001.parquet")
    for other in ("part-00001.parquet", "a1.123.tmp", ".a.tmp-12-short", "x.tmp-1-" + "0" * 32):
        assert storage_uri.writer_pid(other) is None


def test_a_process_runs_until_it_exits_and_a_zombie_does_not():
    assert storage_uri.process_running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while storage_uri.process_running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling the child's exit (not reaped: a zombie), bounded
    assert not storage_uri.process_running(child.pid)
    child.wait()
    assert not storage_uri.process_running(child.pid)


def test_the_class_archive_sweep_drops_temporaries_whose_writer_is_gone(tmp_path):
    d = tmp_path / "jvm"
    d.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    mine = d / f".a1.jsa.tmp-{os.getpid()}-{'a' * 32}"
    gone = d / f".a1.jsa.tmp-{child.pid}-{'b' * 32}"
    older = d / f"a1.{child.pid}.tmp"  # an older release's naming
    for path in (mine, gone, older):
        path.write_bytes(b"x")
    ca._sweep(d)
    assert sorted(p.name for p in d.iterdir()) == [mine.name]
