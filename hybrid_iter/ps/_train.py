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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator._tables import TableSpec

from .._body import IterationBody
from .._cluster import context as cluster
from .._cluster.ray_util import NAMESPACE
from .._config import TRANSPORTS, CheckpointConfig, EndpointConfig, IterationConfig
from .._errors import (
    IterationConfigError,
    IterationFailedError,
    TrainFailedError,
    WorkerDiedError,
)
from .._result import IterationResult
from .._runtime.controller import relaunch_if_worker_died
from .._runtime.endpoint import EndpointPlan
from .._runtime.entry import runs_coming
from .._runtime.iterate import iterate_bounded_streams_until_termination
from .._streams import DataStream, ReplayableDataStreamList
from ..ml._base import check_dataframe, check_int, check_mode, check_progress
from ..ml._features import column_kind
from ._client import TablePlan
from ._epochs import HOT_TOP, Epochs, hot_keys
from ._layout import Layout
from ._model import Model, _TableMeta
from ._optim import SGD, Optimizer
from ._shards import (
    get,
    keep_shard_spares,
    raise_if_not_started,
    retire_shards,
    serve_shards,
    shard_bounds,
    shard_kind,
    start_shards,
    stop_shards,
    table_shards,
)
from ._train_args import check_eval, check_keys, column_type, feature_columns, split_init
from ._worker import EvalPlan, TrainPlan, Worker

__all__ = ["TrainLaunch", "TrainResult", "train"]


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
        token = get([self.shards[0].hello.remote()])[0][0] if tables else None
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
            values = get([s.values.remote() for s in self.shards], timeout=SALVAGE_TIMEOUT)
            return self.model(values)
        except Exception:  # a shard lost with the failure: the error itself says what failed
            return None


#: seconds to read the shards after a failure (a lost shard must not hang the error)
SALVAGE_TIMEOUT = 60.0


