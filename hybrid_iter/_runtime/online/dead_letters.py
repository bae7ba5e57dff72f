"""Dead letters: rows a micro-batch does not train on (a null, or a NaN in a float
column, in a declared numeric column), written as Parquet per batch and partition, and
files it rejects (``_bad_files/batch_id=<id>.json``: path, reason, batch id)."""

from __future__ import annotations

import json

import pyarrow as pa

import storage_uri
from coordinator import BadFile

from .storage import filesystem

__all__ = ["split_malformed", "write_bad_files", "write_dead_letters"]


def split_malformed(
    batch: pa.RecordBatch, columns: tuple[str, ...]
) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    """(good rows, malformed rows): a null, or a NaN in a float column, is malformed."""
    import pyarrow.compute as pc

    bad = None
    for name in columns:
        col = batch.column(name)
        flag = pc.is_null(col, nan_is_null=pa.types.is_floating(col.type))
        bad = flag if bad is None else pc.or_(bad, flag)
    if bad is None or not pc.any(bad).as_py():
        return batch, batch.slice(0, 0)
    return batch.filter(pc.invert(bad)), batch.filter(bad)


def write_dead_letters(path: str, batch_id: int, pid: int, batches: list[pa.RecordBatch]) -> None:
    """Malformed rows of one batch and partition as Parquet (a replay rewrites the file)."""
    import pyarrow.parquet as pq

    fs, base = filesystem(path)
    final = f"{base.rstrip('/')}/batch_id={batch_id}/part-{pid:05d}.parquet"
    with storage_uri.atomic_output(final, fs=fs, parents=True) as f:
        pq.write_table(pa.Table.from_batches(batches), f, write_page_checksum=True)


def write_bad_files(path: str, batch_id: int, files: list[BadFile]) -> str:
    """The rejected files of one batch, JSON lines ``{path, reason, batch_id}`` under
    ``<dead_letter>/_bad_files/`` (the leading underscore keeps them out of readers of the
    malformed-row Parquet dataset beside them; a replay rewrites the file)."""
    fs, base = filesystem(path)
    final = f"{base.rstrip('/')}/_bad_files/batch_id={batch_id}.json"
    with storage_uri.atomic_output(final, fs=fs, parents=True) as f:
        f.write(
            "".join(
                json.dumps({"path": b.path, "reason": b.reason, "batch_id": batch_id}) + "\n"
                for b in files
            ).encode()
        )
    return final
