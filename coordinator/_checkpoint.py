"""Checkpoint files through ``pyarrow.fs``: atomic, authenticated, owned by one run, pruned.

Runs in the Ray coordinator actor (writes, restores) and on the driver (``resume_from``
and the "directory not empty" check read through the same ``pyarrow.fs`` URI).

One checkpoint is one file ``chk-<epoch:010d>.ckpt``; the output records emitted since
the previous checkpoint go to a segment ``out-<epoch:010d>.pkl`` (so a checkpoint's cost
does not grow with the epochs behind it). Both use one container::

    magic "HICKPT3\\n" | header length (4 bytes, LE) | header (JSON: run id, kind, epoch,
    key id, array table, python section length, a keyless checksum of these fields)
    | arrays: numpy ``.npy`` records (read with allow_pickle=False)
    | python section: a (cloud)pickle whose numpy arrays are references into the array
      section
    | HMAC-SHA256 tag (32 bytes) over everything before it

**What is read back is what was saved**: every array comes back with its shape (0-d
included), dtype (datetime64/timedelta64 units, byte order, ``S``/``U``/``V`` widths,
structured layouts) and bits (NaN payloads, -0.0). C- and F-contiguous arrays keep their
order; a strided view comes back as a contiguous copy, in F order when its strides are F
order, else in C order (values and logical order unchanged). Arrays whose dtype an
``.npy`` header cannot describe exactly (object fields, StringDType, dtype metadata) stay
inside the pickle, which keeps them exactly. A value that does not pickle fails the write
with ``CheckpointEncodeError`` naming it (a variable, an output's tag and epoch, the state
of which operator) and the fix. Format 2 files (which restored 0-d arrays as shape (1,)
and Fortran arrays in C order) are refused with a message saying so.

**Nothing read back executes before it is authenticated** (docs/fault_tolerance.md):
the tag is checked with the run's key before anything is parsed beyond the JSON header;
only then are the arrays read (``allow_pickle=False``) and the python section unpickled.
A file that fails the check (tampered, forged, written with another key, truncated) is
reported and skipped exactly like a corrupt one; the header's checksum tells a damaged
file (``CheckpointDamaged``) from one sealed with another key
(``coordinator._checkpoint_header``), and a file whose authenticated header names
another kind or epoch than its file name is refused too. The key comes from the environment
variable ``HYBRID_ITER_CHECKPOINT_KEY`` (e.g. a Kubernetes Secret) or, when it is not
set, from a per-user key file generated once (``~/.hybrid_iter/checkpoint.key``, mode
0600), so a driver that died and is resumed on the same host finds it again. Files are
written with that key; ``HYBRID_ITER_CHECKPOINT_PREVIOUS_KEY``, when set, is accepted
too for reading (key rotation), and a file it sealed is sealed again with the current key
when it is read.

Files are written to a temporary name and moved into place, so a reader never sees a
half-written file under a final name (on object stores, where a move is a copy, the tag
still rejects a torn one). ``keep_last`` prunes old checkpoints; output segments are
checked and skipped like checkpoints, and a segment beyond the newest checkpoint (its
checkpoint was never completed) is ignored and pruned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import math
import os
import pickle
import secrets
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import cloudpickle
import numpy as np
import pyarrow.fs as pafs

import storage_uri

from ._checkpoint_header import MAGIC as _MAGIC
from ._checkpoint_header import TAG as _TAG
from ._checkpoint_header import damaged, header_bytes, header_intact
from ._checkpoint_header import read_header as _header
from ._errors import (
    CheckpointCorrupt,
    CheckpointEncodeError,
    IterationConfigError,
    UnpicklableOperator,
)
from ._identity import refuse_foreign_run
from ._operator_api import overrides

__all__ = [
    "KEY_ENV",
    "PREVIOUS_KEY_ENV",
    "CheckpointStore",
    "LoadedCheckpoint",
    "checkpoint_key",
    "delete_name",
    "describe_value",
    "dump_operator",
    "dumps_state",
    "first_unpicklable",
    "key_id",
    "list_names",
    "open_filesystem",
    "previous_checkpoint_key",
    "read_record",
    "restore_operator",
    "write_record",
]

KEY_ENV = "HYBRID_ITER_CHECKPOINT_KEY"
#: a key still accepted for reading while ``KEY_ENV`` holds a new one (rotation)
PREVIOUS_KEY_ENV = "HYBRID_ITER_CHECKPOINT_PREVIOUS_KEY"
KEY_FILE_ENV = "HYBRID_ITER_CHECKPOINT_KEY_FILE"


@dataclass(frozen=True)
class LoadedCheckpoint:
    epoch: int
    path: str
    data: dict[str, Any]
    #: newer checkpoint files that were skipped, with why
    skipped: tuple[tuple[str, str], ...] = ()
    #: the run that wrote it
    run_id: str = ""
    #: the epochs of the skipped files (``skipped`` in the same order)
    skipped_epochs: tuple[int, ...] = ()


def _env_key(name: str) -> bytes | None:
    value = os.environ.get(name)
    if not value:
        return None
    if len(value) < 16:
        raise IterationConfigError(
            f"{name} is too short ({len(value)} characters): use at least 16 random "
            f"characters, e.g. the output of `python -c 'import secrets; "
            f"print(secrets.token_hex(32))'`"
        )
    return value.encode()


def previous_checkpoint_key() -> bytes | None:
    """``HYBRID_ITER_CHECKPOINT_PREVIOUS_KEY`` when set: during a key rotation, files it
    sealed are still accepted for reading (and sealed again with the current key when
    read). Runs on the driver, like ``checkpoint_key``."""
    return _env_key(PREVIOUS_KEY_ENV)


def checkpoint_key() -> bytes:
    """The key that authenticates checkpoints. Runs on the driver (the key travels to
    the coordinator inside its spec).

    ``HYBRID_ITER_CHECKPOINT_KEY`` when set (any string of at least 16 characters, e.g.
    a Kubernetes Secret exposed as an environment variable); else the per-user key file
    (``HYBRID_ITER_CHECKPOINT_KEY_FILE`` or ``~/.hybrid_iter/checkpoint.key``), created
    with 32 random bytes and mode 0600 the first time.
    """
    value = _env_key(KEY_ENV)
    if value is not None:
        return value
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

#: the answers of ``_npy_exact`` for dtypes without fields or metadata (equal dtypes of
#: those kinds are the same dtype; structured ones that compare equal may differ in
#: alignment or metadata, so they are not cached)
_NPY_EXACT: dict[np.dtype[Any], bool] = {}


def _npy_exact(dtype: np.dtype[Any]) -> bool:
    """True when an ``.npy`` header gives ``dtype`` back exactly, read with
    ``allow_pickle=False``: every builtin dtype (bool, ints, floats incl. float16 and
    longdouble, complex, datetime64/timedelta64 with their units, ``S``/``U``/``V`` of
    any width, either byte order, structured ones). Others (object fields, numpy's
    StringDType, dtypes with metadata, field names beyond latin-1) go into the
    authenticated pickle section, which keeps them exactly too."""
    plain = dtype.fields is None and dtype.metadata is None
    if plain and dtype in _NPY_EXACT:
        return _NPY_EXACT[dtype]
    exact = False
    if not dtype.hasobject and dtype.metadata is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "saved as python objects": not for us
                descr = np.lib.format.dtype_to_descr(dtype)
                repr(descr).encode("latin-1")  # a 2.0 header: field names in latin-1
                back = np.lib.format.descr_to_dtype(descr)
            exact = (
                back == dtype
                and back.descr == dtype.descr
                and back.isalignedstruct == dtype.isalignedstruct
            )
        except Exception:
            exact = False
    if plain:
        _NPY_EXACT[dtype] = exact
    return exact


def _laid_out(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``arr`` as one block an ``.npy`` record can describe: itself when it is C- or
    F-contiguous; else (a strided view) a copy in the order of its strides when that is C
    or F, else in C order. Values and logical order never change."""
    if arr.flags.c_contiguous or arr.flags.f_contiguous:
        return arr
    copy = np.array(arr, order="K")
    return copy if copy.flags.c_contiguous or copy.flags.f_contiguous else np.array(arr, order="C")


