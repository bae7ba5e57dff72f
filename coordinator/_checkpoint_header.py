"""The header of a checkpoint container file (``coordinator._checkpoint``): its bytes,
and its reading before the file is authenticated, so that a file that cannot be used
says why: **damaged** (a flipped or lost byte: ``CheckpointDamaged``), of another
container format, or not a checkpoint file at all.

A header (JSON) holds the run id, the kind, the epoch, the id of the key that sealed the
file, the array table and the python section's length, and a keyless checksum of those
fields (``header_sha256``). The file's HMAC tag alone cannot tell a damaged header from
an intact one that names another key: both fail to authenticate. The checksum can: a
header whose checksum matches names the key that sealed the file (so a tag that fails
with every key this process has is another key's, or a damaged body when the key is
ours), and one whose checksum does not match was damaged. Files written before headers
carried the checksum are read as before (their fields are checked, their key id taken
as written). The checksum is never trusted for anything but this diagnosis: the tag
decides what is loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any

from ._errors import CheckpointCorrupt, CheckpointDamaged

__all__ = ["MAGIC", "TAG", "damaged", "header_bytes", "header_intact", "read_header"]

MAGIC = b"HICKPT3\n"
TAG = 32
_SUM = "header_sha256"
#: each field of a header and what it must hold
_KINDS = frozenset({"checkpoint", "outputs", "record"})
_KEY_ID = re.compile(r"[0-9a-f]{12}")


def _digest(fields: dict[str, Any]) -> str:
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"hybrid_iter checkpoint header\0" + canon).hexdigest()[:32]


def header_bytes(fields: dict[str, Any]) -> bytes:
    """The header of ``fields`` (any checksum they carry is replaced by theirs)."""
    plain = {k: v for k, v in fields.items() if k != _SUM}
    return json.dumps({**plain, _SUM: _digest(plain)}).encode()


def header_intact(header: dict[str, Any]) -> bool | None:
    """Whether ``header``'s checksum matches its fields; None when it has none (a file
    written before headers carried one)."""
    given = header.get(_SUM)
    if given is None:
        return None
    return bool(given == _digest({k: v for k, v in header.items() if k != _SUM}))


def damaged(path: str, what: str) -> CheckpointDamaged:
    """The error of file ``path`` found damaged (``what``: how), with what to do."""
    return CheckpointDamaged(
        f"{path}: damaged, not loaded: {what}. Nothing of it is used: a resume takes the "
        f"newest intact checkpoint before it (delete this file so that it is not reported "
        f"again); when none is left, restore the file from a copy or start a new run in "
        f"an empty directory"
    )


def _field_ok(name: str, v: Any) -> bool:
    if name == "run_id":
        return isinstance(v, str)
    if name == "kind":
        return isinstance(v, str) and v in _KINDS
    if name == "epoch":
        return type(v) is int
    if name == "key_id":
        return isinstance(v, str) and _KEY_ID.fullmatch(v) is not None
    if name == "arrays":
        return isinstance(v, list) and all(type(n) is int and n >= 0 for n in v)
    return type(v) is int and v >= 0  # python


def _field_problem(header: Any) -> str | None:
    """What in a parsed header is not what the writer writes, None when nothing is."""
    if not isinstance(header, dict):
        return f"a JSON {type(header).__name__}, not an object"
    extra = set(header) - {"run_id", "kind", "epoch", "key_id", "arrays", "python", _SUM}
    if extra:
        return f"unknown field(s) {sorted(extra)}"
    for name in ("run_id", "kind", "epoch", "key_id", "arrays", "python"):
        if name not in header:
            return f"no {name!r} field"
        if not _field_ok(name, header[name]):
            return f"field {name!r} holds {header[name]!r}"
    if _SUM in header and not isinstance(header[_SUM], str):
        return f"field {_SUM!r} holds {header[_SUM]!r}"
    return None


def _parse(blob: bytes, path: str) -> tuple[dict[str, Any], int]:
    """The header after the magic and where the body starts; ``CheckpointDamaged`` when
    it cannot be read or the file's size does not match it."""
    if len(blob) < len(MAGIC) + 4 + TAG:
        raise damaged(path, f"truncated: {len(blob)} bytes, fewer than any checkpoint file holds")
    (length,) = struct.unpack("<I", blob[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if start + length + TAG > len(blob):
        raise damaged(
            path,
            f"its header length field says {length} bytes, more than the file's "
            f"{len(blob)} bytes hold (the field was changed, or the file truncated)",
        )
    try:
        header = json.loads(bytes(blob[start : start + length]))
    except ValueError as ex:
        raise damaged(path, f"its header is not readable JSON ({ex})") from ex
    problem = _field_problem(header)
    if problem is not None:
        raise damaged(path, f"its header is not one hybrid_iter writes ({problem})")
    body = sum(header["arrays"]) + header["python"]
    end = start + length + body
    if end + TAG != len(blob):
        if header_intact(header) is False:
            raise damaged(path, "its header does not match its checksum")
        raise damaged(
            path,
            f"{len(blob) - TAG - start - length} body bytes where its header says {body} "
            f"(truncated, or bytes lost or added)",
        )
    return header, start + length


def read_header(blob: bytes, path: str) -> tuple[dict[str, Any], int]:
    """The JSON header of file ``path`` (``blob``; not yet authenticated) and where its
    body starts. ``CheckpointDamaged`` for a damaged file, ``CheckpointCorrupt`` for one
    of another container format or not a checkpoint file."""
    head = bytes(blob[: len(MAGIC)])
    if head[:6] == MAGIC[:6] and head[7:8] == b"\n" and head[6:7] != MAGIC[6:7]:
        version = head[6:7].decode("ascii", "replace")
        try:  # this format with its version byte changed, when the rest reads as ours
            header, _ = _parse(blob, path)
            intact = header_intact(header)
        except CheckpointCorrupt:
            intact = None
        if intact or not version.isdigit():
            raise damaged(path, f"its format byte reads {version!r} where a checkpoint's is '3'")
        raise CheckpointCorrupt(
            f"{path}: bad header: container format {version} of another hybrid_iter "
            f"version (this one reads format {MAGIC[6:7].decode()}), not loaded. Format "
            f"2 restored 0-d arrays with shape (1,) and Fortran-ordered arrays in C order, "
            f"so its files are not read: resume it with the hybrid_iter version that "
            f"wrote it, or start a new run in an empty directory"
        )
    if head != MAGIC:
        if len(head) == len(MAGIC) and sum(a != b for a, b in zip(head, MAGIC, strict=True)) <= 2:
            raise damaged(path, f"its first bytes read {head!r} where a checkpoint's are {MAGIC!r}")
        raise CheckpointCorrupt(f"{path}: not a hybrid_iter checkpoint file (bad header)")
    return _parse(blob, path)