@dataclass(frozen=True)
class TrainLaunch:
    """One launch of a ``ps.train`` run, made by ``train`` once every argument is
    checked (driver): new shards from ``init``, the iteration over the data, and the
    model. A relaunch after a Spark worker died is another call: it never sees a failed
    launch's updates. What the shards applied before a failure is kept in the
    ``TrainFailedError``; after a run that ended well, a dense model's shards go back to
    the spare pool emptied."""

    df: Any
    eval_df: Any
    grad_fn: Callable[[Any, dict[str, Any]], Any]
    predict_fn: Callable[[Any, dict[str, Any]], Any] | None
    #: the dense parameters, flat, and the shards' key ranges of them
    flat: np.ndarray
    bounds: Sequence[int]
    layout: Layout | None
    specs: tuple[TableSpec, ...]
    key_cols: Mapping[str, tuple[str, ...]]
    plan_tables: TablePlan
    names: Sequence[str]
    widths: Mapping[str, int]
    csr: Sequence[str]
    optimizer: Optimizer
    mode: str
    staleness_steps: int | None
    epochs: int
    tol: float | None
    batch_size: int | None
    shuffle: bool
    seed: int
    metrics: Sequence[str]
    patience: int | None
    label_col: str
    checkpoint: CheckpointConfig | None
    config: IterationConfig
    #: the shards' endpoint plan (None: the tasks reach them through Ray)
    served: EndpointPlan | None
    #: the checkpoint key (empty without checkpoints)
    key: bytes
    parallelism: int
    address: str

    def __call__(self) -> TrainResult:
        from spark_ops import read_columns

        # new shards from ``init`` each launch: a relaunch never sees a failed one's updates
        shards: list[Any] = []
        shard_names: list[str] = []
        model: Model | None = None
        ended_well = False
        made = _Made(
            self.layout,
            self.specs,
            self.key_cols,
            [],
            [],
            [],
            self.predict_fn,
            self.names,
            self.widths,
            self.csr,
            self.address,
        )
        try:
            # the shards' processes start while the Spark stage starts and reads its
            # data (the tasks' first call to a shard waits for it): not one after the other
            shard_names, shards, held, started = start_shards(
                self.flat,
                self.bounds,
                self.optimizer,
                num_workers=self.parallelism,
                sync=self.mode == "sync",
                tables=self.specs,
                staleness_steps=self.staleness_steps,
                max_restarts=self.config.restarts,
                key=self.key,
                label=self.config.name or "train",
                served=self.served is not None,
            )
            made.shard_names, made.shards, made.held = shard_names, shards, held
            addresses, serving = None, None
            if self.served is not None:
                addresses, serving = serve_shards(shards, started, self.served)
            evaluation = None
            if self.eval_df is not None:
                assert self.predict_fn is not None
                evaluation = EvalPlan(
                    self.predict_fn,
                    self.label_col,
                    tuple(dict.fromkeys([*self.names, *self.csr, self.label_col])),
                    "log_loss" in self.metrics,
                )
            plan = TrainPlan(
                layout=self.layout,
                columns=tuple(self.names),
                vector_widths=self.widths,
                csr_columns=tuple(self.csr),
                tables=self.plan_tables,
                shard_names=tuple(shard_names),
                bounds=tuple(self.bounds),
                dtype=self.layout.dtype if self.layout is not None else "<f8",
                batch_size=self.batch_size,
                shuffle=self.shuffle,
                seed=self.seed,
                sync=self.mode == "sync",
                staleness_steps=self.staleness_steps,
                eval=evaluation,
                shard_endpoints=addresses,
            )
            worker = Worker(grad_fn=self.grad_fn, plan=plan, optimizer=self.optimizer)
            parts_uri = (
                self.checkpoint.path.rstrip("/") + "/ps" if self.checkpoint is not None else None
            )
            coordinator = Epochs(
                self.epochs,
                self.tol,
                self.optimizer,
                shard_names=shard_names,
                parts_uri=parts_uri,
                keep_parts=(self.checkpoint.keep_last + 1) if self.checkpoint is not None else 0,
                metrics=self.metrics,
                patience=self.patience,
                serving=serving,
            )
            body = IterationBody(
                partition=worker,
                coordinator=coordinator,
                # else self.epochs (max_epochs) ends it
                criteria=True if self.tol is not None or self.patience is not None else None,
            )
            scalar = [
                c
                for c in self.names
                if c not in self.widths and column_kind(column_type(self.df, c)) == "scalar"
            ]
            # over cached data: planned on the cache relation (``cached_view``)
            _, data = read_columns(self.df, [*self.names, *self.csr])
            streams = [DataStream(data, numeric_columns=tuple(scalar) or None)]
            if evaluation is not None:
                streams.append(DataStream(self.eval_df.select(*evaluation.columns)))
            try:
                result = iterate_bounded_streams_until_termination(
                    {"epoch": 0}, ReplayableDataStreamList.not_replay(*streams), self.config, body
                )
            except BaseException:
                raise_if_not_started(started)  # a shard that could not start says why
                raise
            values = get([s.values.remote() for s in shards])
            info = get([s.info.remote(HOT_TOP) for s in shards])
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
            kind = shard_kind(
                self.mode == "sync", self.staleness_steps, self.served is not None, self.parallelism
            )
            if model is None or not model.tables:  # a dense model is all on the driver now
                if ended_well and not self.config.restarts:
                    # the next run of this kind takes them, up and emptied
                    retire_shards(kind, shards, shard_names)
                else:
                    stop_shards(shards)
            if not self.config.restarts:
                # the next run of this kind takes processes started now, in the background
                keep_shard_spares(kind, len(self.bounds) - 1)
        return TrainResult(model.params, result, info, model)


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
    dense_init, tables = split_init(init)
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
    key_cols, csr = check_keys(df, tables, keys, sparse_columns, dense_names)
    names, widths = feature_columns(df, columns, csr)
    metrics, patience = check_eval(
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
    plan_tables = TablePlan.of(
        [(s.name, s.dim, key_cols[s.name]) for s in specs],
        counted=[tables[s.name].min_count > 1 for s in specs],
    )

    from spark_ops import available_task_slots

    from .._cluster.ray_util import connect

    n = parallelism or available_task_slots(df.sparkSession)
    if n < 1:
        raise IterationConfigError("Spark has no task slots; start executors or a Session")
    runs_coming(df.sparkSession)  # the shards start before the iteration's own entry says so
    address = cluster.ray_address(df.sparkSession)
    connect(address, namespace=NAMESPACE)
    if num_shards is None and tables:
        import ray

        cpus = float(ray.cluster_resources().get("CPU", 0.0))
        # the dense part's rule still holds when it asks for more
        bounds = shard_bounds(size, max(table_shards(n, cpus), len(shard_bounds(size, None)) - 1))
    else:
        bounds = shard_bounds(size, num_shards)
    # each shard's share of the tables' row caps
    specs = tuple(
        dataclasses.replace(s, bounds=tables[s.name].bounds_on(len(bounds) - 1)) for s in specs
    )
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

    launch = TrainLaunch(
        df=df,
        eval_df=eval_df,
        grad_fn=grad_fn,
        predict_fn=predict_fn,
        flat=flat,
        bounds=bounds,
        layout=layout,
        specs=specs,
        key_cols=key_cols,
        plan_tables=plan_tables,
        names=names,
        widths=widths,
        csr=csr,
        optimizer=optimizer,
        mode=mode,
        staleness_steps=staleness_steps,
        epochs=epochs,
        tol=tol,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        metrics=metrics,
        patience=patience,
        label_col=label_col,
        checkpoint=checkpoint,
        config=config,
        served=served,
        key=key,
        parallelism=n,
        address=address,
    )
    if checkpoint is not None:
        return launch()  # the iteration relaunches from its checkpoints itself
    return relaunch_if_worker_died("ps.train", launch)
