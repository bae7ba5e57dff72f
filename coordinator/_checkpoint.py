"""Checkpoint files through ``pyarrow.fs``: atomic, authenticated, owned by one run, pruned.

Runs in the Ray coordinator actor (writes, restores) and on the driver (``resume_from``
and the "directory not empty" check read through the same ``pyarrow.fs`` URI).

One checkpoint is one file ``chk-<epoch:010d>.ckpt``; the output records emitted since
the previous checkpoint go to a segment ``out-<epoch:010d>.pkl`` (so a checkpoint's cost
does not grow with the epochs behind it). Both use one container::

    magic "HICKPT2\\n" | header length (4 bytes, LE) | header (JSON: run id, kind, epoch,
    key id, array table, python section length)
    | arrays: numpy ``.npy`` records (numeric dtypes only; read with allow_pickle=False)
    | python section: a pickle whose numpy arrays are references into the array section
    | HMAC-SHA256 tag (32 bytes) over everything before it

**Nothing read back executes before it is authenticated** (docs/fault_tolerance.md):
the tag is checked with the run's key before anything is parsed beyond the JSON header;
only then are the arrays read (``allow_pickle=False``) and the python section unpickled.
A file that fails the check (tampered, forged, written with another key, truncated) is
reported and skipped exactly like a corrupt one. The key comes from the environment
variable ``HYBRID_ITER_CHECKPOINT_KEY`` (e.g. a Kubernetes Secret) or, when it is not
set, from a per-user key file generated once (``~/.hybrid_iter/checkpoint.key``, mode
0600), so a driver that died and is resumed on the same host finds it again.

Files are written to a temporary name and moved into place, so a reader never sees a
half-written file under a final name (on object stores, where a move is a copy, the tag
still rejects a torn one). ``keep_last`` prunes old checkpoints; output segments are
checked and skipped like checkpoints, and a segment beyond the newest checkpoint (its
checkpoint was never completed) is ignored and pruned.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import secrets
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs

import storage_uri

from ._errors import CheckpointError, IterationConfigError

__all__ = [
    "KEY_ENV",
    "CheckpointCorrupt",
    "CheckpointStore",
    "ForeignCheckpoint",
    "LoadedCheckpoint",
    "checkpoint_key",
    "damaged_since",
    "delete_name",
    "fingerprint_mismatch",
    "key_id",
    "list_names",
    "open_filesystem",
    "read_record",
    "write_record",
]

KEY_ENV = "HYBRID_ITER_CHECKPOINT_KEY"
KEY_FILE_ENV = "HYBRID_ITER_CHECKPOINT_KEY_FILE"
_MAGIC = b"HICKPT2\n"
_TAG = 32


class CheckpointCorrupt(CheckpointError, ValueError):
    """A checkpoint or output file failed authentication or could not be read."""


class ForeignCheckpoint(CheckpointError, ValueError):
    """A checkpoint of another run (another run id or another fingerprint)."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    epoch: int
    path: str
    data: dict[str, Any]
    #: newer checkpoint files that were skipped, with why
    skipped: tuple[tuple[str, str], ...] = ()
    #: the run that wrote it
    run_id: str = ""


def checkpoint_key() -> bytes:
    """The key that authenticates checkpoints. Runs on the driver (the key travels to
    the coordinator inside its spec).

    ``HYBRID_ITER_CHECKPOINT_KEY`` when set (any string of at least 16 characters, e.g.
    a Kubernetes Secret exposed as an environment variable); else the per-user key file
    (``HYBRID_ITER_CHECKPOINT_KEY_FILE`` or ``~/.hybrid_iter/checkpoint.key``), created
    with 32 random bytes and mode 0600 the first time.
    """
    value = os.environ.get(KEY_ENV)
    if value:
        if len(value) < 16:
            raise IterationConfigError(
                f"{KEY_ENV} is too short ({len(value)} characters): use at least 16 random "
                f"characters, e.g. the output of `python -c 'import secrets; "
                f"print(secrets.token_hex(32))'`"
            )
        return value.encode()
    path = Path(os.environ.get(KEY_FILE_ENV) or Path.home() / ".hybrid_iter" / "checkpoint.key")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(32)
    try:  # create exclusively: two drivers starting at once agree on one key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def key_id(key: bytes) -> str:
    """A short public name of a key (to tell keys apart in errors, never to derive it)."""
    return hashlib.sha256(b"hybrid_iter key id\0" + key).hexdigest()[:12]


