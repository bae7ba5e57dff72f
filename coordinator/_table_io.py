"""Saved tables: Parquet files through ``pyarrow.fs``, written and read by the shards.

Runs in the parameter-server shards (each writes or reads its own files, in parallel)
and on the driver (the model's description). A saved model is a directory::

    <uri>/model.json                       tables (dim, initializer), key columns, dense shapes
    <uri>/dense.parquet                    name, shape, values of each dense parameter
    <uri>/tables/<name>/part-<shard>.parquet   key: int64, values: fixed_size_list<double>[dim]

Every file is written under a temporary name and moved into place; ``model.json`` is
written last, so a directory without it is an unfinished save. ``filesystem`` is the one
function that turns a URI into a file system here (to swap for a shared URI helper).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ._checkpoint import open_filesystem

__all__ = [
    "MODEL_FILE",
    "filesystem",
    "list_parts",
    "read_dense",
    "read_meta",
    "read_part",
    "write_dense",
    "write_meta",
    "write_part",
]

MODEL_FILE = "model.json"


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The file system and base path of ``uri`` (a local path or any ``pyarrow.fs`` URI)."""
    return open_filesystem(uri)


def _atomic(fs: pafs.FileSystem, path: str, write: Any) -> None:
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{path.rsplit('/', 1)[1]}.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp) as f:
        write(f)
    fs.move(tmp, path)


def write_part(uri: str, table: str, shard: int, keys: np.ndarray, values: np.ndarray) -> str:
    """One shard's rows of ``table`` (keys sorted); returns the file's path."""
    fs, base = filesystem(uri)
    dim = values.shape[1] if values.ndim == 2 else 1
    flat = pa.array(np.ascontiguousarray(values, dtype=np.float64).reshape(-1))
    data = pa.table(
        {
            "key": pa.array(np.asarray(keys, dtype=np.int64)),
            "values": pa.FixedSizeListArray.from_arrays(flat, dim),
        }
    )
    path = f"{base}/tables/{table}/part-{shard:05d}.parquet"
    _atomic(fs, path, lambda f: pq.write_table(data, f))
    return path


def list_parts(uri: str, table: str) -> list[str]:
    """The part files of ``table``, sorted."""
    fs, base = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(f"{base}/tables/{table}", allow_not_found=True))
    return sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and i.base_name.startswith("part-")
        and i.base_name.endswith(".parquet")
    )


def read_part(uri: str, path: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, values (n, dim))`` of one part file."""
    fs, _ = filesystem(uri)
    with fs.open_input_file(path) as f:
        data = pq.read_table(f)
    keys = data.column("key").to_numpy().astype(np.int64, copy=False)
    col = data.column("values").combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False)
    if len(flat) != len(keys) * dim:
        raise ValueError(f"{path}: {len(flat)} values for {len(keys)} keys of a table of dim {dim}")
    return keys, flat.astype(np.float64, copy=False).reshape(len(keys), dim)


def write_dense(uri: str, dense: Mapping[str, np.ndarray]) -> None:
    fs, base = filesystem(uri)
    names = list(dense)
    data = pa.table(
        {
            "name": pa.array(names, pa.string()),
            "shape": pa.array([list(np.shape(dense[n])) for n in names], pa.list_(pa.int64())),
            "values": pa.array(
                [np.asarray(dense[n], dtype=np.float64).reshape(-1) for n in names],
                pa.list_(pa.float64()),
            ),
        }
    )
    _atomic(fs, f"{base}/dense.parquet", lambda f: pq.write_table(data, f))


def read_dense(uri: str) -> dict[str, np.ndarray]:
    fs, base = filesystem(uri)
    with fs.open_input_file(f"{base}/dense.parquet") as f:
        data = pq.read_table(f).to_pylist()
    return {
        str(row["name"]): np.asarray(row["values"], dtype=np.float64).reshape(row["shape"])
        for row in data
    }


def write_meta(uri: str, meta: Mapping[str, Any]) -> None:
    fs, base = filesystem(uri)
    text = json.dumps(meta, indent=1, sort_keys=True).encode()
    _atomic(fs, f"{base}/{MODEL_FILE}", lambda f: f.write(text))


def read_meta(uri: str) -> dict[str, Any]:
    fs, base = filesystem(uri)
    path = f"{base}/{MODEL_FILE}"
    try:
        with fs.open_input_stream(path) as f:
            data: dict[str, Any] = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{uri!r} holds no saved model ({path} is missing: not a ps model directory, "
            f"or its save did not finish)"
        ) from None
    return data
