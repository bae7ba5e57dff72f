"""A Parquet file source read by our own tasks with pyarrow.

For ``spark.readStream.schema(...).parquet(dir)`` with nothing applied on top, Spark's
file source still decides which files make up each micro-batch (its offsets and file log
give exactly-once; the query reads the ``binaryFile`` listing of the same directory), but
the driver checks each file's footer and splits the batch's rows into shares, and the
tasks read their shares: a file that is not Parquet or whose columns do not match the
stream's schema goes to the dead-letter path instead of failing the query."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from coordinator import BadFile
from spark_ops._spark_compat import streaming_file_source

from .storage import filesystem

__all__ = [
    "BINARY_FILE_SCHEMA",
    "ParquetSource",
    "Piece",
    "assign",
    "file_row_groups",
    "files_newer_than",
    "parquet_source",
    "read_share",
]

#: the fixed schema of Spark's ``binaryFile`` source (we select only ``path``: Spark does
#: not open a file unless its ``content`` column is read)
BINARY_FILE_SCHEMA = "path string, modificationTime timestamp, length long, content binary"

#: a piece of a task's share: (path, row group, first row, row after the last)
Piece = tuple[str, int, int, int]

#: (path, options, Spark schema) of a Parquet file source
ParquetSource = tuple[str, dict[str, str], Any]


def parquet_source(df: Any) -> ParquetSource | None:
    """(path, options, Spark schema) when ``df`` is a Parquet file source as it came from
    ``spark.readStream`` (nothing applied on top); None for anything else."""
    found = streaming_file_source(df)
    if found is None:  # not the plan we know: Spark reads it
        return None
    class_name, options = found
    if not class_name.lower().endswith(("parquet", "parquetfileformat")):
        return None
    path = next((v for k, v in options.items() if k.lower() == "path"), None)
    if path is None:
        return None
    return path, options, df.schema


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """A file column of type ``src`` can be read as ``dst`` without changing a value."""
    t = pa.types
    if src == dst:
        return True
    if t.is_dictionary(src):
        return _compatible(src.value_type, dst)
    if t.is_integer(src) and t.is_integer(dst):
        if t.is_signed_integer(src) == t.is_signed_integer(dst):
            return src.bit_width <= dst.bit_width
        return t.is_unsigned_integer(src) and src.bit_width < dst.bit_width
    if t.is_floating(dst) and dst.bit_width == 64:
        return (t.is_integer(src) and src.bit_width <= 32) or t.is_floating(src)
    if t.is_timestamp(src) and t.is_timestamp(dst):
        return True
    if (t.is_string(src) or t.is_large_string(src)) and (
        t.is_string(dst) or t.is_large_string(dst)
    ):
        return True
    if (t.is_binary(src) or t.is_large_binary(src)) and (
        t.is_binary(dst) or t.is_large_binary(dst)
    ):
        return True
    return False


def _schema_problem(file_schema: pa.Schema, schema: pa.Schema) -> str | None:
    """Why a file of ``file_schema`` does not match the stream's ``schema`` (None: it
    does). A column the file lacks reads as nulls, as Spark does; names match case-
    insensitively, as Spark's Parquet reader does by default."""
    by_name = {n.lower(): i for i, n in enumerate(file_schema.names)}
    for field in schema:
        i = by_name.get(field.name.lower())
        if i is None:
            continue
        src = file_schema.field(i).type
        if not _compatible(src, field.type):
            return (
                f"column {field.name!r} is {src} in the file; the stream's schema says {field.type}"
            )
    return None


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly the stream's columns and types (missing ones null)."""
    by_name = {n.lower(): n for n in table.column_names}
    cols = []
    for field in schema:
        name = by_name.get(field.name.lower())
        if name is None:
            cols.append(pa.nulls(table.num_rows, field.type))
            continue
        col = table.column(name)
        cols.append(col if col.type == field.type else col.cast(field.type))
    return pa.Table.from_arrays(cols, schema=schema)


def file_row_groups(path: str, schema: pa.Schema) -> list[int]:
    """The rows of each row group of Parquet file ``path``; raises when the file cannot
    be used (not Parquet, unreadable footer, columns of the wrong type). Runs on the
    driver: a footer read per file."""
    import pyarrow.parquet as pq

    fs, p = filesystem(path)
    with fs.open_input_file(p) as f:
        meta = pq.ParquetFile(f).metadata
        problem = _schema_problem(meta.schema.to_arrow_schema(), schema)
        if problem:
            raise ValueError(problem)
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def assign(files: list[tuple[str, list[int]]], tasks: int) -> list[list[Piece]]:
    """Split the batch's rows into ``tasks`` contiguous shares of (path, row group, start,
    stop) pieces, in path order (so sync results do not depend on listing order)."""
    total = sum(sum(groups) for _, groups in files)
    tasks = max(1, min(tasks, total))
    bounds = [total * k // tasks for k in range(tasks + 1)]
    shares: list[list[Piece]] = [[] for _ in range(tasks)]
    offset = 0
    k = 0
    for path, groups in files:
        for rg, n in enumerate(groups):
            lo, hi = offset, offset + n
            while k < tasks and lo < hi:
                cut = min(hi, bounds[k + 1])
                if cut > lo:
                    shares[k].append((path, rg, lo - offset, cut - offset))
                lo = cut
                if lo >= bounds[k + 1]:
                    k += 1
            offset = hi
    return [s for s in shares if s]


def read_share(
    schema: pa.Schema, batch_rows: int, share: list[Piece], bad: list[BadFile]
) -> Iterator[pa.RecordBatch]:
    """The Arrow batches of one task's share (a Spark task). A file is read whole (its
    pieces in this share) before any of it is handed on, so a file that fails here is
    dead-lettered as a whole, never half trained on."""
    import pyarrow.parquet as pq

    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for path, rg, lo, hi in share:
        by_file.setdefault(path, []).append((rg, lo, hi))
    for path, pieces in by_file.items():
        try:
            fs, p = filesystem(path)
            with fs.open_input_file(p) as f:
                pf = pq.ParquetFile(f)
                problem = _schema_problem(pf.schema_arrow, schema)
                if problem:
                    raise ValueError(problem)
                wanted = {n.lower() for n in schema.names}
                columns = [n for n in pf.schema_arrow.names if n.lower() in wanted]
                tables = [
                    _conform(pf.read_row_group(rg, columns=columns).slice(lo, hi - lo), schema)
                    for rg, lo, hi in pieces
                ]
        except Exception as ex:
            groups = sorted({rg for rg, _, _ in pieces})
            bad.append(BadFile(path, f"row groups {groups}: {type(ex).__name__}: {ex}"))
            continue
        for table in tables:
            yield from table.to_batches(max_chunksize=batch_rows)


def files_newer_than(path: str, options: Mapping[str, str], newest: float) -> int:
    """Data files under the source ``path`` modified after ``newest`` (seconds; the
    file source hands files out oldest first, so these are the ones still waiting).
    Hidden files (``.`` or ``_``) do not count, as for Spark's file source."""
    import pyarrow.fs as pafs

    recursive = str(options.get("recursiveFileLookup", "false")).lower() == "true"
    fs, base = filesystem(path)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    cutoff = int(newest * 1000)  # Spark's modification times are in milliseconds
    return sum(
        1
        for i in infos
        if i.type == pafs.FileType.File
        and not i.base_name.startswith((".", "_"))
        and i.mtime_ns is not None
        and i.mtime_ns // 1_000_000 > cutoff
    )
