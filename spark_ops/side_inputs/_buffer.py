"""``RecordBuffer``: main records waiting for a side input, by window namespace.

Runs on the driver of a streaming operation (FLIP-17's record-buffer service). Records
are kept as Arrow batches in memory up to ``memory_budget`` bytes; beyond it the
namespace holding the most memory is spilled to a Parquet file, so a slow side input
costs disk, not memory. When a namespace's side input becomes ready, ``files()`` spills
what is still in memory and returns the namespace's files, which Spark reads back as a
DataFrame (the records are processed in Spark tasks, not on the driver), and ``clear()``
deletes them.

The directory is a local path or a storage URI (Spark's spellings: ``s3a://``, ``gs://``,
``abfss://``, ``hdfs://``; see ``storage_uri``); on a cluster it must be storage every
executor reads (as a Spark checkpoint location must be).
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

import storage_uri

from ._errors import SideInputConfigError

__all__ = ["RecordBuffer"]

_ALL: Any = object()


@dataclass
class _Namespace:
    batches: list[pa.RecordBatch] = field(default_factory=list)
    memory: int = 0
    files: list[str] = field(default_factory=list)
    rows: int = 0
    spilled_bytes: int = 0


class RecordBuffer:
    """Records by namespace: ``add``, ``records``, ``files``, ``clear`` (FLIP-17's
    ``addRecord`` / ``getRecords`` / ``clear``), in memory up to ``memory_budget`` bytes
    and in Parquet files under ``directory`` beyond it. Not thread-safe: its owner locks.
    """

    def __init__(self, directory: str, *, memory_budget: int = 64 << 20) -> None:
        where = storage_uri.parse(
            directory, what="RecordBuffer directory", error=SideInputConfigError
        )
        if (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, int)
            or memory_budget < 0
        ):
            raise ValueError(f"memory_budget must be an int >= 0 (bytes), got {memory_budget!r}")
        self.directory = where.uri
        self.memory_budget = memory_budget
        self._where = where
        self._fs, self._root = where.filesystem()
        self._spaces: dict[Hashable, _Namespace] = {}
        self._dirs: dict[Hashable, str] = {}
        self.schema: pa.Schema | None = None
        self.bytes_in_memory = 0
        self.bytes_spilled = 0
        self.spills = 0

    # -- FLIP-17's interface --------------------------------------------------------------

    def add(self, namespace: Hashable, batch: pa.RecordBatch) -> None:
        """Buffer ``batch`` under ``namespace``; spill if memory goes over the budget."""
        if batch.num_rows == 0:
            return
        if self.schema is None:
            self.schema = batch.schema
        elif not batch.schema.equals(self.schema):
            batch = batch.cast(self.schema)
        ns = self._spaces.setdefault(namespace, _Namespace())
        ns.batches.append(batch)
        ns.memory += batch.nbytes
        ns.rows += batch.num_rows
        self.bytes_in_memory += batch.nbytes
        while self.bytes_in_memory > self.memory_budget:
            biggest = max(self._spaces, key=lambda k: self._spaces[k].memory)
            if self._spaces[biggest].memory == 0:
                break
            self._spill(biggest)

    def records(self, namespace: Hashable) -> Iterator[pa.RecordBatch]:
        """The namespace's records: spilled ones (oldest first), then those in memory."""
        import pyarrow.parquet as pq

        ns = self._spaces.get(namespace)
        if ns is None:
            return
        for path in list(ns.files):
            yield from pq.read_table(path, filesystem=self._fs).to_batches()
        yield from list(ns.batches)

    def clear(self, namespace: Hashable) -> None:
        """Forget the namespace's records and delete its files."""
        ns = self._spaces.pop(namespace, None)
        if ns is None:
            return
        self.bytes_in_memory -= ns.memory
        d = self._dirs.pop(namespace, None)
        if d is not None:
            self._fs.delete_dir(d)

    # -- for the runtime --------------------------------------------------------------------

    def files(self, namespace: Hashable) -> list[str]:
        """Spill what the namespace holds in memory; return all its files as Spark is
        given them (``file:///...`` for a local directory; the directory's scheme, without
        pyarrow's query options, for a URI), for ``spark.read.parquet``."""
        ns = self._spaces.get(namespace)
        if ns is None:
            return []
        if ns.memory:
            self._spill(namespace)
        return [self._where.spark + p[len(self._root) :] for p in ns.files]

    def namespaces(self) -> list[Hashable]:
        return list(self._spaces)

    def __contains__(self, namespace: Hashable) -> bool:
        return namespace in self._spaces

    def num_records(self, namespace: Hashable = _ALL, /) -> int:
        """Records buffered in ``namespace`` (``None`` is the global window), or in all."""
        if namespace is _ALL:
            return sum(ns.rows for ns in self._spaces.values())
        ns = self._spaces.get(namespace)
        return ns.rows if ns is not None else 0

    def stats(self) -> dict[str, Any]:
        return {
            "namespaces": len(self._spaces),
            "records": self.num_records(),
            "bytes_in_memory": self.bytes_in_memory,
            "bytes_spilled": self.bytes_spilled,
            "spills": self.spills,
            "memory_budget": self.memory_budget,
        }

    def close(self) -> None:
        for namespace in list(self._spaces):
            self.clear(namespace)

    def _dir(self, namespace: Hashable) -> str:
        d = self._dirs.get(namespace)
        if d is None:
            d = self._dirs[namespace] = f"{self._root}/ns-{uuid.uuid4().hex[:12]}"
            self._fs.create_dir(d, recursive=True)
        return d

    def _spill(self, namespace: Hashable) -> None:
        import pyarrow.parquet as pq

        ns = self._spaces[namespace]
        path = f"{self._dir(namespace)}/spill-{len(ns.files):06d}.parquet"
        table = pa.Table.from_batches(ns.batches, schema=self.schema)
        pq.write_table(table, path, filesystem=self._fs)
        ns.files.append(path)
        ns.spilled_bytes += ns.memory
        self.bytes_spilled += ns.memory
        self.bytes_in_memory -= ns.memory
        self.spills += 1
        ns.batches = []
        ns.memory = 0
