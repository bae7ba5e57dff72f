"""Checkpoint files through ``pyarrow.fs``: atomic, checksummed, pruned.

Runs in the Ray coordinator actor (writes) and on the driver (``resume_from`` reads).
One checkpoint is one file ``chk-<epoch:010d>.ckpt`` in the checkpoint directory::

    magic "HICKPT1\\n" | sha256 of the payload (32 bytes) | payload length (8 bytes, LE)
    | payload (pickle of the checkpoint dict)

written to a temporary name and moved into place, so a reader never sees a half-written
checkpoint under a final name (on object stores, where a move is a copy, the checksum
still rejects a torn one). Output records are not in the checkpoint file: each checkpoint
appends the records since the previous one to ``out-<epoch:010d>.pkl``, so the cost of a
checkpoint does not grow with the number of epochs behind it. ``keep_last`` prunes old
checkpoint files (output segments stay: they are the history).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

__all__ = [
    "CheckpointCorrupt",
    "CheckpointStore",
    "LoadedCheckpoint",
    "delete_name",
    "fingerprint_mismatch",
    "list_names",
    "read_record",
    "write_record",
]

_MAGIC = b"HICKPT1\n"
_HEADER = len(_MAGIC) + 32 + 8


class CheckpointCorrupt(ValueError):
    """A checkpoint file failed its checksum or could not be read."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    epoch: int
    path: str
    data: dict[str, Any]
    #: newer checkpoint files that were skipped, with why
    skipped: tuple[tuple[str, str], ...] = ()


def _encode(payload: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(payload).digest() + struct.pack("<Q", len(payload)) + payload


def _decode(blob: bytes, path: str) -> bytes:
    if len(blob) < _HEADER or not blob.startswith(_MAGIC):
        raise CheckpointCorrupt(f"{path}: not a hybrid_iter checkpoint (bad header)")
    digest = blob[len(_MAGIC) : len(_MAGIC) + 32]
    (length,) = struct.unpack("<Q", blob[len(_MAGIC) + 32 : _HEADER])
    payload = blob[_HEADER:]
    if len(payload) != length:
        raise CheckpointCorrupt(f"{path}: truncated ({len(payload)} of {length} payload bytes)")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointCorrupt(f"{path}: checksum mismatch (the file is corrupt)")
    return payload


class CheckpointStore:
    """Checkpoints of one iteration in one directory (any ``pyarrow.fs`` URI or path)."""

    def __init__(self, uri: str, *, keep_last: int = 2) -> None:
        self.fs, self.dir = (
            pafs.FileSystem.from_uri(uri)
            if "://" in uri
            else (
                pafs.LocalFileSystem(),
                uri,
            )
        )
        self.dir = self.dir.rstrip("/")
        self.uri = uri
        self.keep_last = keep_last
        self.fs.create_dir(self.dir, recursive=True)

    # -- writing --------------------------------------------------------------------------

    def _write_atomic(self, name: str, blob: bytes) -> str:
        final = f"{self.dir}/{name}"
        tmp = f"{self.dir}/.{name}.tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(blob)
        self.fs.move(tmp, final)
        return final

    def save(self, epoch: int, data: dict[str, Any], outputs: list[Any]) -> str:
        """Write checkpoint ``epoch`` (and the outputs since the previous one); prune."""
        if outputs:
            self._write_atomic(f"out-{epoch:010d}.pkl", _encode(pickle.dumps(outputs, protocol=5)))
        path = self._write_atomic(f"chk-{epoch:010d}.ckpt", _encode(pickle.dumps(data, protocol=5)))
        self._prune()
        return path

    def _prune(self) -> None:
        epochs = self.checkpoint_epochs()
        for epoch in epochs[: -self.keep_last] if self.keep_last > 0 else []:
            try:
                self.fs.delete_file(f"{self.dir}/chk-{epoch:010d}.ckpt")
            except OSError:
                pass  # already gone: another writer pruned it

    # -- reading --------------------------------------------------------------------------

    def _names(self) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self.dir, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def checkpoint_epochs(self) -> list[int]:
        out = []
        for name in self._names():
            if name.startswith("chk-") and name.endswith(".ckpt"):
                try:
                    out.append(int(name[4:-5]))
                except ValueError:
                    continue
        return sorted(out)

    def _read(self, name: str) -> bytes:
        path = f"{self.dir}/{name}"
        with self.fs.open_input_stream(path) as f:
            return _decode(f.read(), path)

    def load_latest(self, *, before: int | None = None) -> LoadedCheckpoint | None:
        """The newest valid checkpoint (optionally older than ``before``); corrupt or
        truncated ones are skipped and listed in ``skipped``."""
        skipped: list[tuple[str, str]] = []
        for epoch in reversed(self.checkpoint_epochs()):
            if before is not None and epoch >= before:
                continue
            name = f"chk-{epoch:010d}.ckpt"
            try:
                data = pickle.loads(self._read(name))
            except (CheckpointCorrupt, pickle.UnpicklingError, EOFError, OSError) as ex:
                skipped.append((f"{self.dir}/{name}", str(ex)))
                continue
            return LoadedCheckpoint(epoch, f"{self.dir}/{name}", data, tuple(skipped))
        return None if not skipped else LoadedCheckpoint(-1, "", {}, tuple(skipped))

    def outputs_until(self, epoch: int) -> list[Any]:
        """Every output record saved with checkpoints up to ``epoch``, in order."""
        records: list[Any] = []
        for name in self._names():
            if name.startswith("out-") and name.endswith(".pkl"):
                try:
                    e = int(name[4:-4])
                except ValueError:
                    continue
                if e <= epoch:
                    records.extend(pickle.loads(self._read(name)))
        return records


# -- named records beside the checkpoints (the online journal; issue 16) ---------------------
# Small separate functions so the checkpoint framing above stays the one place that decides
# how a file is sealed and checked: a record is written and read exactly like a checkpoint.


def write_record(store: CheckpointStore, name: str, obj: Any) -> str:
    """Write ``obj`` as the sealed file ``name`` in the store's directory (atomic)."""
    return store._write_atomic(name, _encode(pickle.dumps(obj, protocol=5)))


def read_record(store: CheckpointStore, name: str) -> Any:
    """Read record ``name``; ``CheckpointCorrupt`` (or ``OSError``) when it cannot be used."""
    try:
        return pickle.loads(store._read(name))
    except (pickle.UnpicklingError, EOFError) as ex:
        raise CheckpointCorrupt(f"{store.dir}/{name}: {ex}") from ex


def list_names(store: CheckpointStore) -> list[str]:
    """The file names in the store's directory, sorted."""
    return store._names()


def delete_name(store: CheckpointStore, name: str) -> None:
    """Delete ``name`` from the store's directory (gone already: fine)."""
    try:
        store.fs.delete_file(f"{store.dir}/{name}")
    except (OSError, FileNotFoundError):
        pass


def fingerprint_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """Why a checkpoint's fingerprint does not match this iteration ("" when it does)."""
    return "; ".join(
        f"{key}: checkpoint has {saved.get(key)!r}, this iteration has {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    )
