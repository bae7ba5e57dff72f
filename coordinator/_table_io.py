"""Saved tables: Parquet files through ``pyarrow.fs``, written and read by the shards.

Runs in the parameter-server shards (each writes or reads its own files, in parallel)
and on the driver (the dense parameters, the manifest). A saved model is a directory::

    <uri>/model.json       the manifest, written last: tables (dim, initializer), key
                           columns, dense shapes, the save's id, and for every file
                           below its rows, size and SHA-256; sealed (``_manifest``)
    <uri>/dense.parquet    name, shape, values of each dense parameter
    <uri>/tables/<name>/part-<shard>.parquet   key: int64, values: fixed_size_list<double>[dim]

Every file is written under a temporary name and moved into place, hashed as it is
written, with Parquet page checksums and the save's id in its key-value metadata;
``model.json`` comes last, so a directory without it is an unfinished save. A reader
reads a file's bytes once, checks their size and digest against the manifest
(``_manifest.read_verified``), parses them with the page checksums verified, and checks
the rows, the dim, the save id and that every value is finite: any difference is a
``SavedModelError`` naming the file, before a row of it is used. A model holding a NaN
or an infinity is not saved (it could not be loaded). ``filesystem`` is the one function
that turns a URI into a file system here (to swap for a shared URI helper).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ._checkpoint import open_filesystem
from ._errors import SavedModelError
from ._finite import first_nonfinite, nonfinite_text
from ._manifest import FileDigest, read_manifest, read_verified, write_digested, write_manifest

__all__ = [
    "DENSE_FILE",
    "MODEL_FILE",
    "RESTORE_FIX",
    "filesystem",
    "list_parts",
    "missing_files",
    "part_name",
    "read_dense",
    "read_meta",
    "read_part",
    "write_dense",
    "write_meta",
    "write_part",
]

MODEL_FILE = "model.json"
DENSE_FILE = "dense.parquet"
#: the key of a file's save id in its Parquet key-value metadata
SAVE_ID_KEY = b"hybrid_iter.save_id"
#: what to do about a saved file that is not as its save wrote it
RESTORE_FIX = (
    "restore the model directory (or this file) from a copy of that save, or save the "
    "model again (TrainResult.save / Model.save) from a run that still holds it"
)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The file system and base path of ``uri`` (a local path or any ``pyarrow.fs`` URI)."""
    return open_filesystem(uri)


def part_name(table: str, shard: int) -> str:
    """Where shard ``shard``'s rows of ``table`` go, relative to the model directory."""
    return f"tables/{table}/part-{shard:05d}.parquet"


def _write_parquet(fs: pafs.FileSystem, path: str, data: pa.Table, save_id: str) -> FileDigest:
    data = data.replace_schema_metadata({SAVE_ID_KEY: save_id.encode()})
    return write_digested(fs, path, lambda f: pq.write_table(data, f, write_page_checksum=True))


def _save_id_of(data: pa.Buffer) -> str | None:
    """The save id a Parquet file's metadata names (None: unreadable, or none)."""
    try:
        meta = pq.read_schema(pa.BufferReader(data)).metadata or {}
    except (pa.ArrowException, OSError, ValueError):
        return None
    got = meta.get(SAVE_ID_KEY)
    return got.decode("utf-8", "replace") if got is not None else None


def _read_parquet(
    fs: pafs.FileSystem, path: str, entry: Mapping[str, Any] | None, save_id: str | None
) -> pa.Table:
    """The table in ``path``: with ``save_id``, only once the bytes are those ``entry``
    (the manifest's) describes and the file names that save; page checksums verified."""
    if save_id is not None:
        assert entry is not None
        expected = FileDigest.from_plain(entry, path, RESTORE_FIX)
        data = read_verified(fs, path, expected, RESTORE_FIX, _other_save(save_id))
    else:
        try:
            with fs.open_input_stream(path) as f:
                data = f.read_buffer()
        except FileNotFoundError as ex:
            raise SavedModelError(f"{path} is missing; {RESTORE_FIX}") from ex
        except OSError as ex:
            raise SavedModelError(f"{path} cannot be read ({ex}); {RESTORE_FIX}") from ex
    try:
        table = pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except (pa.ArrowException, OSError, ValueError) as ex:
        raise SavedModelError(
            f"{path} is not a readable Parquet file ({ex}); {RESTORE_FIX}"
        ) from ex
    if save_id is not None:
        theirs = (table.schema.metadata or {}).get(SAVE_ID_KEY, b"").decode("utf-8", "replace")
        if theirs != save_id:
            raise SavedModelError(
                f"{path} is from another save (save id {theirs or 'none'}; the manifest is "
                f"of save {save_id}); {RESTORE_FIX}"
            )
    return table