def open_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The ``pyarrow.fs`` file system and path of a checkpoint location (a local path or
    a storage URI in Spark's spellings: ``s3a://`` is S3; see ``storage_uri``)."""
    fs, path = storage_uri.arrow_filesystem(uri, what="checkpoint path", error=IterationConfigError)
    return fs, path


# -- the container --------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    """Numeric numpy arrays leave the pickle for the array section."""

    def __init__(self, file: Any, arrays: list[np.ndarray]) -> None:
        super().__init__(file, protocol=5)
        self.arrays = arrays

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            self.arrays.append(obj)
            return len(self.arrays) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, arrays: list[np.ndarray]) -> None:
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid: Any) -> Any:
        return self.arrays[pid]


def _encode(obj: Any, *, key: bytes, run_id: str, kind: str, epoch: int) -> list[Any]:
    """The pieces of a file (written one after another, never joined: big arrays are
    not copied)."""
    arrays: list[np.ndarray] = []
    buf = io.BytesIO()
    _Pickler(buf, arrays).dump(obj)
    python = buf.getbuffer()
    table, blobs = [], []
    for arr in arrays:
        arr = np.ascontiguousarray(arr)
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, np.lib.format.header_data_from_array_1_0(arr))
        blobs.append(head.getvalue())
        blobs.append(arr.data.cast("B") if arr.nbytes else b"")
        table.append(len(blobs[-2]) + arr.nbytes)
    header = json.dumps(
        {
            "run_id": run_id,
            "kind": kind,
            "epoch": epoch,
            "key_id": key_id(key),
            "arrays": table,
            "python": len(python),
        }
    ).encode()
    pieces: list[Any] = [_MAGIC, struct.pack("<I", len(header)), header, *blobs, python]
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in pieces:
        mac.update(p)
    pieces.append(mac.digest())
    return pieces


def _header(blob: bytes, path: str) -> tuple[dict[str, Any], int]:
    """The JSON header (not yet authenticated) and where the body starts."""
    if len(blob) < len(_MAGIC) + 4 + _TAG or not blob.startswith(_MAGIC):
        raise CheckpointCorrupt(f"{path}: not a hybrid_iter checkpoint file (bad header)")
    (length,) = struct.unpack("<I", blob[len(_MAGIC) : len(_MAGIC) + 4])
    start = len(_MAGIC) + 4
    if start + length + _TAG > len(blob):
        raise CheckpointCorrupt(f"{path}: truncated (the header runs past the end)")
    try:
        header = json.loads(bytes(blob[start : start + length]))
        body = sum(int(n) for n in header["arrays"]) + int(header["python"])
    except (ValueError, KeyError, TypeError) as ex:
        raise CheckpointCorrupt(f"{path}: unreadable header ({ex})") from None
    end = start + length + body
    if end + _TAG != len(blob):
        raise CheckpointCorrupt(
            f"{path}: truncated ({len(blob) - _TAG - start - length} of {body} body bytes)"
        )
    return header, start + length


