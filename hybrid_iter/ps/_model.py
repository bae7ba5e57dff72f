"""A trained (or loaded) model: dense parameters on the driver, tables where they are.

Runs on the driver (``Model``: lookups, ``save``, ``to_dataframe``, ``transform``) and,
for ``transform`` and ``to_dataframe``, in Spark tasks that call the shards directly.
Nothing here gathers a table to the driver: ``save`` has every shard write its own
rows (in parallel), ``to_dataframe`` is a Spark job whose task ``j`` reads shard ``j``,
``transform`` a Spark job whose tasks look up the rows their batches reference.

The shards of a model stay alive as long as the ``Model`` (or the ``TrainResult``
holding it) does, or until ``close()``. A shard that died since (or a Ray session that
ended) is reported by every call as such, never read as an empty table.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator._manifest import new_save_id
from coordinator._table_io import MODEL_FILE, write_dense, write_meta
from coordinator._tables import Init

from .._cluster import context as cluster
from .._errors import IterationConfigError, UsageError
from .._runtime.endpoint import refuse_on_connect
from ._client import Shards, TablePlan, step_keys
from ._csr import CSR
from ._layout import Layout
from ._worker import batch_params, with_locals

__all__ = ["Model", "TableRef"]

#: rows per chunk of ``to_dataframe`` (one call to a shard each)
_EXPORT_CHUNK = 1 << 16
#: the saved-model format: 2 records every file's rows, size and digest (1 did not)
FORMAT = 2


@dataclass(frozen=True)
class _TableMeta:
    name: str
    dim: int
    init: Init
    columns: tuple[str, ...]


class _Owner:
    """Kills a model's shard actors once (close, or when the model is collected)."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        import ray

        if not ray.is_initialized():
            return  # Ray is gone (the session ended): its actors with it
        from .._cluster.placement import kill

        for i, h in enumerate(self.handles):
            kill(h, f"parameter shard {i}")


class TableRef:
    """A table of a model, on its shards: ``num_keys``, ``lookup(ids)``,
    ``to_dataframe(spark)``. (The rows are never copied to the driver whole.)"""

    def __init__(self, model: Model, name: str) -> None:
        self.model = model
        self.name = name

    @property
    def dim(self) -> int:
        return self.model._meta(self.name).dim

    @property
    def num_keys(self) -> int:
        return self.model.num_keys(self.name)

    def lookup(self, ids: Any) -> np.ndarray:
        return self.model.lookup(self.name, ids)

    def to_dataframe(self, spark: Any) -> Any:
        return self.model.to_dataframe(spark, self.name)

    def __repr__(self) -> str:
        return f"TableRef({self.name!r}, dim={self.dim})"