def _other_save(save_id: str) -> Any:
    def other(data: pa.Buffer) -> str | None:
        theirs = _save_id_of(data)
        return theirs if theirs is not None and theirs != save_id else None

    return other


def _refuse_nonfinite(values: np.ndarray, describe: Callable[[int], str], fix: str) -> None:
    """``SavedModelError`` ``"<describe(i)>; <fix>"`` at the first NaN or infinity ``i``."""
    bad = first_nonfinite(values)
    if bad is not None:
        raise SavedModelError(f"{describe(bad)}; {fix}")


def _at_key(where: str, keys: np.ndarray, flat: np.ndarray, dim: int) -> Callable[[int], str]:
    return lambda i: f"{where} holds {flat[i]} at key {keys[i // dim]} (column {i % dim})"


#: why a file holding a NaN cannot be as its save wrote it
_CHANGED = "a saved model holds none (a save refuses them), so the file was changed after it"
#: why a model holding a NaN is not saved
_NOT_SAVED = (
    "a model with non-finite values is not saved (it could not be loaded): train it again "
    "(a smaller learning rate, or gradients checked for overflow)"
)


def write_part(
    uri: str, table: str, shard: int, keys: np.ndarray, values: np.ndarray, save_id: str
) -> dict[str, Any]:
    """One shard's rows of ``table`` (keys sorted); returns its manifest entry (file,
    rows, size, SHA-256)."""
    fs, base = filesystem(uri)
    dim = values.shape[1] if values.ndim == 2 else 1
    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    keys = np.asarray(keys, dtype=np.int64)
    _refuse_nonfinite(
        flat, _at_key(f"table {table!r} (parameter shard {shard})", keys, flat, dim), _NOT_SAVED
    )
    data = pa.table(
        {
            "key": pa.array(keys),
            "values": pa.FixedSizeListArray.from_arrays(pa.array(flat), dim),
        }
    )
    name = part_name(table, shard)
    digest = _write_parquet(fs, f"{base}/{name}", data, save_id)
    return {"file": name, "rows": len(keys), **digest.to_plain()}


def list_parts(uri: str, table: str) -> list[str]:
    """The part files of ``table`` found in the directory (relative names, sorted): what
    a save without a manifest of its files is read from."""
    fs, base = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/tables/{table}", allow_not_found=True))
    return sorted(
        f"tables/{table}/{i.base_name}"
        for i in infos
        if i.type == pafs.FileType.File
        and i.base_name.startswith("part-")
        and i.base_name.endswith(".parquet")
    )


def missing_files(uri: str, names: list[str]) -> list[str]:
    """The paths of ``names`` (relative to the model directory) that do not exist."""
    fs, base = filesystem(uri)
    infos = fs.get_file_info([f"{base}/{n}" for n in names])
    return [i.path for i in infos if i.type == pafs.FileType.NotFound]