def _decode(blob: bytes, path: str, key: bytes) -> tuple[dict[str, Any], Any]:
    """Authenticate, then read: ``(header, object)``. Raises CheckpointCorrupt."""
    header, pos = _header(blob, path)
    view = memoryview(blob)
    tag = hmac.new(key, view[:-_TAG], hashlib.sha256).digest()
    if not hmac.compare_digest(tag, bytes(view[-_TAG:])):
        theirs = header.get("key_id")
        why = (
            f"written with another key (key id {theirs}, this process has {key_id(key)}): set "
            f"{KEY_ENV} to the key of the run that wrote it"
            if theirs != key_id(key)
            else "it was modified after it was written (tampered or corrupt)"
        )
        raise CheckpointCorrupt(f"{path}: authentication failed, not loaded: {why}")
    # authenticated: from here on the content is ours
    arrays = []
    for n in header["arrays"]:
        arrays.append(np.lib.format.read_array(io.BytesIO(view[pos : pos + n]), allow_pickle=False))
        pos += n
    obj = _Unpickler(io.BytesIO(view[pos : pos + header["python"]]), arrays).load()
    return header, obj


class CheckpointStore:
    """Checkpoints of one run in one directory (any ``pyarrow.fs`` URI or path)."""

    def __init__(
        self, uri: str, *, keep_last: int = 2, key: bytes | None = None, run_id: str = ""
    ) -> None:
        self.fs, self.dir = open_filesystem(uri)
        self.uri = uri
        self.keep_last = keep_last
        self.key = key if key else checkpoint_key()
        self.run_id = run_id
        #: output segments skipped by ``outputs_until``, with why
        self.skipped_outputs: list[tuple[str, str]] = []
        self.fs.create_dir(self.dir, recursive=True)

    # -- writing --------------------------------------------------------------------------

    def _write_atomic(self, name: str, pieces: list[Any]) -> str:
        final = f"{self.dir}/{name}"
        tmp = f"{self.dir}/.{name}.tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(tmp) as f:
            for p in pieces:
                f.write(p)
        self.fs.move(tmp, final)
        return final

    def save(self, epoch: int, data: dict[str, Any], outputs: list[Any]) -> str:
        """Write checkpoint ``epoch`` (and the outputs since the previous one); prune."""
        self._save_segment(epoch, outputs)
        pieces = _encode(data, key=self.key, run_id=self.run_id, kind="checkpoint", epoch=epoch)
        path = self._write_atomic(f"chk-{epoch:010d}.ckpt", pieces)
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

    def _epochs(self, prefix: str, suffix: str) -> list[int]:
        out = []
        for name in self._names():
            if name.startswith(prefix) and name.endswith(suffix):
                try:
                    out.append(int(name[len(prefix) : -len(suffix)]))
                except ValueError:
                    continue
        return sorted(out)

    def checkpoint_epochs(self) -> list[int]:
        return self._epochs("chk-", ".ckpt")

    def holds_files(self) -> bool:
        """True when the directory holds checkpoints or output segments of some run."""
        return bool(self.checkpoint_epochs() or self._epochs("out-", ".pkl"))

    def _read(self, name: str) -> tuple[dict[str, Any], Any]:
        path = f"{self.dir}/{name}"
        with self.fs.open_input_stream(path) as f:
            blob = f.read()
        return _decode(blob, path, self.key)

    def peek_run_id(self) -> str | None:
        """The run id in the newest checkpoint's header (unauthenticated: a hint for
        error messages only), or None."""
        for epoch in reversed(self.checkpoint_epochs()):
            path = f"{self.dir}/chk-{epoch:010d}.ckpt"
            try:
                with self.fs.open_input_stream(path) as f:
                    return str(_header(f.read(), path)[0].get("run_id", ""))
            except (CheckpointCorrupt, OSError):
                continue
        return None

    def load_latest(self, *, before: int | None = None) -> LoadedCheckpoint | None:
        """The newest valid checkpoint (optionally older than ``before``); corrupt,
        truncated or tampered ones are skipped and listed in ``skipped``. A valid
        checkpoint of another run (``run_id`` set and different) raises
        ForeignCheckpoint, naming both runs."""
        skipped: list[tuple[str, str]] = []
        for epoch in reversed(self.checkpoint_epochs()):
            if before is not None and epoch >= before:
                continue
            name = f"chk-{epoch:010d}.ckpt"
            try:
                header, data = self._read(name)
            except (CheckpointCorrupt, pickle.UnpicklingError, EOFError, OSError) as ex:
                skipped.append((f"{self.dir}/{name}", str(ex)))
                continue
            run_id = str(header.get("run_id", ""))
            if self.run_id and run_id != self.run_id:
                raise ForeignCheckpoint(
                    f"checkpoint {self.dir}/{name} belongs to run {run_id!r}, not to this run "
                    f"{self.run_id!r}; it is never restored into another run: give this run "
                    f"its own CheckpointConfig.path (or resume run {run_id!r} with "
                    f"resume_from={self.uri!r})"
                )
            return LoadedCheckpoint(epoch, f"{self.dir}/{name}", data, tuple(skipped), run_id)
        return None if not skipped else LoadedCheckpoint(-1, "", {}, tuple(skipped))

    # -- output segments (their own functions: online runs compact them too) ---------------

    def _save_segment(self, epoch: int, outputs: list[Any]) -> None:
        if outputs:
            pieces = _encode(
                list(outputs), key=self.key, run_id=self.run_id, kind="outputs", epoch=epoch
            )
            self._write_atomic(f"out-{epoch:010d}.pkl", pieces)

    def outputs_until(self, epoch: int) -> list[Any]:
        """Every output record saved with checkpoints up to ``epoch``, in order. A
        segment that fails its check is skipped and listed in ``skipped_outputs`` (its
        records are missing from the result; resuming stays possible); segments beyond
        ``epoch`` belong to a checkpoint that was never completed and are pruned."""
        records: list[Any] = []
        self.skipped_outputs = []
        for e in self._epochs("out-", ".pkl"):
            name = f"out-{e:010d}.pkl"
            if e > epoch:
                self._prune_segment(name)
                continue
            try:
                header, segment = self._read(name)
                if self.run_id and header.get("run_id") != self.run_id:
                    raise CheckpointCorrupt(
                        f"{self.dir}/{name}: belongs to run {header.get('run_id')!r}, not "
                        f"{self.run_id!r}"
                    )
            except (CheckpointCorrupt, pickle.UnpicklingError, EOFError, OSError) as ex:
                self.skipped_outputs.append((f"{self.dir}/{name}", str(ex)))
                continue
            records.extend(segment)
        return records

    def _prune_segment(self, name: str) -> None:
        try:
            self.fs.delete_file(f"{self.dir}/{name}")
        except OSError:
            pass  # already gone