class Model:
    """Dense parameters (numpy, on the driver) and tables (on their shards).

    * ``params``: the dense arrays in ``init``'s structure, and a ``TableRef`` per table.
    * ``lookup(table, ids)``: rows ``(len(ids), dim)``; a key the table never saw reads
      as its initializer's value (what its first touch would have given it).
    * ``save(uri)``, ``ps.load(uri)``, ``to_dataframe(spark, table)``, ``transform(df)``.
    * ``close()``: stop the shards (also when the model is garbage-collected).
    """

    def __init__(
        self,
        *,
        layout: Layout | None,
        dense: np.ndarray,
        tables: Sequence[_TableMeta],
        shard_names: Sequence[str],
        handles: Sequence[Any],
        token: str | None,
        predict_fn: Callable[[Any, dict[str, Any]], Any] | None = None,
        columns: Sequence[str] = (),
        vector_widths: Mapping[str, int] | None = None,
        csr_columns: Sequence[str] = (),
        ray_address: str | None = None,
        held: Sequence[Any] = (),
    ) -> None:
        self.layout = layout
        self.dense = dense
        self.tables = list(tables)
        self.shard_names = list(shard_names)
        self.handles = list(handles)
        self.token = token
        self.predict_fn = predict_fn
        self.columns = list(columns)
        self.vector_widths = dict(vector_widths or {})
        self.csr_columns = list(csr_columns)
        self.ray_address = ray_address
        #: creation arguments of shards Ray may restart (kept while they may)
        self.held = list(held)
        self._owner = _Owner(self.handles)
        self._finalizer = weakref.finalize(self, self._owner.close) if self.handles else None

    def __reduce__(self) -> Any:
        # a copy elsewhere (a pickled TrainFailedError) reads the same shards but does
        # not own them
        return (_unpickle_model, (self.__dict__.copy(),))

    # -- what it holds --------------------------------------------------------------------

    @property
    def params(self) -> Any:
        dense = self.layout.unflatten(self.dense) if self.layout is not None else {}
        if isinstance(dense, np.ndarray) and not self.tables:
            return np.array(dense)
        out: dict[str, Any] = {k: np.array(v) for k, v in dict(dense).items()}
        for t in self.tables:
            out[t.name] = TableRef(self, t.name)
        return out

    def _meta(self, name: str) -> _TableMeta:
        for t in self.tables:
            if t.name == name:
                return t
        raise IterationConfigError(
            f"the model has no table {name!r}; its tables are {[t.name for t in self.tables]}"
        )

    def _plan(self) -> TablePlan:
        return TablePlan.of([(t.name, t.dim, t.columns) for t in self.tables])

    def _check_open(self) -> None:
        if self._owner.closed:
            raise UsageError(
                "this model's shards were closed (Model.close()); ps.load a saved copy"
            )

    def _client(self) -> Shards:
        self._check_open()
        return Shards(
            self.shard_names,
            [0] * (len(self.shard_names) + 1),
            "<f8",
            sync=False,
            plan=self._plan(),
            handles=self.handles,
            token=self.token,
        )

    def num_keys(self, table: str) -> int:
        """Keys the table holds (rows created by training or loading)."""
        self._meta(table)
        infos = self._client()._get([h.info.remote() for h in self.handles])
        return int(sum(i["tables"][table]["keys"] for i in infos))

    def lookup(self, table: str, ids: Any) -> np.ndarray:
        """Rows of ``ids`` ``(len(ids), dim)``, in their order; an unknown id reads as the
        table's initializer's value."""
        meta = self._meta(table)
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise IterationConfigError(
                f"Model.lookup(ids=...) takes a 1-D array of integer ids, got shape "
                f"{ids.shape} dtype {ids.dtype}"
            )
        ids = ids.astype(np.int64, copy=False)
        plan = TablePlan.of([(meta.name, meta.dim, ("ids",))])
        client = self._client()
        client.plan = self._plan()
        keys = step_keys(plan, {"ids": ids}, len(self.handles))
        # route one table's keys; the other tables of the model are not asked
        t = [x.name for x in self.tables].index(table)
        empty = np.zeros(0, dtype=np.int64)
        calls = []
        for j, h in enumerate(self.handles):
            per = [empty if i != t else keys.for_shard(plan, j)[0] for i in range(len(self.tables))]
            calls.append(h.lookup_at.remote(self.token, tuple(per), None, 0))
        replies = client._get(calls)
        vals = np.empty((len(keys.uniq[0]), meta.dim))
        o, c = keys.order[0], keys.cuts[0]
        for j, r in enumerate(replies):
            vals[o[c[j] : c[j + 1]]] = r[3][t]
        return vals[keys.positions[0]["ids"]]

    # -- save and export ------------------------------------------------------------------

    def save(self, uri: str) -> str:
        """Write the model to ``uri`` (a local path or ``pyarrow.fs`` URI every shard can
        reach): each shard writes its rows of every table as Parquet (key, values), in
        parallel; the dense parameters and ``model.json`` from the driver, last. The
        manifest ``model.json`` records every file's rows, size and SHA-256 and the
        save's id, which ``ps.load`` checks before it serves anything."""
        from pyarrow.fs import FileType

        from coordinator._table_io import filesystem

        fs, base = filesystem(uri)
        fs.create_dir(base, recursive=True)
        manifest = f"{base}/{MODEL_FILE}"
        if fs.get_file_info(manifest).type != FileType.NotFound:
            # a save cut short leaves no manifest (an unfinished save), never a mixed one
            fs.delete_file(manifest)
        save_id = new_save_id()
        parts: dict[str, list[dict[str, Any]]] = {t.name: [] for t in self.tables}
        if self.handles:
            self._check_open()
            client = self._client()
            calls = [
                h.save_table.remote(uri, t.name, save_id) for t in self.tables for h in self.handles
            ]
            for i, entry in enumerate(client._get(calls)):
                parts[self.tables[i // len(self.handles)].name].append(entry)
        dense = write_dense(uri, _dense_dict(self.layout, self.dense), save_id)
        write_meta(uri, self._describe(save_id, parts, dense))
        return uri

    def _describe(
        self, save_id: str, parts: Mapping[str, list[dict[str, Any]]], dense: dict[str, Any]
    ) -> dict[str, Any]:
        lay = self.layout
        return {
            "format": FORMAT,
            "save_id": save_id,
            "num_shards": len(self.handles),
            "dense_file": dense,
            "tables": [
                {
                    "name": t.name,
                    "dim": t.dim,
                    "init": t.init.to_plain(),
                    "columns": list(t.columns),
                    "parts": [
                        {k: v for k, v in p.items() if k != "shard"}
                        for p in sorted(parts[t.name], key=lambda p: int(p["shard"]))
                    ],
                }
                for t in self.tables
            ],
            "dense": None
            if lay is None
            else {
                "names": list(lay.names) if lay.names is not None else None,
                "shapes": [list(s) for s in lay.shapes],
                "dtype": lay.dtype,
            },
            "columns": self.columns,
            "csr_columns": self.csr_columns,
            "vector_widths": self.vector_widths,
        }

    def to_dataframe(self, spark: Any, table: str) -> Any:
        """The rows of ``table`` as a Spark DataFrame ``(key: long, vector: vector)``,
        read by one Spark task per shard straight from it (lazily: cache or save the
        DataFrame if you need it after ``close()``)."""
        self._meta(table)
        refuse_on_connect("Model.to_dataframe", spark)
        self._check_open()
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        address = self.ray_address or cluster.ray_address(spark)
        names = list(self.shard_names)
        fn = _export_fn(address, names, table)
        ids = spark.range(len(names), numPartitions=len(names))
        rows = ids.mapInArrow(fn, "key long, values array<double>")
        return rows.select(F.col("key"), array_to_vector(F.col("values")).alias("vector"))

    def transform(
        self,
        df: Any,
        predict_fn: Callable[[Any, dict[str, Any]], Any] | None = None,
        *,
        output_col: str = "prediction",
    ) -> Any:
        """``df`` with ``output_col``: ``predict_fn(params, batch)`` per Arrow batch, in
        Spark tasks, ``params`` holding the dense parameters and, per table, the rows of
        the ids the batch references (an id the table never saw: its initializer's value,
        ``Model.lookup``). ``batch`` holds the columns training read (ids as ``CSR``).
        ``predict_fn`` defaults to the one given to ``ps.train``."""
        from .._streams import _is_dataframe

        fn = predict_fn if predict_fn is not None else self.predict_fn
        if fn is None or not callable(fn):
            raise IterationConfigError(
                "Model.transform needs predict_fn(params, batch) -> one score per row: pass "
                "it here or to ps.train(predict_fn=...)"
            )
        if not _is_dataframe(df):
            raise IterationConfigError(
                f"Model.transform(df=...) must be a pyspark.sql.DataFrame, got {type(df).__name__}"
            )
        if not isinstance(output_col, str) or not output_col or output_col in df.columns:
            raise IterationConfigError(
                f"Model.transform(output_col=...) must be a new column name, got {output_col!r}"
            )
        needed = list(dict.fromkeys([*self.columns, *self.csr_columns]))
        missing = [c for c in needed if c not in df.columns]
        if missing:
            raise IterationConfigError(
                f"Model.transform: df lacks the column(s) {missing} the model was trained on"
            )
        if self.tables:
            refuse_on_connect("Model.transform", df.sparkSession)
            self._check_open()
        from pyspark.sql.types import DoubleType, StructField, StructType

        schema = StructType([*df.schema.fields, StructField(output_col, DoubleType(), False)])
        address = self.ray_address or (
            cluster.ray_address(df.sparkSession) if self.tables else None
        )
        task = _Scorer(
            address=address,
            shard_names=tuple(self.shard_names),
            token=self.token,
            layout=self.layout,
            dense=self.dense,
            plan=self._plan(),
            columns=tuple(c for c in self.columns if c not in self.csr_columns),
            vector_widths=self.vector_widths,
            csr_columns=tuple(self.csr_columns),
            predict_fn=fn,
            output_col=output_col,
        )
        from .._runtime.shipping import dumps

        # the user's predict_fn from their own files is pickled by value, as operators are
        return df.mapInArrow(_Shipped(dumps(task, "predict_fn")), schema)

    def close(self) -> None:
        """Stop the shards (the tables are gone unless saved)."""
        self._owner.close()


def _unpickle_model(state: dict[str, Any]) -> Model:
    model = Model.__new__(Model)
    model.__dict__.update(state)
    model._owner = _Owner(state["handles"])  # a reader of the shards, not their owner
    model._owner.closed = state["_owner"].closed
    model._finalizer = None
    return model


def _dense_dict(layout: Layout | None, dense: np.ndarray) -> dict[str, np.ndarray]:
    if layout is None:
        return {}
    got = layout.unflatten(dense)
    return dict(got) if isinstance(got, dict) else {"": np.asarray(got)}


def _export_fn(address: str, names: Sequence[str], table: str) -> Any:
    def export(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        import ray

        from .._cluster.ray_util import NAMESPACE, connect

        connect(address, namespace=NAMESPACE)
        for batch in batches:
            for j in batch.column(0).to_pylist():
                h: Any = ray.get_actor(names[j], namespace=NAMESPACE)
                start = 0
                while True:
                    keys, values = ray.get(h.export.remote(table, start, _EXPORT_CHUNK))
                    if not len(keys):
                        break
                    start += len(keys)
                    dim = values.shape[1]
                    flat = pa.array(values.reshape(-1))
                    offsets = pa.array(np.arange(0, len(keys) * dim + 1, dim, dtype=np.int32))
                    yield pa.RecordBatch.from_arrays(
                        [pa.array(keys), pa.ListArray.from_arrays(offsets, flat)],
                        ["key", "values"],
                    )

    return export


class _Shipped:
    """A pickled ``mapInArrow`` function, unpickled once per task (in Spark tasks)."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import cloudpickle

        fn = cloudpickle.loads(self.blob)
        yield from fn(batches)


@dataclass(frozen=True)
class _Scorer:
    """The function of ``transform``'s ``mapInArrow``: runs in Spark tasks."""

    address: str | None
    shard_names: tuple[str, ...]
    token: str | None
    layout: Layout | None
    dense: np.ndarray
    plan: TablePlan
    columns: tuple[str, ...]
    vector_widths: Mapping[str, int]
    csr_columns: tuple[str, ...]
    predict_fn: Callable[[Any, dict[str, Any]], Any]
    output_col: str

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from ..ml._features import read_csr
        from ._worker import check_scores

        client = None
        if self.plan.names:
            from .._cluster.ray_util import NAMESPACE, connect

            assert self.address is not None  # set whenever the model has tables
            connect(self.address, namespace=NAMESPACE)
            client = Shards(
                self.shard_names,
                [0] * (len(self.shard_names) + 1),
                "<f8",
                sync=False,
                plan=self.plan,
                token=self.token,
            )
        from ..ml._features import ColumnCache

        for batch in batches:
            n = batch.num_rows
            dense_cols: dict[str, np.ndarray] = {}
            if self.columns:
                cache = ColumnCache(list(self.columns), dict(self.vector_widths))
                cache.add(batch)
                dense_cols = cache.arrays()
            sparse = {}
            for c in self.csr_columns:
                col = batch.column(batch.schema.get_field_index(c))
                sparse[c] = CSR(c, *read_csr(col, c))
            keys = None
            tvals: list[np.ndarray] = []
            if client is not None:
                keys = step_keys(
                    self.plan,
                    {c: sparse[c].ids for c in self.plan.key_columns},
                    len(self.shard_names),
                )
                _, tvals = client.lookup(keys)
            params = batch_params(self.layout, self.dense, self.plan, keys, tvals)
            data = {**dense_cols, **with_locals(self.plan, sparse, keys)}
            scores = check_scores(self.predict_fn(params, data), n, False)
            yield batch.append_column(self.output_col, pa.array(scores, pa.float64()))
