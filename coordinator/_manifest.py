"""Digests and manifests of saved files: what a reader checks before it trusts one.

Runs wherever a saved artefact is written or read back: in the parameter shards (their
table parts) and on the driver (a ps model's dense parameters and ``model.json``, an
``ml`` model's arrays and ``metadata.json``). It knows nothing of the files' formats:
``_table_io`` (Parquet) and ``hybrid_iter.ml._persist`` (npz) add what theirs carry.

* ``write_digested(fs, path, write)``: ``write`` fills the file through a stream that
  hashes the bytes as they pass (SHA-256: no second read), written whole or not at all
  (``storage_uri.atomic_output``), and its ``FileDigest`` (size, SHA-256) comes back for
  the manifest.
* ``read_verified(fs, path, expected, fix)``: the file's bytes, read once, after their
  size and SHA-256 matched the manifest's; else ``SavedModelError`` naming the file, what
  differs (missing, truncated, altered, from another save) and ``fix``.
* ``seal`` / ``read_manifest``: a manifest (JSON) carries the SHA-256 of its own
  canonical text, so an edited or truncated manifest is refused like a damaged file.

What this catches: damage (flipped bits, a truncated or lost file) and mix-ups (a file
copied from another save). Not forgery: whoever can write the directory can write a
consistent model (checkpoints, which are unpickled, are authenticated instead:
``_checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

import storage_uri

from ._errors import SavedModelError

__all__ = [
    "SEAL_KEY",
    "FileDigest",
    "new_save_id",
    "read_manifest",
    "read_verified",
    "seal",
    "write_digested",
    "write_manifest",
]

#: the manifest's own digest (over its canonical JSON without this key)
SEAL_KEY = "manifest_sha256"


def new_save_id() -> str:
    """A fresh id for one save: every file it writes records it."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class FileDigest:
    """Size and SHA-256 of a file as its writer wrote it."""

    size: int
    sha256: str

    def to_plain(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256}

    @staticmethod
    def from_plain(entry: Mapping[str, Any], path: str, fix: str) -> FileDigest:
        try:
            return FileDigest(int(entry["bytes"]), str(entry["sha256"]))
        except (KeyError, TypeError, ValueError) as ex:
            raise SavedModelError(
                f"the manifest's entry of {path} records no size and digest ({ex!r}); {fix}"
            ) from ex


class _HashingStream:
    """A writable file object over a pyarrow output stream that hashes what passes."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.hash = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        self.sink.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.sink.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True  # the sink is closed by its owner (write_digested)


def write_digested(fs: pafs.FileSystem, path: str, write: Callable[[Any], Any]) -> FileDigest:
    """``write(stream)`` into ``path``, whole or not at all (a reader never sees a
    half-written file under its final name; its folders are made); the bytes' digest."""
    with storage_uri.atomic_output(path, fs=fs, parents=True) as sink:
        stream = _HashingStream(sink)
        write(stream)
    return FileDigest(stream.size, stream.hash.hexdigest())


def read_verified(
    fs: pafs.FileSystem,
    path: str,
    expected: FileDigest,
    fix: str,
    other_save: Callable[[pa.Buffer], str | None] | None = None,
) -> pa.Buffer:
    """The bytes of ``path`` once their size and SHA-256 are ``expected``'s.
    ``other_save(bytes)``: the id of the save the file says it is from, when it can tell
    (a copied file is then reported as such)."""
    try:
        with fs.open_input_stream(path) as f:
            data = f.read_buffer()
    except FileNotFoundError as ex:
        raise SavedModelError(
            f"{path} is missing: the save listed it ({expected.size} bytes); {fix}"
        ) from ex
    except OSError as ex:
        raise SavedModelError(f"{path} cannot be read ({ex}); {fix}") from ex
    if data.size == expected.size and hashlib.sha256(data).hexdigest() == expected.sha256:
        return data
    theirs = other_save(data) if other_save is not None else None
    if theirs is not None:
        what = f"is from another save (save id {theirs}), not the one its manifest describes"
    elif data.size < expected.size:
        what = f"is truncated or altered: {data.size} bytes, its save wrote {expected.size}"
    elif data.size > expected.size:
        what = f"was altered: {data.size} bytes, its save wrote {expected.size}"
    else:
        what = "was altered since its save: its SHA-256 differs from the one the save recorded"
    raise SavedModelError(f"{path} {what}; {fix}")


def _canonical(doc: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != SEAL_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with the digest of its own canonical JSON (``SEAL_KEY``)."""
    return {**doc, SEAL_KEY: hashlib.sha256(_canonical(doc)).hexdigest()}


def write_manifest(fs: pafs.FileSystem, path: str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` sealed, as indented JSON (atomic)."""
    text = json.dumps(seal(doc), indent=1, sort_keys=True).encode()
    write_digested(fs, path, lambda f: f.write(text))


def read_manifest(
    fs: pafs.FileSystem, path: str, fix: str, *, verify: bool = True
) -> tuple[dict[str, Any], bool]:
    """``(manifest, sealed)``: ``sealed`` when it carries its digest and the digest
    holds. A file that is not a JSON object raises ``SavedModelError``, and so does a
    sealed manifest whose digest differs unless not ``verify``; an unsealed one (written
    before manifests were sealed) comes back with ``sealed`` False.
    ``FileNotFoundError`` when there is none."""
    with fs.open_input_stream(path) as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except ValueError as ex:
        raise SavedModelError(
            f"{path} is not valid JSON ({ex}): truncated or damaged; {fix}"
        ) from ex
    if not isinstance(doc, dict):
        raise SavedModelError(f"{path} holds no JSON object; {fix}")
    if SEAL_KEY not in doc:
        return doc, False
    if hashlib.sha256(_canonical(doc)).hexdigest() == doc[SEAL_KEY]:
        return doc, True
    if verify:
        raise SavedModelError(
            f"{path} was edited or damaged since its save (its content does not match the "
            f"digest it was sealed with); {fix}"
        )
    return doc, False