def read_part(
    uri: str, part: Mapping[str, Any], dim: int, save_id: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, values (n, dim))`` of one part file (``part``: its manifest entry).
    With ``save_id``, the file must be exactly what that save wrote (size, digest, rows);
    without (an unverified load), it must still parse, have ``dim`` and hold finite
    values."""
    fs, base = filesystem(uri)
    path = f"{base}/{part['file']}"
    data = _read_parquet(fs, path, part, save_id)
    fields = {f.name: f.type for f in data.schema}
    vtype = fields.get("values")
    if fields.get("key") != pa.int64() or vtype is None or not pa.types.is_fixed_size_list(vtype):
        raise SavedModelError(
            f"{path} is not a table part (columns {data.schema.names}, expected key: int64 "
            f"and values: fixed_size_list<double>); {RESTORE_FIX}"
        )
    width = vtype.list_size
    if width != dim:
        raise SavedModelError(
            f"{path} holds rows of dim {width}, but {base}/{MODEL_FILE} says the table's dim "
            f"is {dim}: one of them was changed after the save; {RESTORE_FIX}"
        )
    if save_id is not None and data.num_rows != int(part["rows"]):
        raise SavedModelError(
            f"{path} holds {data.num_rows} rows, its save wrote {part['rows']}; {RESTORE_FIX}"
        )
    key_col = data.column("key")
    col = data.column("values").combine_chunks()
    if key_col.null_count or col.null_count:
        raise SavedModelError(f"{path} holds null keys or rows; {RESTORE_FIX}")
    keys = key_col.to_numpy().astype(np.int64, copy=False)
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    if len(flat) != len(keys) * dim:
        raise SavedModelError(
            f"{path}: {len(flat)} values for {len(keys)} keys of dim {dim}; {RESTORE_FIX}"
        )
    _refuse_nonfinite(flat, _at_key(path, keys, flat, dim), f"{_CHANGED}; {RESTORE_FIX}")
    return keys, flat.reshape(len(keys), dim)


def _dense_at(name: str, value: np.ndarray, where: str) -> Callable[[int], str]:
    return lambda i: f"{where}: {nonfinite_text(name, value, i)}"


def write_dense(uri: str, dense: Mapping[str, np.ndarray], save_id: str) -> dict[str, Any]:
    """The dense parameters as ``dense.parquet``; returns its manifest entry."""
    fs, base = filesystem(uri)
    names = list(dense)
    arrays = [np.asarray(dense[n], dtype=np.float64) for n in names]
    for n, a in zip(names, arrays):
        _refuse_nonfinite(a, _dense_at(n or "params", a, "the model's dense parameter"), _NOT_SAVED)
    data = pa.table(
        {
            "name": pa.array(names, pa.string()),
            "shape": pa.array([list(a.shape) for a in arrays], pa.list_(pa.int64())),
            "values": pa.array([a.reshape(-1) for a in arrays], pa.list_(pa.float64())),
        }
    )
    digest = _write_parquet(fs, f"{base}/{DENSE_FILE}", data, save_id)
    return {"file": DENSE_FILE, "rows": len(names), **digest.to_plain()}


def read_dense(
    uri: str, entry: Mapping[str, Any] | None, save_id: str | None
) -> dict[str, np.ndarray]:
    """The dense parameters (``entry``: the manifest's; checked as ``read_part`` does)."""
    fs, base = filesystem(uri)
    path = f"{base}/{DENSE_FILE}"
    data = _read_parquet(fs, path, entry, save_id)
    if save_id is not None and entry is not None and data.num_rows != int(entry["rows"]):
        raise SavedModelError(
            f"{path} holds {data.num_rows} parameters, its save wrote {entry['rows']}; "
            f"{RESTORE_FIX}"
        )
    try:
        rows = [
            (str(r["name"]), np.asarray(r["values"], dtype=np.float64).reshape(r["shape"]))
            for r in data.to_pylist()
        ]
    except (KeyError, TypeError, ValueError) as ex:
        raise SavedModelError(
            f"{path} does not hold the dense parameters as saved ({ex}); {RESTORE_FIX}"
        ) from ex
    for name, value in rows:
        _refuse_nonfinite(
            value, _dense_at(name or "params", value, path), f"{_CHANGED}; {RESTORE_FIX}"
        )
    out = dict(rows)
    return out


def write_meta(uri: str, meta: Mapping[str, Any]) -> None:
    """The manifest, sealed (the last file of a save)."""
    fs, base = filesystem(uri)
    write_manifest(fs, f"{base}/{MODEL_FILE}", meta)


def read_meta(uri: str, *, verify: bool = True) -> tuple[dict[str, Any], bool]:
    """``(manifest, sealed)``; ``FileNotFoundError`` naming the path when there is none,
    ``SavedModelError`` when it is damaged (not ``verify``: only when it does not parse)."""
    fs, base = filesystem(uri)
    path = f"{base}/{MODEL_FILE}"
    try:
        return read_manifest(fs, path, RESTORE_FIX, verify=verify)
    except FileNotFoundError as ex:
        raise FileNotFoundError(
            f"{uri!r} holds no saved model ({path} is missing: not a ps model directory, "
            f"or its save did not finish)"
        ) from ex
