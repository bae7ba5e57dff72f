"""``ps.train``: data-parallel training of any model whose gradient a Python function
computes on a numpy batch, against a sharded parameter server.

Where things run:

* driver: ``train`` checks every argument (before any Spark job), splits ``init`` into
  dense parameters (one flat vector, key ranges over the shards) and sparse tables
  (``ps.Table``: rows keyed by int64 ids, hash-partitioned over the shards), starts the
  shard actors (``coordinator._ps.ParameterShard`` / ``FreeShard`` made Ray actors here,
  ``num_cpus=0``), runs one iteration, and returns the model: dense parameters gathered,
  tables left on their shards (``Model``; nothing on the driver is O(table size)).
* Spark tasks (``_worker.Worker``, one per subtask): read their partition once (id
  columns as CSR), then per step pull only the rows the batch references, fused with
  the previous push (one call per shard per step), call ``grad_fn``, check the whole
  gradient, push it. Only ``(loss, rows, ...)`` per epoch goes to the coordinator.
* Ray coordinator actor (``_epochs.Epochs``): epoch accounting, losses, evaluation
  metrics, termination (``epochs``, ``tol``, early stopping), bounded staleness in
  epochs (SSP), and the shards' resets, checkpoints and restores.

Modes: ``"sync"``: every step is one global update (the subtasks' mean gradients
weighted by their rows, summed in subtask order: deterministic, equal to a single
process loop over the same batches); ``"async"``: each push is applied on arrival,
pulls take the newest parameters, no subtask waits for another (``staleness_steps=k``:
none more than ``k`` steps ahead of the slowest); ``"ssp"``: async steps, but no subtask
more than ``staleness`` epochs ahead of the slowest.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator._endpoint import EndpointAddress
from coordinator._ps import ShardSpec, shard_class
from coordinator._tables import TableSpec
from coordinator._variables import INLINE_LIMIT

from .._body import IterationBody
from .._config import TRANSPORTS, CheckpointConfig, EndpointConfig, IterationConfig
from .._errors import (
    IterationConfigError,
    IterationFailedError,
    TrainFailedError,
    WorkerDiedError,
)
from .._result import IterationResult
from .._runtime.endpoint import SERVE_TIMEOUT, EndpointPlan
from .._runtime.entry import runs_coming
from .._runtime.iterate import iterate_bounded_streams_until_termination
from .._runtime.placement import (
    ActorKind,
    actor_class,
    keep_spare,
    kill,
    launch,
    launch_held,
    retire_as_spare,
    take_spares,
)
from .._runtime.ray_util import NAMESPACE
from .._streams import DataStream, ReplayableDataStreamList
from ..ml._base import (
    check_dataframe,
    check_int,
    check_mode,
    check_progress,
    relaunch_if_worker_died,
)
from ..ml._features import VECTOR, column_kind, resolve_features
from ._client import Shards, TablePlan
from ._epochs import HOT_TOP, METRICS, Epochs, ShardServingPlan, hot_keys
from ._layout import Layout
from ._model import Model, _TableMeta
from ._optim import SGD, Optimizer
from ._tables import Table
from ._worker import EvalPlan, TrainPlan, Worker

__all__ = [
    "TrainResult",
    "launch_shards",
    "launch_table_shards",
    "stop_shards",
    "train",
]

#: ``num_shards=None`` gives each shard about this many parameters (at most ``_MAX_AUTO``).
PARAMS_PER_SHARD = 2_500_000
_MAX_AUTO_SHARDS = 4
#: ``num_shards=None`` with tables: at most this many shards (each its own process) ...
TABLE_SHARDS = 2
#: ... and more than one only when the Ray cluster has CPUs for every task of the run
#: plus this many (the coordinator, the driver, a second shard): else the extra shard
#: only adds a round trip per worker step and a process that competes for the same cores
_SPARE_CPUS_FOR_SHARDS = 4


def table_shards(parallelism: int, cluster_cpus: float) -> int:
    """The shard count of a model with tables under ``num_shards=None`` (before the dense
    part's own rule, ``_shard_bounds``): ``TABLE_SHARDS`` when the cluster's CPUs cover
    the run's ``parallelism`` plus ``_SPARE_CPUS_FOR_SHARDS``, else 1."""
    return TABLE_SHARDS if cluster_cpus >= parallelism + _SPARE_CPUS_FOR_SHARDS else 1


# the client's name where the benchmarks and tests import it from
_Shards = Shards


@dataclass(frozen=True)
class TrainResult:
    """What ``ps.train`` returns.

    ``params``: the trained parameters in ``init``'s structure (dense arrays; each table
    a ``TableRef`` to its rows, which stay on the shards); ``result``: the iteration's
    ``IterationResult`` (``loss`` per epoch, timings, ``plot()``); ``shards``: each
    shard's counters (pushes, updates, calls, bytes in and out, keys held per table, the
    hottest keys and their share of all touches); ``model``: the ``Model`` (``save``,
    ``transform``, ``lookup``, ``to_dataframe``; ``close()`` stops the shards).
    """

    params: Any
    result: IterationResult
    shards: list[dict[str, Any]] = field(default_factory=list)
    model: Model | None = None

    @property
    def loss(self) -> list[float]:
        """The mean loss of each epoch (over every row the epoch trained on)."""
        return [float(v) for v in self.result.outputs.get("loss", [])]

    @property
    def eval(self) -> list[dict[str, float]]:
        """Per epoch, the evaluation metrics over ``eval_df`` (``epoch``, ``rows`` and one
        entry per metric)."""
        return list(self.result.outputs.get("eval", []))

    @property
    def hot_keys(self) -> dict[str, dict[str, Any]]:
        """Per table, its most touched keys over every shard at the end of the run:
        ``hottest`` ``[(key, touches), ...]`` (the top 10), ``touches`` (all: one per key
        per update that touched it) and ``share`` (the top keys' share of them). Per
        epoch, ``result.outputs["shards"][e]["hot_share"]``."""
        return hot_keys(self.shards, HOT_TOP)

    @property
    def best(self) -> dict[str, Any] | None:
        """The epoch with the best first evaluation metric, and that value."""
        got = self.result.outputs.get("best", [])
        return dict(got[-1]) if got else None

    @property
    def restores(self) -> list[dict[str, Any]]:
        """Each restore of the shards from a checkpoint during the run: per shard the
        updates applied after the cut that were discarded (None: the shard had died,
        they were lost with it), and each worker's position at the cut and at the
        failure (the steps between them ran again)."""
        return list(self.result.outputs.get("restore", []))

    def plot(self, path: str | None = None, *, compare: Any = None) -> Any:
        """``IterationResult.plot`` of the training run."""
        if isinstance(compare, TrainResult):
            compare = compare.result
        return self.result.plot(path, compare=compare)

    def _model(self) -> Model:
        if self.model is None:  # pragma: no cover - train always sets it
            raise IterationConfigError("this result holds no model")
        return self.model

    def save(self, uri: str) -> str:
        """``Model.save``: the tables written by their shards in parallel (Parquet)."""
        return self._model().save(uri)

    def transform(self, df: Any, predict_fn: Any = None, *, output_col: str = "prediction") -> Any:
        """``Model.transform``: score ``df`` by looking the rows up on the shards."""
        return self._model().transform(df, predict_fn, output_col=output_col)

    def lookup(self, table: str, ids: Any) -> np.ndarray:
        """``Model.lookup``: rows of ``ids`` (unknown ids: the initializer's value)."""
        return self._model().lookup(table, ids)

    def to_dataframe(self, spark: Any, table: str) -> Any:
        """``Model.to_dataframe``: the table as a DataFrame ``(key, vector)``."""
        return self._model().to_dataframe(spark, table)

    def close(self) -> None:
        """Stop the shards (their tables are gone unless saved)."""
        if self.model is not None:
            self.model.close()


# -- driver -----------------------------------------------------------------------------

_ID_HINT = (
    "ids are read from integer columns (long, int, short, byte), arrays of them (any "
    "length per row) or vector columns (pyspark.ml.linalg SparseVector/DenseVector)"
)


def _is_id_type(dtype: Any) -> bool:
    from pyspark.sql import types as T

    if type(dtype).__name__ == "VectorUDT":
        return True
    if isinstance(dtype, T.ArrayType):
        return isinstance(dtype.elementType, T.IntegralType)
    return isinstance(dtype, T.IntegralType)


def _split_init(init: Any) -> tuple[Any, dict[str, Table]]:
    """``init``'s dense part (an array, a dict, or None) and its tables, by name."""
    if isinstance(init, Table):
        raise IterationConfigError(
            "a ps.Table must be named: pass init={'w': ps.Table(...), ...} (and keys={'w': "
            "'<id column>'})"
        )
    if not isinstance(init, Mapping):
        return init, {}
    tables = {k: v for k, v in init.items() if isinstance(v, Table)}
    seen: dict[int, str] = {}
    for name, t in tables.items():
        if id(t) in seen:
            raise IterationConfigError(
                f"init declares the table {seen[id(t)]!r} twice: {name!r} is the same "
                f"ps.Table object, so both would get the same rows (same seed, same keys); "
                f"give each name its own ps.Table(...)"
            )
        seen[id(t)] = name
    if not tables:
        return init, {}
    dense = {k: v for k, v in init.items() if k not in tables}
    return (dense or None), tables


def _check_keys(
    df: Any,
    tables: Mapping[str, Table],
    keys: Any,
    sparse_columns: Any,
    dense_names: Sequence[str],
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """Each table's key columns and every column read as CSR, checked against ``df``."""
    fields = {f.name: f for f in df.schema.fields}
    out: dict[str, tuple[str, ...]] = {}
    if keys is None:
        keys = {}
    if not isinstance(keys, Mapping):
        raise IterationConfigError(
            f"ps.train(keys=...) must map each table's name to its id column(s), e.g. "
            f"keys={{'w': 'ids'}}, got {type(keys).__name__}"
        )
    for name in keys:
        if name not in tables:
            what = (
                "a dense parameter (only a ps.Table takes keys)"
                if name in dense_names
                else "not in init"
            )
            raise IterationConfigError(
                f"ps.train(keys=...) names {name!r}, which is {what}; tables: {sorted(tables)}"
            )
    for name in tables:
        if name not in keys:
            raise IterationConfigError(
                f"ps.train(keys=...) gives no id column for the table {name!r}: add "
                f"keys={{{name!r}: '<column of its ids>'}}"
            )
        given = keys[name]
        cols: tuple[str, ...] = (
            (given,)
            if isinstance(given, str)
            else tuple(given)
            if isinstance(given, Sequence)
            else ()
        )
        if not cols or not all(isinstance(c, str) and c for c in cols):
            raise IterationConfigError(
                f"ps.train(keys={{{name!r}: ...}}) must be a column name or a non-empty list "
                f"of them, got {given!r}"
            )
        if len(set(cols)) != len(cols):
            raise IterationConfigError(
                f"ps.train(keys={{{name!r}: {list(cols)}}}) lists a column twice; list each once"
            )
        out[name] = cols
    if isinstance(sparse_columns, str) or not isinstance(sparse_columns, Sequence):
        raise IterationConfigError(
            f"ps.train(sparse_columns=...) must be a list of column names, got {sparse_columns!r}"
        )
    every = list(dict.fromkeys([c for cols in out.values() for c in cols] + list(sparse_columns)))
    for c in every:
        where = "sparse_columns" if c in sparse_columns else "keys"
        if c not in fields:
            raise IterationConfigError(
                f"ps.train({where}=...): column {c!r} is not in the DataFrame; its columns "
                f"are {list(fields)}"
            )
        dtype = fields[c].dataType
        if not _is_id_type(dtype):
            cast = (
                f"F.col({c!r}).cast('array<long>')"
                if type(dtype).__name__ == "ArrayType"
                else f"F.col({c!r}).cast('long')"
            )
            raise IterationConfigError(
                f"ps.train({where}=...): the id column {c!r} has type "
                f"{dtype.simpleString()}, which is not integral; {_ID_HINT}. Cast it "
                f"({cast}) or hash it to integers first"
            )
    return out, tuple(every)


def _columns(df: Any, columns: Any, csr: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """The dense columns (numeric, arrays, vectors) besides the CSR ones, and the width of
    each dense vector column."""
    fields = {f.name: f for f in df.schema.fields}
    if columns is None:
        names = [
            n for n, f in fields.items() if column_kind(f.dataType) is not None and n not in csr
        ]
        if not names and not csr:
            raise IterationConfigError(
                "ps.train: the DataFrame has no numeric, array or vector column to train on"
            )
    elif isinstance(columns, str) or not isinstance(columns, Sequence) or not columns:
        raise IterationConfigError(
            f"ps.train(columns=...) must be a non-empty list of column names (or None for "
            f"every numeric, array and vector column), got {columns!r}"
        )
    else:
        names = []
        for n in columns:
            if n not in fields:
                raise IterationConfigError(
                    f"ps.train(columns=...): column {n!r} is not in the DataFrame; its "
                    f"columns are {list(fields)}"
                )
            if n in csr:
                continue  # read as CSR
            if column_kind(fields[n].dataType) is None:
                raise IterationConfigError(
                    f"ps.train(columns=...): column {n!r} has type "
                    f"{fields[n].dataType.simpleString()}, which is not numeric, an array "
                    f"of numbers or a vector; cast it or leave it out"
                )
            names.append(n)
    widths = {
        n: resolve_features(df, n, param="ps.train(columns=...)").dim
        for n in names
        if column_kind(fields[n].dataType) == VECTOR
    }
    return names, widths


def _shard_bounds(size: int, num_shards: int | None) -> list[int]:
    if num_shards is None:
        num_shards = min(_MAX_AUTO_SHARDS, max(1, math.ceil(size / PARAMS_PER_SHARD)))
    cuts = np.linspace(0, size, num_shards + 1).round().astype(int)
    return [int(c) for c in cuts]


def _check_eval(
    eval_df: Any,
    predict_fn: Any,
    eval_metrics: Any,
    label_col: Any,
    early_stopping: Any,
    needed: Sequence[str],
) -> tuple[tuple[str, ...], int | None]:
    if eval_df is None:
        if early_stopping is not None:
            raise IterationConfigError(
                "ps.train(early_stopping=...) stops on an evaluation metric: give eval_df= "
                "and predict_fn= too"
            )
        return (), None
    check_dataframe("ps.train", eval_df, call="ps.train(eval_df=...)")
    if not callable(predict_fn):
        raise IterationConfigError(
            "ps.train(eval_df=...) needs predict_fn(params, batch) -> one score per row (a "
            "probability for the log loss)"
        )
    metrics = (eval_metrics,) if isinstance(eval_metrics, str) else tuple(eval_metrics or ())
    if not metrics or any(m not in METRICS for m in metrics):
        raise IterationConfigError(
            f"ps.train(eval_metrics=...) must name metrics among {sorted(METRICS)}, got "
            f"{eval_metrics!r}"
        )
    cols = set(eval_df.columns)
    if not isinstance(label_col, str) or label_col not in cols:
        raise IterationConfigError(
            f"ps.train(label_col={label_col!r}) must be a column of eval_df (its columns are "
            f"{eval_df.columns})"
        )
    missing = [c for c in needed if c not in cols]
    if missing:
        raise IterationConfigError(
            f"ps.train(eval_df=...) lacks the column(s) {missing} that training reads; "
            f"predict_fn gets the same columns as grad_fn"
        )
    check_int("ps.train", "early_stopping", early_stopping, minimum=1, optional=True)
    return metrics, early_stopping


def train(
    df: Any,
    grad_fn: Callable[[Any, dict[str, Any]], Any],
    init: Any,
    *,
    keys: Mapping[str, str | Sequence[str]] | None = None,
    sparse_columns: Sequence[str] = (),
    optimizer: Optimizer | None = None,
    mode: str = "sync",
    staleness: int | None = None,
    staleness_steps: int | None = None,
    epochs: int = 10,
    batch_size: int | None = None,
    columns: Sequence[str] | None = None,
    num_shards: int | None = None,
    tol: float | None = None,
    shuffle: bool = False,
    seed: int = 0,
    parallelism: int | None = None,
    progress: bool | None = None,
    name: str | None = None,
    checkpoint: CheckpointConfig | None = None,
    max_restarts: int | None = None,
    eval_df: Any = None,
    predict_fn: Callable[[Any, dict[str, Any]], Any] | None = None,
    eval_metrics: Sequence[str] | str = ("log_loss", "auc"),
    label_col: str = "label",
    early_stopping: int | None = None,
    transport: str = "auto",
    endpoint: EndpointConfig | None = None,
) -> TrainResult:
    """Train ``init`` by ``grad_fn`` over ``df`` on a sharded parameter server.

    * ``grad_fn(params, batch) -> (loss, grad)``: runs in the Spark tasks. ``params`` has
      ``init``'s structure: dense parameters as read-only arrays, each table as a
      ``ps.Rows`` (``ids``: the unique ids the batch references, ``values``: their rows).
      ``batch`` maps each column to the batch's rows: numpy arrays (vector and array
      columns 2-D), id columns (``keys``, ``sparse_columns``) as ``ps.CSR``. Return the
      batch's mean loss and the gradient in ``params``' structure: a dense part as an
      array of exactly its shape or a ``ps.Sparse``; a table's part as ``(len(ids),
      dim)`` rows aligned with ``params[name].ids`` (``x.t_dot(r)``); leave a part out
      (or None) to not update it.
    * ``init``: a numeric array, or a dict of arrays and ``ps.Table(dim, init=...)``.
    * ``keys``: each table's id column(s): an integer column (one id per row), an array
      of integers (any length per row) or a vector column (a ``SparseVector``'s indices
      and values). ``sparse_columns``: more id columns read as ``ps.CSR`` (for a dense
      parameter indexed by ids, e.g. ``x.dot(params["w"])`` with ``w`` an array).
    * ``optimizer``: ``ps.SGD(...)`` (default ``SGD(0.01)``), ``ps.Adam``, ``ps.Adagrad``,
      ``ps.FTRL``, applied by the shards (a ``Table`` may carry its own).
    * ``mode``: ``"sync"``, ``"async"`` (``staleness_steps``: at most that many steps
      ahead of the slowest worker) or ``"ssp"`` (``staleness`` epochs).
    * ``epochs``, ``batch_size`` (rows per step of each subtask, ``None``: the whole
      partition), ``shuffle`` (a seeded new order every epoch), ``tol`` (stop once an
      epoch's loss is <= ``tol``).
    * ``num_shards``: shard actors (``None``: one per 2.5 million dense parameters, at
      most 4; with tables at least 1, or 2 when Ray's cluster has at least
      ``parallelism + 4`` CPUs). A sync run's model does not depend on it.
    * ``checkpoint``: ``hi.CheckpointConfig``: the shards are part of every checkpoint
      (each writes its own part, in parallel); a task or shard that dies is relaunched
      (``max_restarts``) and every shard restored from the newest cut.
    * ``eval_df``, ``predict_fn(params, batch) -> scores``, ``eval_metrics``
      (``"log_loss"``, ``"auc"``), ``label_col``: evaluated after each epoch (in
      ``result.eval`` and the progress line); ``early_stopping=k``: stop after ``k``
      epochs without a better first metric.
    * ``transport``, ``endpoint``: how the Spark tasks reach the coordinator and the
      shards, as ``IterationConfig``'s (``"auto"``: the endpoint on a Spark Connect
      session, Ray otherwise). Over the endpoint each shard serves its own, with the
      run's token, and the tasks need nothing of Ray (docs/endpoint.md).

    Checked before any job: every argument, ``init`` finite (a NaN/inf names the
    parameter and index), the id columns integral. Checked on each worker before a step
    is sent: the gradient has exactly its parameter's shape (a table's: ``(len(ids),
    dim)``) and is finite, the loss is finite (``NonFiniteGradient`` names the parameter
    and index, or the table and key, and the partition, epoch and step; no shard
    receives any part of that step). A loss that rises for 5 epochs in a row stops the
    run naming the optimizer's learning rate. A failed training raises
    ``TrainFailedError`` whose ``params`` are what the shards held when it stopped.
    """
    check_dataframe("ps.train", df, call="ps.train(df, ...)")
    if not callable(grad_fn):
        raise IterationConfigError(
            f"ps.train(grad_fn=...) must be a function (params, batch) -> (loss, grad), got "
            f"{type(grad_fn).__name__}"
        )
    dense_init, tables = _split_init(init)
    layout, flat = Layout.of(dense_init) if dense_init is not None else (None, np.zeros(0))
    if optimizer is None:
        optimizer = SGD()
    if not isinstance(optimizer, Optimizer):
        raise IterationConfigError(
            f"ps.train(optimizer=...) must be hybrid_iter.ps.SGD(...), ps.Adam(...), "
            f"ps.Adagrad(...) or ps.FTRL(...), got {type(optimizer).__name__}"
        )
    iteration_staleness = check_mode("ps.train", mode, staleness)
    check_int("ps.train", "staleness_steps", staleness_steps, minimum=0, optional=True)
    if staleness_steps is not None and mode != "async":
        raise IterationConfigError(
            f"ps.train(staleness_steps=...) bounds how far async workers run apart: it "
            f"needs mode='async' (got mode={mode!r})"
        )
    check_int("ps.train", "epochs", epochs, minimum=1)
    check_int("ps.train", "batch_size", batch_size, minimum=1, optional=True)
    check_int("ps.train", "num_shards", num_shards, minimum=1, optional=True)
    size = layout.size if layout is not None else 0
    if num_shards is not None and not tables and num_shards > size:
        raise IterationConfigError(
            f"ps.train(num_shards={num_shards}) exceeds the {size} parameters; use at "
            f"most one shard per parameter"
        )
    if tol is not None and (
        isinstance(tol, bool) or not isinstance(tol, (int, float)) or math.isnan(tol)
    ):
        raise IterationConfigError(f"ps.train(tol=...) must be a number or None, got {tol!r}")
    if not isinstance(shuffle, bool):
        raise IterationConfigError(f"ps.train(shuffle=...) must be True or False, got {shuffle!r}")
    check_int("ps.train", "seed", seed, minimum=0)
    check_int("ps.train", "parallelism", parallelism, minimum=1, optional=True)
    check_progress("ps.train", progress)
    if transport not in TRANSPORTS:
        raise IterationConfigError(
            f"ps.train(transport=...) must be one of {TRANSPORTS}, got {transport!r}"
        )
    if endpoint is not None and not isinstance(endpoint, EndpointConfig):
        raise IterationConfigError(
            f"ps.train(endpoint=...) must be a hybrid_iter.EndpointConfig(...), got "
            f"{type(endpoint).__name__}"
        )
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        raise IterationConfigError(
            f"ps.train(checkpoint=...) must be a hybrid_iter.CheckpointConfig(path, ...), got "
            f"{type(checkpoint).__name__}"
        )
    dense_names = list(layout.names or ()) if layout is not None else []
    key_cols, csr = _check_keys(df, tables, keys, sparse_columns, dense_names)
    names, widths = _columns(df, columns, csr)
    metrics, patience = _check_eval(
        eval_df, predict_fn, eval_metrics, label_col, early_stopping, [*names, *csr]
    )
    specs = tuple(
        TableSpec(
            t,
            int(tab.dim),
            tab.init.plain(),
            (tab.optimizer or optimizer).rule,
            (tab.optimizer or optimizer).rule_params(),
        )
        for t, tab in tables.items()
    )
    plan_tables = TablePlan.of([(s.name, s.dim, key_cols[s.name]) for s in specs])

    from spark_ops import available_task_slots, read_columns

    from .._runtime.iterate import _ray_address
    from .._runtime.ray_util import connect

    n = parallelism or available_task_slots(df.sparkSession)
    if n < 1:
        raise IterationConfigError("Spark has no task slots; start executors or a Session")
    runs_coming()  # the shards start before the iteration's own entry says so
    address = _ray_address(df.sparkSession)
    connect(address, namespace=NAMESPACE)
    if num_shards is None and tables:
        import ray

        cpus = float(ray.cluster_resources().get("CPU", 0.0))
        # the dense part's rule still holds when it asks for more
        bounds = _shard_bounds(size, max(table_shards(n, cpus), len(_shard_bounds(size, None)) - 1))
    else:
        bounds = _shard_bounds(size, num_shards)
    config = IterationConfig(
        staleness=iteration_staleness,
        max_epochs=epochs,
        parallelism=n,
        progress=progress,
        progress_tag="ps",
        name=name or f"ps[{mode}]",
        checkpoint=checkpoint,
        max_restarts=max_restarts,
        transport=transport,
        endpoint=endpoint,
    )
    served = EndpointPlan.of(config, df.sparkSession)  # None: the shards through Ray
    if served is not None:
        # one token for the run: the coordinator's endpoint and every shard's
        config = dataclasses.replace(
            config,
            transport="endpoint",
            endpoint=dataclasses.replace(
                config.endpoint or EndpointConfig(), token=served.spec.token
            ),
        )
    key = b""
    if checkpoint is not None:
        from coordinator._checkpoint import checkpoint_key

        key = checkpoint_key()

    def run_once() -> TrainResult:
        # new shards from ``init`` each launch: a relaunch never sees a failed one's updates
        shards: list[Any] = []
        shard_names: list[str] = []
        model: Model | None = None
        ended_well = False
        made = _Made(layout, specs, key_cols, [], [], [], predict_fn, names, widths, csr, address)
        try:
            # the shards' processes start while the Spark stage starts and reads its
            # data (the tasks' first call to a shard waits for it): not one after the other
            shard_names, shards, held, started = _start(
                flat,
                bounds,
                optimizer,
                num_workers=n,
                sync=mode == "sync",
                tables=specs,
                staleness_steps=staleness_steps,
                max_restarts=config.restarts,
                key=key,
                label=config.name or "train",
                served=served is not None,
            )
            made.shard_names, made.shards, made.held = shard_names, shards, held
            addresses, serving = None, None
            if served is not None:
                addresses, serving = serve_shards(shards, started, served)
            evaluation = None
            if eval_df is not None:
                assert predict_fn is not None
                evaluation = EvalPlan(
                    predict_fn,
                    label_col,
                    tuple(dict.fromkeys([*names, *csr, label_col])),
                    "log_loss" in metrics,
                )
            plan = TrainPlan(
                layout=layout,
                columns=tuple(names),
                vector_widths=widths,
                csr_columns=csr,
                tables=plan_tables,
                shard_names=tuple(shard_names),
                bounds=tuple(bounds),
                dtype=layout.dtype if layout is not None else "<f8",
                batch_size=batch_size,
                shuffle=shuffle,
                seed=seed,
                sync=mode == "sync",
                staleness_steps=staleness_steps,
                eval=evaluation,
                shard_endpoints=addresses,
            )
            worker = Worker(grad_fn=grad_fn, plan=plan, optimizer=optimizer)
            parts_uri = checkpoint.path.rstrip("/") + "/ps" if checkpoint is not None else None
            coordinator = Epochs(
                epochs,
                tol,
                optimizer,
                shard_names=shard_names,
                parts_uri=parts_uri,
                keep_parts=(checkpoint.keep_last + 1) if checkpoint is not None else 0,
                metrics=metrics,
                patience=patience,
                serving=serving,
            )
            body = IterationBody(
                partition=worker,
                coordinator=coordinator,
                # else epochs (max_epochs) ends it
                criteria=True if tol is not None or patience is not None else None,
            )
            scalar = [c for c in names if c not in widths and column_kind(_type(df, c)) == "scalar"]
            # over cached data: planned on the cache relation (``cached_view``)
            _, data = read_columns(df, [*names, *csr])
            streams = [DataStream(data, numeric_columns=tuple(scalar) or None)]
            if evaluation is not None:
                streams.append(DataStream(eval_df.select(*evaluation.columns)))
            try:
                result = iterate_bounded_streams_until_termination(
                    {"epoch": 0}, ReplayableDataStreamList.not_replay(*streams), config, body
                )
            except BaseException:
                _raise_if_not_started(started)  # a shard that could not start says why
                raise
            values = _get([s.values.remote() for s in shards])
            info = _get([s.info.remote(HOT_TOP) for s in shards])
            model = made.model(values)
            ended_well = True
        except WorkerDiedError:
            raise  # relaunched from ``init`` below: nothing of this launch is kept
        except IterationFailedError as ex:
            # what the shards applied before the failure is kept, not lost with them
            model = made.salvage()
            failed = TrainFailedError(ex.message, ex.failures, model.params if model else None)
            raise failed.with_traceback(ex.__traceback__) from ex.__cause__
        finally:
            kind = shard_kind(mode == "sync", staleness_steps, served is not None, n)
            if model is None or not model.tables:  # a dense model is all on the driver now
                if ended_well and not config.restarts:
                    # the next run of this kind takes them, up and emptied
                    retire_shards(kind, shards, shard_names)
                else:
                    stop_shards(shards)
            if not config.restarts:
                # the next run of this kind takes processes started now, in the background
                keep_shard_spares(kind, len(bounds) - 1)
        return TrainResult(model.params, result, info, model)

    if checkpoint is not None:
        return run_once()  # the iteration relaunches from its checkpoints itself
    return relaunch_if_worker_died("ps.train", run_once)


def _get(calls: list[Any], timeout: float | None = None) -> list[Any]:
    import ray

    return list(ray.get(calls, timeout=timeout))


@dataclass
class _Made:
    """What the model is built from once the run ends (or fails)."""

    layout: Layout | None
    specs: Sequence[TableSpec]
    key_cols: Mapping[str, tuple[str, ...]]
    shard_names: list[str]
    shards: list[Any]
    held: list[Any]
    predict_fn: Any
    names: Sequence[str]
    widths: Mapping[str, int]
    csr: Sequence[str]
    address: str

    def model(self, values: Sequence[np.ndarray]) -> Model:
        """The trained model: the dense values gathered (fresh arrays), the tables left
        on the shards (which the model then owns; without tables they are stopped)."""
        final = np.concatenate(values) if len(values) > 1 else np.array(values[0])
        tables = [_TableMeta(s.name, s.dim, s.init, self.key_cols[s.name]) for s in self.specs]
        token = _get([self.shards[0].hello.remote()])[0][0] if tables else None
        return Model(
            layout=self.layout,
            dense=final,
            tables=tables,
            shard_names=self.shard_names if tables else (),
            handles=self.shards if tables else (),
            token=token,
            predict_fn=self.predict_fn,
            columns=self.names,
            vector_widths=self.widths,
            csr_columns=self.csr,
            ray_address=self.address,
            held=self.held,
        )

    def salvage(self) -> Model | None:
        """The model as the shards hold it now, or None when one cannot be read."""
        if not self.shards:
            return None
        try:
            values = _get([s.values.remote() for s in self.shards], timeout=_SALVAGE_TIMEOUT)
            return self.model(values)
        except Exception:  # a shard lost with the failure: the error itself says what failed
            return None


#: seconds to read the shards after a failure (a lost shard must not hang the error)
_SALVAGE_TIMEOUT = 60.0


def launch_shards(
    flat: np.ndarray,
    bounds: Sequence[int],
    optimizer: Optimizer,
    *,
    num_workers: int,
    sync: bool,
) -> tuple[list[str], list[Any]]:
    """Start one shard actor per key range ``[bounds[i], bounds[i + 1])`` of a dense
    model (driver; Ray must be connected); returns their names and handles once every
    one is up."""
    names, handles, _ = _launch(flat, bounds, optimizer, num_workers=num_workers, sync=sync)
    return names, handles


def _launch(
    flat: np.ndarray,
    bounds: Sequence[int],
    optimizer: Optimizer,
    *,
    num_workers: int,
    sync: bool,
    tables: Sequence[TableSpec] = (),
    staleness_steps: int | None = None,
    max_restarts: int = 0,
    key: bytes = b"",
    label: str = "train",
) -> tuple[list[str], list[Any], list[Any]]:
    """``launch_shards`` with tables, a step staleness bound, restarts (then the third
    item holds the creation arguments, to keep while Ray may restart a shard) and the
    checkpoint key."""
    import ray

    names, handles, held, started = _start(
        flat,
        bounds,
        optimizer,
        num_workers=num_workers,
        sync=sync,
        tables=tables,
        staleness_steps=staleness_steps,
        max_restarts=max_restarts,
        key=key,
        label=label,
    )
    try:
        ray.get(started)  # started (a bad spec fails here)
    except BaseException:
        stop_shards(handles)
        raise
    return names, handles, held


def _start(
    flat: np.ndarray,
    bounds: Sequence[int],
    optimizer: Optimizer,
    *,
    num_workers: int,
    sync: bool,
    tables: Sequence[TableSpec] = (),
    staleness_steps: int | None = None,
    max_restarts: int = 0,
    key: bytes = b"",
    label: str = "train",
    served: bool = False,
) -> tuple[list[str], list[Any], list[Any], list[Any]]:
    """``_launch`` without waiting: the shards are created (named: tasks find them at
    once) and their processes start in the background; the fourth item holds one
    reference per shard that resolves once it is up (or raises why it could not).
    ``served``: shards that can serve their own endpoint (``serve_shards``), whose
    replies always carry the values (no object-store reference: no Ray on the caller)."""
    run_id = uuid.uuid4().hex[:12]
    kind = shard_kind(sync, staleness_steps, served, num_workers, max_restarts)
    # the run's name in the actors' names: findable by it (dashboard, state API)
    tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:40] or "train"
    count = len(bounds) - 1
    specs = [
        ShardSpec(
            shard_id=i,
            lo=bounds[i],
            hi=bounds[i + 1],
            init=flat[bounds[i] : bounds[i + 1]],
            rule=optimizer.rule,
            rule_params=optimizer.rule_params(),
            num_workers=num_workers,
            sync=sync,
            tables=tuple(tables),
            num_shards=count,
            token=run_id,
            staleness_steps=staleness_steps,
            run_id=run_id,
            key=key,
            inline_limit=sys.maxsize if served else INLINE_LIMIT,
        )
        for i in range(count)
    ]
    # a shard Ray never restarts may be a spare of its kind (started ahead: the session's
    # warm-up, or the previous run's refill), configured with this run's spec as its
    # constructor would have been; a restart would run the constructor again, with no
    # spec, so shards that may restart are always started here
    pooled: list[Any] = [None] * count
    if not max_restarts:
        pooled = take_spares(kind, "configure", [(spec,) for spec in specs])
    names: list[str] = []
    handles: list[Any] = []
    held: list[Any] = []
    try:
        for i, spec in enumerate(specs):
            if pooled[i] is not None:
                handle, name, _ = pooled[i]
            else:
                name = f"hybrid_iter.ps.{tag}.{run_id}.shard{i}"
                if max_restarts:
                    launched = launch_held(kind, name, spec)
                    handle = launched.handle
                    held.append(launched)
                else:
                    handle = launch(kind, name, spec)
            names.append(name)
            handles.append(handle)
        started = [h.hello.remote() for h in handles]
    except BaseException:
        stop_shards(handles)
        stop_shards([p[0] for p in pooled if p is not None and p[0] not in handles])
        raise
    return names, handles, held, started


#: the name prefix of spare shards (``keep_shard_spares``)
SPARE_PREFIX = "hybrid_iter.ps.spare"


def shard_kind(
    sync: bool,
    staleness_steps: int | None,
    served: bool,
    num_workers: int,
    max_restarts: int = 0,
) -> ActorKind:
    """The actor class and options of a run's shards (the spare pool's key)."""
    # sync mode: an asyncio actor whose pulls wait for a step; async mode: a plain actor,
    # one call at a time with no event loop in between (nothing ever waits there)
    waits = sync or staleness_steps is not None
    concurrency = max(1000, 4 * num_workers + 16) if waits else 1
    return actor_class(
        shard_class(sync, staleness_steps, served=served),
        max_concurrency=concurrency,
        max_restarts=max_restarts,
    )


def keep_shard_spares(kind: ActorKind, count: int) -> list[Any]:
    """Start spare shards of ``kind`` until its pool holds ``count`` (at most
    ``SPARE_POOL``): idle processes the next run of that kind configures (driver; never
    raises, never waits)."""
    return keep_spare(kind, count=count, prefix=SPARE_PREFIX)


def serve_shards(
    handles: Sequence[Any], started: Sequence[Any], plan: EndpointPlan
) -> tuple[tuple[EndpointAddress, ...], ShardServingPlan]:
    """Every shard serving its own endpoint (once each is up): the addresses the tasks
    dial, and what the run's coordinator re-serves a restarted shard with (the same
    address: the tasks' plans name it)."""
    import ray

    from .._errors import SessionError

    _raise_if_not_started(started)
    spec = plan.spec
    host = spec.bind.rpartition(":")[0] if spec.bind else ""
    first = dataclasses.replace(spec, bind=f"{host}:0" if host else "", advertise=None)
    try:
        locations = ray.get(
            [h.serve_endpoint.remote(first) for h in handles], timeout=SERVE_TIMEOUT
        )
    except ray.exceptions.GetTimeoutError:
        raise SessionError(
            f"the parameter shards did not start serving their endpoints within "
            f"{SERVE_TIMEOUT:g} s: look for the shard actors' errors in Ray's logs"
        ) from None
    except ray.exceptions.RayTaskError as ex:
        # the server names its own cause (EndpointBindError: the address, the certificate)
        cause = ex.cause if ex.cause is not None else ex
        raise SessionError(
            f"the parameter shards cannot serve their endpoints on "
            f"{first.bind or '<their node>:0'}: "
            f"{(str(cause).splitlines() or [type(cause).__name__])[0]}"
        ) from ex
    specs = []
    for loc in locations:
        hostport = loc.split("://", 1)[-1]
        port = hostport.rpartition(":")[2]
        specs.append(
            dataclasses.replace(
                spec, bind=f"{host or hostport.rpartition(':')[0]}:{port}", advertise=hostport
            )
        )
    addresses = tuple(
        EndpointAddress(loc, spec.token, plan.root_certs, plan.connect_timeout) for loc in locations
    )
    return addresses, ShardServingPlan(tuple(specs), tuple(locations))


#: seconds a failed run waits for its shards' start to learn whether one failed to start
_START_CHECK_TIMEOUT = 60.0


def _raise_if_not_started(started: Sequence[Any]) -> None:
    """Raise the error of a shard that could not start (its constructor's), which is the
    cause of a run that failed with it: the tasks only saw the shard gone. Returns when
    every shard started, or when they cannot be asked."""
    import ray

    try:
        ray.get(list(started), timeout=_START_CHECK_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        return
    except ray.exceptions.RayActorError as ex:
        # its message ends with the creation task's exception (the traceback before it)
        lines = [ln.strip() for ln in str(ex).splitlines() if ln.strip()]
        raise IterationConfigError(
            f"a parameter shard could not start: {lines[-1] if lines else type(ex).__name__}"
        ) from ex


def launch_table_shards(
    tables: Sequence[TableSpec], num_shards: int
) -> tuple[str, list[str], list[Any], str]:
    """Shards holding only ``tables`` (a loaded model; driver, in a Session): the Ray
    address, their names, handles and fencing token."""
    from .._session import Session

    session = Session.current()
    if session is None:
        import ray

        if not ray.is_initialized():
            raise IterationConfigError(
                "ps.load needs Ray: run it inside `with hybrid_iter.Session.local():` (or "
                "another Session)"
            )
        address = ray.get_runtime_context().gcs_address
    else:
        address = session.ray_address
        from .._runtime.ray_util import connect

        connect(address, namespace=NAMESPACE)
    names, handles, _ = _launch(
        np.zeros(0), [0] * (num_shards + 1), SGD(1.0), num_workers=1, sync=False, tables=tables
    )
    token = _get([handles[0].hello.remote()])[0][0]
    return address, names, handles, token


def retire_shards(kind: ActorKind, handles: Sequence[Any], names: Sequence[str]) -> None:
    """The shards of a run that ended well, emptied (``forget``) into the spare pool of
    ``kind``; one that declines or cannot be reached is killed (driver; never raises)."""
    for i, (handle, name) in enumerate(zip(handles, names, strict=True)):
        if not retire_as_spare(kind, handle, name, method="forget"):
            kill(handle, f"parameter shard {i}")


def stop_shards(handles: Sequence[Any]) -> None:
    for i, h in enumerate(handles):
        kill(h, f"parameter shard {i}")  # never hides the training's own outcome


def _type(df: Any, name: str) -> Any:
    return next(f.dataType for f in df.schema.fields if f.name == name)
