"""The keyed side-input store of a streaming operation: versioned delta files by key group.

Written by Spark tasks (one ``mapInArrow`` per side micro-batch, started by the driver in
``foreachBatch``), read by the Spark tasks of the main micro-batches. Files go through
``pyarrow.fs``, so the root may be a local path (one machine) or a storage URI in Spark's
spellings (``s3a://``, ``gs://``, ``abfss://``, ``hdfs://``; see ``storage_uri``) that
every executor can reach.

Layout: ``{root}/{view_id}/v{version}/bucket={b}/part-{partition}.parquet``, columns
``__k*`` (key), ``__w`` (window, when windowed), ``__v*`` (value). A key's group is
``pmod(hash(key columns), key_groups)`` computed by Spark for side and main rows alike,
so a main row's key group holds its key's side data. A version becomes visible only
after its write job has committed and the driver has published it in a task closure
(``KeyedSource``): a task never reads a half-written version. Each worker process keeps
the shards it folded (up to ``_CACHE_SHARDS``) and applies only newer deltas to them.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

import storage_uri

from ._content import VersionApplier, key_names, keys_of, namespaces_of
from ._errors import SideInputConfigError
from ._views import _ViewSpec

__all__ = ["SUMMARY_SCHEMA", "Delta", "KeyedSource", "load_shard", "write_delta_task"]

_CACHE_SHARDS = 64
_SHARDS: OrderedDict[tuple[str, str, int], tuple[int, dict[Any, Any]]] = OrderedDict()

#: What each writer task reports: rows per key group, windows touched, and the first
#: duplicate of a unique view's key (the driver turns it into a SideInputValueError).
SUMMARY_SCHEMA = (
    "bucket int, rows long, windows array<array<long>>, dup_key string, dup_window array<long>"
)


@dataclass(frozen=True)
class Delta:
    version: int
    replace: bool  # a 'complete'-mode micro-batch: the view restarts from it
    buckets: frozenset[int]


@dataclass(frozen=True)
class KeyedSource:
    """A keyed view as of one version: where its deltas are and which ones count."""

    spec: _ViewSpec
    root: str
    version: int
    deltas: tuple[Delta, ...]


def _fs(root: str) -> tuple[Any, str]:
    return storage_uri.arrow_filesystem(root, what="work_dir", error=SideInputConfigError)


def delta_dir(root_path: str, view_id: str, version: int) -> str:
    return f"{root_path.rstrip('/')}/{view_id}/v{version:08d}"


def write_delta_task(
    spec: _ViewSpec, root: str, version: int
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function writing one version's rows, grouped by key group.

    Input: ``__si_bucket`` then the internal layout. Each file is written whole or not
    at all as ``part-{partition}`` (``storage_uri.atomic_output``), so a retried task
    overwrites its own file instead of adding a second copy.
    """

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        tc = TaskContext.get()
        pid = tc.partitionId() if tc is not None else 0
        fs, base = _fs(root)
        vdir = delta_dir(base, spec.view_id, version)
        writers: dict[int, Any] = {}
        rows: dict[int, int] = {}
        windows: dict[int, set[tuple[int, int]]] = {}
        seen: set[Any] = set()
        dup: tuple[Any, Any] | None = None
        knames = key_names(len(spec.key))
        # the files are moved into place once every batch is written (each writer is
        # closed before its file); a failure leaves none of them
        with contextlib.ExitStack() as files:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                body = pa.RecordBatch.from_arrays(batch.columns[1:], schema=batch.schema.remove(0))
                nss = namespaces_of(body.column("__w")) if spec.window else None
                if spec.unique and dup is None:
                    keys = keys_of([body.column(n) for n in knames])
                    for i, k in enumerate(keys):
                        ident = (nss[i] if nss else None, k)
                        if ident in seen:
                            dup = ident
                            break
                        seen.add(ident)
                bucket_col = batch.column(0).to_numpy(zero_copy_only=False)
                for b in set(bucket_col.tolist()):
                    idx = pa.array((bucket_col == b).nonzero()[0])
                    part = body.take(idx)
                    w = writers.get(b)
                    if w is None:
                        final = f"{vdir}/bucket={b}/part-{pid:05d}.parquet"
                        sink = files.enter_context(
                            storage_uri.atomic_output(final, fs=fs, parents=True)
                        )
                        w = writers[b] = pq.ParquetWriter(
                            sink, part.schema, write_page_checksum=True
                        )
                        files.callback(w.close)
                    w.write_batch(part)
                    rows[b] = rows.get(b, 0) + part.num_rows
                    if nss is not None:
                        wins = windows.setdefault(b, set())
                        wins.update(nss[i] for i in idx.to_pylist())
        out = {
            "bucket": list(rows),
            "rows": [rows[b] for b in rows],
            "windows": [[list(x) for x in sorted(windows.get(b, ()))] for b in rows],
            "dup_key": [repr(dup[1]) if dup else None for _ in rows],
            "dup_window": [list(dup[0]) if dup and dup[0] else None for _ in rows],
        }
        if not rows and dup is None:
            return
        schema = pa.schema(
            [
                ("bucket", pa.int32()),
                ("rows", pa.int64()),
                ("windows", pa.list_(pa.list_(pa.int64()))),
                ("dup_key", pa.string()),
                ("dup_window", pa.list_(pa.int64())),
            ]
        )
        yield pa.RecordBatch.from_pydict(out, schema=schema)

    return run


def _read_bucket(fs: Any, vdir: str, bucket: int) -> Iterator[pa.RecordBatch]:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    sel = pafs.FileSelector(f"{vdir}/bucket={bucket}", allow_not_found=True)
    for info in sorted(fs.get_file_info(sel), key=lambda i: i.path):
        name = info.path.rsplit("/", 1)[-1]
        if info.type == pafs.FileType.File and name.startswith("part-"):
            yield from pq.read_table(
                info.path, filesystem=fs, page_checksum_verification=True
            ).to_batches()


def load_shard(src: KeyedSource, bucket: int) -> dict[Any, Any]:
    """The view's content for one key group at ``src.version``; cached per worker."""
    spec = src.spec
    cache_key = (src.root, spec.view_id, bucket)
    cached = _SHARDS.get(cache_key)
    if cached is not None and cached[0] == src.version:
        _SHARDS.move_to_end(cache_key)
        return cached[1]
    store = cached is None or cached[0] < src.version  # never rewind a newer cached shard
    have, content = (cached[0], cached[1]) if cached is not None and store else (0, {})
    todo = [d for d in src.deltas if have < d.version <= src.version]
    restart = max((i for i, d in enumerate(todo) if d.replace), default=None)
    if restart is not None:
        todo = todo[restart:]
        content = {}
    fs, base = _fs(src.root)
    try:
        for d in todo:
            applier = VersionApplier(spec, content, replace=d.replace)
            if bucket in d.buckets:
                for batch in _read_bucket(fs, delta_dir(base, spec.view_id, d.version), bucket):
                    applier.add_batch(batch)
            applier.finish()
    except BaseException:
        _SHARDS.pop(cache_key, None)  # half-folded: the next task starts over
        raise
    if store:
        _SHARDS[cache_key] = (src.version, content)
        _SHARDS.move_to_end(cache_key)
        while len(_SHARDS) > _CACHE_SHARDS:
            _SHARDS.popitem(last=False)
    return content