def damaged_since(skipped: Any, epoch: int) -> bool:
    """True when a skipped (damaged) checkpoint file of ``epoch`` or newer is listed in
    ``skipped``: the files are visible, only damaged, so falling back to an older
    checkpoint is right (unlike files that are missing: a node-local path)."""
    for path, _ in skipped:
        name = str(path).rsplit("/", 1)[-1]
        if name.startswith("chk-") and name.endswith(".ckpt") and name[4:-5].isdigit():
            if int(name[4:-5]) >= epoch:
                return True
    return False


# -- named records beside the checkpoints (the online journal; issue 16) ---------------------
# Small separate functions so the checkpoint framing above stays the one place that decides
# how a file is sealed and checked: a record is written and read exactly like a checkpoint.


def write_record(store: CheckpointStore, name: str, obj: Any) -> str:
    """Write ``obj`` as the sealed file ``name`` in the store's directory (atomic)."""
    pieces = _encode(obj, key=store.key, run_id=store.run_id, kind="record", epoch=-1)
    return store._write_atomic(name, pieces)


def read_record(store: CheckpointStore, name: str) -> Any:
    """Read record ``name``; ``CheckpointCorrupt`` (or ``OSError``) when it cannot be used."""
    try:
        header, obj = store._read(name)
    except (pickle.UnpicklingError, EOFError) as ex:
        raise CheckpointCorrupt(f"{store.dir}/{name}: {ex}") from ex
    if store.run_id and header.get("run_id") != store.run_id:
        raise CheckpointCorrupt(
            f"{store.dir}/{name}: belongs to run {header.get('run_id')!r}, not {store.run_id!r}"
        )
    return obj


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