def _raw(arr: np.ndarray[Any, Any]) -> Any:
    """The bytes of a contiguous ``arr`` in its own order, without a copy (a uint8 view:
    ``memoryview.cast`` refuses datetime64 and structured dtypes)."""
    if arr.nbytes == 0:
        return b""
    block = arr if arr.flags.c_contiguous else arr.T  # an F array's transpose is C
    return block.reshape(-1).view(np.uint8).data


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    """Arrays whose dtype an ``.npy`` header describes exactly leave the pickle for the
    array section (each array object once: two references come back as one array).
    cloudpickle, so values of classes shipped by value (a notebook's) can be held too."""

    def __init__(self, file: Any, arrays: list[np.ndarray[Any, Any]]) -> None:
        super().__init__(file, protocol=5)
        self.arrays = arrays
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and _npy_exact(obj.dtype):
            i = self._index.get(id(obj))
            if i is None:
                i = self._index[id(obj)] = len(self.arrays)
                self.arrays.append(obj)
            return i
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, arrays: list[np.ndarray[Any, Any]]) -> None:
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid: Any) -> Any:
        return self.arrays[pid]


def _pickles(obj: Any) -> bool:
    try:
        _Pickler(io.BytesIO(), []).dump(obj)
    except Exception:
        return False
    return True


