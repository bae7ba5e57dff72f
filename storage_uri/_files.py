"""Files written whole or not at all, and whether the process that writes one still runs.

Every file of ours that someone may read while it is being written (checkpoints and
their journal, saved models and their manifests, an online run's outputs and dead
letters, side-input deltas, the JVM class archive and its stamps, test handshakes) is
written under a temporary name beside it, then moved over its final name: a reader sees
the previous file or the new one whole, never a part of it. The rule is written here
once, for ``pyarrow.fs`` locations and for local paths alike.

* ``atomic_output(path, fs=...)``: a binary stream; what the ``with`` block writes
  appears at ``path`` when the block ends without raising (``fs``: a ``pyarrow.fs``
  filesystem and ``path`` a path in it, e.g. from ``arrow_filesystem``; None: a local
  path, through ``os`` alone). A block that raises leaves nothing at ``path`` (its
  temporary file stays behind, as a crashed writer's would).
* ``temporary_path(path)``: the temporary name beside ``path``,
  ``.<name>.tmp-<pid>-<random>``: hidden (Spark, pyarrow datasets and our own listings
  skip a leading dot), unique to its writer, and naming the writing process, so that a
  sweeper can tell an abandoned one (``writer_pid``, ``process_running``).
* ``process_running(pid)``: a local process runs (exists, and is no zombie: one that
  exited and waits to be reaped writes nothing more). Linux's ``/proc``; False without.

Pure Python: ``pyarrow`` is never imported here (a ``pyarrow.fs`` filesystem is passed in).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["atomic_output", "process_running", "temporary_path", "writer_pid"]

_TEMPORARY = re.compile(r"\..+\.tmp-(?P<pid>[0-9]+)-[0-9a-f]{32}")


def temporary_path(path: str | os.PathLike[str]) -> str:
    """Where ``path`` is written before it is moved into place: beside it (same folder,
    same filesystem, so the move is a rename where the filesystem has one), hidden."""
    parent, sep, name = os.fspath(path).rpartition("/")
    return f"{parent}{sep}.{name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"


def writer_pid(name: str) -> int | None:
    """The process that wrote the temporary file ``name`` (a base name made by
    ``temporary_path``), None when it is not one."""
    m = _TEMPORARY.fullmatch(name)
    return int(m["pid"]) if m else None


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str], *, fs: Any = None, parents: bool = False
) -> Iterator[Any]:
    """A binary stream whose bytes appear at ``path`` (replacing what is there) once the
    block ends without raising. ``fs``: the ``pyarrow.fs`` filesystem ``path`` is in
    (None: a local path). ``parents``: create the folders on the way first."""
    path = os.fspath(path)
    tmp = temporary_path(path)
    if fs is None:
        if parents:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    else:
        if parents:
            fs.create_dir(path.rpartition("/")[0], recursive=True)
        with fs.open_output_stream(tmp) as f:
            yield f
        fs.move(tmp, path)


def process_running(pid: int) -> bool:
    """Whether process ``pid`` (of this host) runs: it exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