def _children(obj: Any) -> list[tuple[str, Any, Any]]:
    """``(how, key, child)`` of a container or object (how: "key", "index" or "attr")."""
    if isinstance(obj, Mapping):
        return [("key", k, v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [("index", i, v) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [("index", i, v) for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [("attr", f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(getattr(obj, "__dict__", None), dict):
        return [("attr", k, v) for k, v in vars(obj).items()]
    return []


def _locate(obj: Any, depth: int = 0) -> list[tuple[str, Any, Any]]:
    """The path to the innermost part of ``obj`` that does not pickle (run only after a
    failure: it pickles the children again)."""
    if depth > 32:
        return []
    for how, key, child in _children(obj):
        if not _pickles(child):
            return [(how, key, child), *_locate(child, depth + 1)]
    return []


def _is_output_record(obj: Any) -> bool:
    return type(obj).__name__ == "OutputRecord" and hasattr(obj, "tag")


def describe_value(root: Any, path: list[tuple[str, Any, Any]], top: str) -> str:
    """A name for the value at ``path`` inside ``root`` a user recognises: a variable,
    an output (tag, epoch, emitter), else ``top`` and the path as an expression."""
    name, expr = top, ""
    for i, (how, key, child) in enumerate(path):
        if i == 1 and path[0][:2] == ("key", "variables"):
            name, expr = f"variable {key!r}", ""
            continue
        if _is_output_record(child):
            source = child.source
            who = f"partition {source}" if isinstance(source, int) else f"the {source}"
            name, expr = (
                f"output {child.tag!r} of epoch {child.epoch} (out.output from {who})",
                "",
            )
            continue
        if _is_output_record(path[i - 1][2] if i else None) and key == "value":
            continue
        expr += f".{key}" if how == "attr" else f"[{key!r}]"
    leaf = path[-1][2] if path else root
    where = f" at {expr}" if expr else ""
    return f"{name}{where} (a {type(leaf).__module__}.{type(leaf).__qualname__})"


def _unencodable(obj: Any, ex: BaseException, top: str, fix: str) -> CheckpointEncodeError:
    what = describe_value(obj, _locate(obj), top)
    return CheckpointEncodeError(
        f"{what} cannot be written to a checkpoint: {type(ex).__name__}: {ex}. {fix}"
    )


def first_unpicklable(records: Sequence[Any], top: str) -> tuple[Any, str] | None:
    """The first of ``records`` that does not pickle and a name for the part of it that
    does not (as in a checkpoint's error), or None when all do. Runs only after sending
    them failed: it pickles each again."""
    for record in records:
        try:
            cloudpickle.dumps(record, protocol=5)
        except Exception as ex:
            what = describe_value([record], [("index", 0, record), *_locate(record)], top)
            return record, f"{what}: {type(ex).__name__}: {ex}"
    return None


#: the advice of an unencodable output or checkpoint value
_VALUE_FIX = (
    "A checkpoint holds what pickles: numbers, strings, numpy arrays of any dtype, and "
    "containers and objects of them; emit that instead (drop or convert the part named, e.g. "
    "a lock, an open file, a client or a generator)"
)


def dumps_state(value: Any, owner: str) -> bytes:
    """``value`` (an operator's ``snapshot_state()``, or its pickled object) as bytes for a
    checkpoint; a value that cannot be pickled raises ``CheckpointEncodeError`` naming
    ``owner`` (e.g. "the state of the coordinator operator Step") and the part."""
    try:
        return bytes(cloudpickle.dumps(value, protocol=5))
    except Exception as ex:
        raise _unencodable(
            value,
            ex,
            owner,
            "Return from snapshot_state() only data that pickles (numbers, arrays, "
            "containers of them), and rebuild the rest (locks, clients, open files) in "
            "restore_state()",
        ) from ex


def dump_operator(op: Any, owner: str, call: Callable[..., Any]) -> tuple[str, bytes]:
    """An operator's state in the one form both tiers use, for checkpoints and for the
    round stash: ``("state", its snapshot_state() pickled)`` when it defines the hook, else
    ``("object", the pickled operator)``. ``call(op, "snapshot_state")`` runs the hook the
    tier's way (failure capture, watchdog); ``owner`` names the operator ("the
    coordinator operator Step"). What does not pickle raises ``CheckpointEncodeError``
    (``UnpicklableOperator`` for the operator itself) naming it and the fix."""
    if overrides(op, "snapshot_state"):
        state = call(op, "snapshot_state")
        return "state", dumps_state(state, f"the state snapshot_state() of {owner} returned")
    try:
        return "object", bytes(cloudpickle.dumps(op, protocol=5))
    except Exception as ex:
        raise UnpicklableOperator(
            f"{owner} cannot be pickled for a checkpoint ({type(ex).__name__}: {ex}); "
            f"define snapshot_state() and restore_state() on it, or drop what cannot be "
            f"pickled"
        ) from ex


def restore_operator(
    dumped: tuple[str, bytes], fresh: Callable[[], Any], call: Callable[..., Any]
) -> Any:
    """The operator ``dump_operator`` gave: the pickled object itself (opened in its first
    life), or ``fresh()`` (a new, opened operator) given the state by
    ``call(op, "restore_state", state)``."""
    kind, blob = dumped
    if kind == "object":
        return cloudpickle.loads(blob)
    op = fresh()
    call(op, "restore_state", cloudpickle.loads(blob))
    return op


def _encode(obj: Any, *, key: bytes, run_id: str, kind: str, epoch: int) -> list[Any]:
    """The pieces of a file (written one after another, never joined: big arrays are
    not copied). A value that cannot be pickled raises ``CheckpointEncodeError``."""
    arrays: list[np.ndarray[Any, Any]] = []
    buf = io.BytesIO()
    try:
        _Pickler(buf, arrays).dump(obj)
    except Exception as ex:
        top = {"outputs": "the output records"}.get(kind, f"the {kind}")
        raise _unencodable(obj, ex, top, _VALUE_FIX) from ex
    python = buf.getbuffer()
    table, blobs = [], []
    for arr in arrays:
        arr = _laid_out(arr)
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, np.lib.format.header_data_from_array_1_0(arr))
        blobs.append(head.getvalue())
        blobs.append(_raw(arr))
        table.append(len(blobs[-2]) + arr.nbytes)
    header = header_bytes(
        {
            "run_id": run_id,
            "kind": kind,
            "epoch": epoch,
            "key_id": key_id(key),
            "arrays": table,
            "python": len(python),
        }
    )
    pieces: list[Any] = [_MAGIC, struct.pack("<I", len(header)), header, *blobs, python]
    pieces.append(_tag(key, pieces))
    return pieces


def _tag(key: bytes, pieces: list[Any]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in pieces:
        mac.update(p)
    return mac.digest()


def _authenticate(blob: bytes, path: str, header: dict[str, Any], keys: tuple[bytes, ...]) -> int:
    """Which of ``keys`` (the current one first) sealed ``blob``; CheckpointCorrupt when
    none did. The header's key id only orders the tries: the tag decides."""
    view = memoryview(blob)
    theirs = header.get("key_id")
    order = sorted(range(len(keys)), key=lambda i: key_id(keys[i]) != theirs)
    for i in order:
        tag = hmac.new(keys[i], view[:-_TAG], hashlib.sha256).digest()
        if hmac.compare_digest(tag, bytes(view[-_TAG:])):
            return i
    ours = [key_id(k) for k in keys]
    if header_intact(header) is False:  # the key id it names is not to be believed
        raise damaged(path, "authentication failed, and its header does not match its checksum")
    if theirs in ours:
        raise damaged(
            path,
            "authentication failed: it was modified after it was written (its bytes do not "
            "match the seal of the key that wrote it: a flipped or lost byte, or tampering)",
        )
    accepted = ours[0] + (f", previous key {ours[1]}" if len(ours) > 1 else "")
    raise CheckpointCorrupt(
        f"{path}: authentication failed, not loaded: written with another key (key id "
        f"{theirs}, this process accepts {accepted}): set {KEY_ENV} to the key of the run "
        f"that wrote it, or, when rotating keys, set {PREVIOUS_KEY_ENV} to it"
    )


def _read_array(view: memoryview, pos: int, n: int, path: str) -> np.ndarray[Any, Any]:
    """One ``.npy`` record of ``n`` bytes at ``pos`` (authenticated already), copied
    out in its own order (C or F)."""
    head = io.BytesIO(bytes(view[pos : pos + min(n, 12)]))
    try:
        major, _ = np.lib.format.read_magic(head)
        (length,) = struct.unpack("<I", bytes(view[pos + 8 : pos + 12]))
        if major != 2:
            raise ValueError(f".npy version {major}")
        head = io.BytesIO(bytes(view[pos + 8 : pos + 12 + length]))
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(
            head, max_header_size=length + 1
        )
    except ValueError as ex:
        raise CheckpointCorrupt(f"{path}: unreadable array record ({ex})") from ex
    data, count = pos + 12 + length, math.prod(shape)
    if data + count * dtype.itemsize != pos + n:
        raise CheckpointCorrupt(f"{path}: an array record's size does not match its header")
    order: Literal["C", "F"] = "F" if fortran else "C"
    if count == 0 or dtype.itemsize == 0:
        return np.zeros(shape, dtype=dtype, order=order)
    flat = np.frombuffer(view, dtype=dtype, count=count, offset=data)
    block = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return block.copy(order=order)


def _decode(blob: bytes, path: str, keys: tuple[bytes, ...]) -> tuple[dict[str, Any], Any, int]:
    """Authenticate, then read: ``(header, object, index of the key that sealed it)``.
    Raises CheckpointCorrupt."""
    header, pos = _header(blob, path)
    used = _authenticate(blob, path, header, keys)
    # authenticated: from here on the content is ours
    view = memoryview(blob)
    arrays = []
    for n in header["arrays"]:
        arrays.append(_read_array(view, pos, n, path))
        pos += n
    obj = _Unpickler(io.BytesIO(view[pos : pos + header["python"]]), arrays).load()
    return header, obj, used


def _resealed(blob: bytes, header: dict[str, Any], key: bytes) -> list[Any]:
    """The pieces of ``blob`` sealed with ``key`` instead (the body is unchanged)."""
    _, pos = _header(blob, "")
    new = header_bytes({**header, "key_id": key_id(key)})
    view = memoryview(blob)
    pieces: list[Any] = [_MAGIC, struct.pack("<I", len(new)), new, view[pos:-_TAG]]
    pieces.append(_tag(key, pieces))
    return pieces


class CheckpointStore:
    """Checkpoints of one run in one directory (any ``pyarrow.fs`` URI or path)."""

    def __init__(
        self,
        uri: str,
        *,
        keep_last: int = 2,
        key: bytes | None = None,
        previous_key: bytes | None = None,
        run_id: str = "",
    ) -> None:
        self.fs, self.dir = open_filesystem(uri)
        self.uri = uri
        self.keep_last = keep_last
        self.key = key if key else checkpoint_key()
        #: the keys a file may be sealed with: the current one, then the previous one
        self.read_keys = (self.key,) + (
            (previous_key,) if previous_key and previous_key != self.key else ()
        )
        self.run_id = run_id
        #: output segments skipped by ``outputs_until``, with why
        self.skipped_outputs: list[tuple[str, str]] = []
        self.fs.create_dir(self.dir, recursive=True)

    # -- writing --------------------------------------------------------------------------

    def _write_atomic(self, name: str, pieces: list[Any]) -> str:
        """Write ``pieces`` as the file ``name`` of the store's directory, whole or not
        at all; its path."""
        final = f"{self.dir}/{name}"
        with storage_uri.atomic_output(final, fs=self.fs) as f:
            for p in pieces:
                f.write(p)
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

    def _read(self, name: str, kind: str, epoch: int | None = None) -> tuple[dict[str, Any], Any]:
        """File ``name``, which must hold a ``kind`` (of ``epoch``, when given)."""
        path = f"{self.dir}/{name}"
        with self.fs.open_input_stream(path) as f:
            blob = f.read()
        header, obj, used = _decode(blob, path, self.read_keys)
        if header["kind"] != kind or (epoch is not None and header["epoch"] != epoch):
            raise CheckpointCorrupt(
                f"{path}: holds the {header['kind']} of epoch {header['epoch']}, not what its "
                f"name says: renamed, or copied over another file; not loaded"
            )
        if used:
            # sealed with the previous key: seal it with the current one, so once every
            # file was read or replaced the previous key can go
            try:
                self._write_atomic(name, _resealed(blob, header, self.key))
            except OSError:
                pass  # a read-only copy: it stays readable with the previous key
        return header, obj

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
        damaged: list[int] = []
        for epoch in reversed(self.checkpoint_epochs()):
            if before is not None and epoch >= before:
                continue
            name = f"chk-{epoch:010d}.ckpt"
            try:
                header, data = self._read(name, "checkpoint", epoch)
            except (CheckpointCorrupt, pickle.UnpicklingError, EOFError, OSError) as ex:
                skipped.append((f"{self.dir}/{name}", str(ex)))
                damaged.append(epoch)
                continue
            run_id = str(header.get("run_id", ""))
            refuse_foreign_run(f"{self.dir}/{name}", run_id, self.run_id, self.uri)
            return LoadedCheckpoint(
                epoch, f"{self.dir}/{name}", data, tuple(skipped), run_id, tuple(damaged)
            )
        if not skipped:
            return None
        return LoadedCheckpoint(-1, "", {}, tuple(skipped), skipped_epochs=tuple(damaged))

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
                header, segment = self._read(name, "outputs", e)
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


# -- named records beside the checkpoints (the online journal) ------------------------------
# Small separate functions so the checkpoint framing above stays the one place that decides
# how a file is sealed and checked: a record is written and read exactly like a checkpoint.


def write_record(store: CheckpointStore, name: str, obj: Any) -> str:
    """Write ``obj`` as the sealed file ``name`` in the store's directory (atomic)."""
    pieces = _encode(obj, key=store.key, run_id=store.run_id, kind="record", epoch=-1)
    return store._write_atomic(name, pieces)


def read_record(store: CheckpointStore, name: str) -> Any:
    """Read record ``name``; ``CheckpointCorrupt`` (or ``OSError``) when it cannot be used."""
    try:
        header, obj = store._read(name, "record")
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
