"""``ps.train``: data-parallel training of any model whose gradient a Python function
computes on a numpy batch, against a sharded parameter server.

Where things run:

* driver: ``train`` checks every argument, flattens ``init``, starts the shard actors
  (``coordinator._ps.ParameterShard`` / ``FreeShard`` made Ray actors here, ``num_cpus=0``, each owning
  a contiguous key range of the flat parameter vector and its optimizer state), runs one
  iteration, gathers the shards' values and stops them.
* Spark tasks (``_Worker``, one per subtask): read their partition once into numpy
  columns; each epoch is one pass over them in mini-batches of ``batch_size`` rows; each
  step pulls the parameters from every shard (zero-copy from the object store when
  large), calls ``grad_fn``, and pushes the gradient slices (dense, or ``Sparse``
  entries routed to the shards that own them) straight to the shards; the push's reply
  carries the next step's parameters. Only ``(loss, rows)`` per epoch goes to the
  iteration's coordinator.
* Ray coordinator actor (``_Epochs``): epoch accounting, the loss per epoch, termination
  (``epochs``, or ``tol``) and, in SSP mode, the staleness bound between subtasks.

Modes: ``"sync"``: every step is one global update (the subtasks' mean gradients
weighted by their rows, summed in subtask order: deterministic, equal to a single
process loop over the same batches); ``"async"``: each push is applied on arrival,
pulls take the newest parameters, no subtask waits for another; ``"ssp"``: async
steps, but no subtask more than ``staleness`` epochs ahead of the slowest.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator._finite import first_nonfinite
from coordinator._ps import NonFiniteGradient, ShardSpec, shard_class
from coordinator._variables import fetch_all

from .._body import IterationBody
from .._config import IterationConfig
from .._errors import (
    ConfigTypeError,
    HybridIterError,
    IterationConfigError,
    IterationFailedError,
    WorkerDiedError,
)
from .._operators import CoordinatorOperator, PartitionOperator
from .._result import IterationResult
from .._runtime.iterate import iterate_bounded_streams_until_termination
from .._runtime.placement import actor_class, kill, launch
from .._runtime.ray_util import NAMESPACE
from .._streams import DataStream, ReplayableDataStreamList
from ..ml._base import (
    check_dataframe,
    check_int,
    check_mode,
    check_progress,
    relaunch_if_worker_died,
)
from ..ml._features import VECTOR, ColumnCache, column_kind, resolve_features
from ..ml._sgd import DIVERGENCE_PATIENCE, LossWatch
from ._layout import Layout
from ._optim import SGD, Optimizer

__all__ = ["TrainFailedError", "TrainResult", "launch_shards", "stop_shards", "train"]

#: ``num_shards=None`` gives each shard about this many parameters (at most ``_MAX_AUTO``).
PARAMS_PER_SHARD = 2_500_000
_MAX_AUTO_SHARDS = 4


@dataclass(frozen=True)
class TrainResult:
    """What ``ps.train`` returns.

    ``params``: the trained parameters in ``init``'s structure; ``result``: the
    iteration's ``IterationResult`` (``loss`` per epoch, timings, ``plot()``);
    ``shards``: each shard's key range and counters (pushes, updates, pulls, puts).
    """

    params: Any
    result: IterationResult
    shards: list[dict[str, Any]] = field(default_factory=list)

    @property
    def loss(self) -> list[float]:
        """The mean loss of each epoch (over every row the epoch trained on)."""
        return [float(v) for v in self.result.outputs.get("loss", [])]

    def plot(self, path: str | None = None, *, compare: Any = None) -> Any:
        """``IterationResult.plot`` of the training run."""
        if isinstance(compare, TrainResult):
            compare = compare.result
        return self.result.plot(path, compare=compare)


class TrainFailedError(IterationFailedError):
    """``ps.train`` failed (a ``IterationFailedError``: ``failures`` as there).

    ``params``: the parameters the shards held when the training stopped, in ``init``'s
    structure: every update applied before the failure and nothing of the step that
    failed (a step is checked whole on its worker before any shard receives a slice of
    it); None when a shard could not be read (it was lost)."""

    def __init__(
        self, message: str, failures: Mapping[int | str, BaseException], params: Any
    ) -> None:
        super().__init__(message, failures)
        self.params = params

    def __reduce__(self) -> tuple[type[TrainFailedError], tuple[Any, ...]]:
        return (TrainFailedError, (self.message, self.failures, self.params))


# -- Spark task side --------------------------------------------------------------------


class _Shards:
    """The task's handles to every shard: pull the whole vector, push a gradient."""

    def __init__(
        self, names: Sequence[str], bounds: Sequence[int], dtype: str, *, sync: bool = True
    ) -> None:
        """``sync``: the shards are sync-mode ones, whose pulls wait for ``(epoch, step)``;
        async shards take no arguments (each argument of a Ray call costs ~50 us)."""
        import ray

        # Any, like start_shards' handles: ray types get_actor's handle as of no class
        self.handles: list[Any] = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
        self.bounds = list(bounds)
        self.dtype = np.dtype(dtype)
        self.buffer: np.ndarray | None = None
        self.sync = sync

    def _assemble(self, replies: list[Any]) -> np.ndarray:
        import ray

        # one round trip for every shard's object-store reference
        parts = fetch_all([(inline, ref) for _v, inline, ref in replies], ray.get)
        if len(parts) == 1:
            flat = parts[0]
        else:
            if self.buffer is None:
                self.buffer = np.empty(self.bounds[-1], dtype=self.dtype)
            np.concatenate(parts, out=self.buffer)
            flat = self.buffer.view()
        flat.flags.writeable = False
        return flat

    def pull(self, epoch: int, step: int) -> np.ndarray:
        import ray

        if self.sync:
            return self._assemble(ray.get([h.pull.remote(epoch, step) for h in self.handles]))
        return self._assemble(ray.get([h.pull.remote() for h in self.handles]))

    def push(
        self,
        pid: int,
        epoch: int,
        step: int,
        grad: Any,
        rows: float,
        last: bool,
    ) -> np.ndarray | None:
        """Send ``grad`` (flat dense, ``(indices, values)``, or None) to the shards; the
        parameters of the next step unless this was the epoch's ``last``."""
        import ray

        calls = []
        lo_hi = list(zip(self.bounds[:-1], self.bounds[1:]))
        if isinstance(grad, tuple):
            idx, vals = grad
            cuts = np.searchsorted(idx, self.bounds)
        for i, (h, (lo, hi)) in enumerate(zip(self.handles, lo_hi)):
            if grad is None:
                part: Any = None
            elif isinstance(grad, tuple):
                a, b = cuts[i], cuts[i + 1]
                part = (idx[a:b] - lo, vals[a:b])
            else:
                part = grad[lo:hi]
            calls.append(h.push_packed.remote((pid, epoch, step, part, rows, last, not last)))
        try:
            replies = ray.get(calls)
        except ray.exceptions.RayTaskError as ex:
            if isinstance(ex.cause, HybridIterError):  # a shard refused the push: say why
                raise ex.cause from None
            raise
        return None if last else self._assemble(replies)


class _Worker(PartitionOperator):
    """Runs in a Spark task: caches its columns, runs each epoch's steps against the
    shards, feeds back ``(loss sum, rows, steps, epoch start)``."""

    def __init__(
        self,
        *,
        grad_fn: Callable[[Any, dict[str, np.ndarray]], Any],
        layout: Layout,
        columns: Sequence[str],
        vector_widths: Mapping[str, int],
        shard_names: Sequence[str],
        bounds: Sequence[int],
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        optimizer: Optimizer,
        sync_shards: bool = True,
    ) -> None:
        self.grad_fn = grad_fn
        self.optimizer = optimizer
        self.layout = layout
        self.columns = list(columns)
        self.vector_widths = dict(vector_widths)
        self.shard_names = list(shard_names)
        self.bounds = list(bounds)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.sync_shards = sync_shards

    def open(self, ctx: Any) -> None:
        self.cache = ColumnCache(self.columns, self.vector_widths)
        self.shards: _Shards | None = None

    def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
        self.cache.add(batch)

    def _call(self, w: np.ndarray, batch: dict[str, np.ndarray]) -> tuple[float, Any]:
        got = self.grad_fn(self.layout.unflatten(w), batch)
        if not isinstance(got, tuple) or len(got) != 2:
            raise ConfigTypeError(
                f"grad_fn must return (loss, gradient), got {type(got).__name__}; e.g. "
                f"`return float(loss), grad`"
            )
        loss, grad = got
        try:
            loss = float(loss)
        except (TypeError, ValueError):
            raise ConfigTypeError(
                f"grad_fn must return the batch's mean loss as a number first, got "
                f"{type(loss).__name__}"
            ) from None
        return loss, self.layout.flatten_grad(grad)

    def _check_step(
        self, loss: float, grad: Any, w: np.ndarray, pid: int, epoch: int, step: int
    ) -> None:
        """Refuse a step whose gradient or loss is not finite before any of it is sent:
        every shard then holds exactly the updates before this step, none of it (a
        shard's own check would let the shards before it apply their slices)."""
        bad = self.layout.nonfinite_grad(grad)
        if bad is None and math.isfinite(loss):
            return
        what = f"a gradient with {bad}" if bad else f"a loss of {loss} (its gradient is finite)"
        i = first_nonfinite(w)
        cause = (
            f"the parameters it was computed from already hold "
            f"{self.layout.locate(i, 'init')} = {w[i]}: an update overflowed; lower the "
            f"learning rate of {self.optimizer}"
            if i is not None
            else f"if the parameters grew too large, lower the learning rate of "
            f"{self.optimizer}; otherwise look in grad_fn for a division by zero, a log of "
            f"0 or an overflow (np.seterr(all='raise') in it stops at the first)"
        )
        raise NonFiniteGradient(
            f"grad_fn returned {what} in partition {pid} at epoch {epoch}, step {step}; "
            f"nothing of this step was sent to the parameter server (it holds every "
            f"earlier update). {cause[0].upper()}{cause[1:]}"
        )

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        started = time.time()
        if self.shards is None:
            self.shards = _Shards(
                self.shard_names, self.bounds, self.layout.dtype, sync=self.sync_shards
            )
        arrays = self.cache.arrays()
        n = self.cache.num_rows
        pid = ctx.partition_id
        b = n if self.batch_size is None else self.batch_size
        steps = math.ceil(n / b) if n else 0
        if steps == 0:
            self.shards.push(pid, epoch, 0, None, 0.0, True)
            out.feedback((0.0, 0, 0, started))
            return
        order = (
            np.random.default_rng([self.seed, pid, epoch]).permutation(n) if self.shuffle else None
        )
        w = self.shards.pull(epoch, 0)
        loss_sum = 0.0
        for s in range(steps):
            lo, hi = s * b, min(n, (s + 1) * b)
            if order is not None:
                rows = order[lo:hi]
                batch = {k: v[rows] for k, v in arrays.items()}
            elif lo == 0 and hi == n:
                batch = arrays
            else:
                batch = {k: v[lo:hi] for k, v in arrays.items()}
            loss, grad = self._call(w, batch)
            self._check_step(loss, grad, w, pid, epoch, s)
            loss_sum += loss * (hi - lo)
            last = s == steps - 1
            nxt = self.shards.push(pid, epoch, s, grad, float(hi - lo), last)
            if nxt is not None:
                w = nxt
        out.feedback((loss_sum, n, steps, started))


# -- Ray coordinator actor --------------------------------------------------------------


class _Epochs(CoordinatorOperator):
    """Runs in the Ray coordinator actor: the loss of each epoch, termination, and the
    stop of a run whose loss rises.

    Rising loss: ``ml``'s rule (``LossWatch``) on the epoch losses, in every mode: an
    epoch is worse when its loss is above twice the best epoch loss so far *and* above
    the first epoch's loss; ``DIVERGENCE_PATIENCE`` (5) worse epochs in a row stop the
    run naming the optimizer and its learning rate. Each loss is the mean over every row
    of the epoch, so mini-batch noise is averaged out, and async/SSP staleness or a
    momentum/Adam oscillation that still converges comes back under twice its best, or
    stays under where it started, within 5 epochs (a full-batch SGD(0.1, momentum=0.9)
    run swings up to 50x above its best for 10 epochs in a row while converging: why the
    second condition). A run whose loss climbs past where it started and stays there is
    stopped; one that blows up within its first epoch and then falls is not (its first
    epoch is the reference), its ``loss`` shows it.
    """

    def __init__(self, epochs: int, tol: float | None, optimizer: Optimizer) -> None:
        self.epochs = epochs
        self.tol = tol
        self.optimizer = optimizer

    def open(self, init_variables: Any, ctx: Any) -> None:
        self.sums: dict[int, list[float]] = {}
        self.t0 = math.inf
        self.watch = LossWatch(above_first=True)

    def _fix(self) -> str:
        opt = self.optimizer
        lr = float(getattr(opt, "learning_rate", math.nan))
        return (
            f"the optimizer {type(opt).__name__}(learning_rate={lr:g}) overshoots: lower its "
            f"learning rate (e.g. learning_rate={lr / 10:g}), or scale the features"
        )

    def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
        loss_sum, rows, _steps, started = value
        self.t0 = min(self.t0, float(started))
        acc = self.sums.setdefault(ctx.epoch, [0.0, 0.0])
        acc[0] += loss_sum
        acc[1] += rows

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        loss_sum, rows = self.sums.pop(epoch, (0.0, 0.0))
        loss = loss_sum / rows if rows else math.nan
        if rows:
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"the loss diverged ({loss}) at epoch {epoch}; {self._fix()}"
                )
            if self.watch.rising(loss, patience=DIVERGENCE_PATIENCE, margin=2.0):
                w = self.watch
                raise FloatingPointError(
                    f"the loss is rising: {loss:.6g} at epoch {epoch}, above twice its best "
                    f"({w.best:.6g}) and above the first epoch's ({w.first:.6g}) for "
                    f"{w.worse} epochs in a row; {self._fix()}"
                )
            out.output("loss", loss)
            out.output("loss_trace", (time.time() - self.t0, loss))
        # The model lives in the shards; publishing the epoch is what feeds the next
        # epoch (partition feedback alone keeps no iteration alive, docs/semantics.md).
        out.publish_variables(epoch=epoch + 1)
        if self.tol is not None and epoch + 1 < self.epochs and not loss <= self.tol:
            out.criteria()


# -- driver -----------------------------------------------------------------------------


def _columns(df: Any, columns: Any) -> tuple[list[str], dict[str, int]]:
    fields = {f.name: f for f in df.schema.fields}
    if columns is None:
        names = [n for n, f in fields.items() if column_kind(f.dataType) is not None]
        if not names:
            raise IterationConfigError(
                "ps.train: the DataFrame has no numeric, array or vector column to train on"
            )
    elif isinstance(columns, str) or not isinstance(columns, Sequence) or not columns:
        raise IterationConfigError(
            f"ps.train(columns=...) must be a non-empty list of column names (or None for "
            f"every numeric, array and vector column), got {columns!r}"
        )
    else:
        names = list(columns)
        for n in names:
            if n not in fields:
                raise IterationConfigError(
                    f"ps.train(columns=...): column {n!r} is not in the DataFrame; its "
                    f"columns are {list(fields)}"
                )
            if column_kind(fields[n].dataType) is None:
                raise IterationConfigError(
                    f"ps.train(columns=...): column {n!r} has type "
                    f"{fields[n].dataType.simpleString()}, which is not numeric, an array "
                    f"of numbers or a vector; cast it or leave it out"
                )
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


def train(
    df: Any,
    grad_fn: Callable[[Any, dict[str, np.ndarray]], Any],
    init: Any,
    *,
    optimizer: Optimizer | None = None,
    mode: str = "sync",
    staleness: int | None = None,
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
) -> TrainResult:
    """Train ``init`` by ``grad_fn`` over ``df`` on a sharded parameter server.

    * ``grad_fn(params, batch) -> (loss, grad)``: runs in the Spark tasks; ``params`` has
      ``init``'s structure (read-only arrays), ``batch`` maps each of ``columns`` to a
      numpy array of the batch's rows (vector and array columns 2-D); return the batch's
      mean loss and gradient, the gradient in ``params``' structure, any part of it may be
      a ``ps.Sparse`` (only the touched entries travel).
    * ``init``: a numeric array (any shape) or a dict of them (the initial parameters).
    * ``optimizer``: ``ps.SGD(...)`` (default ``SGD(0.01)``) or ``ps.Adam(...)``, applied by
      the shards.
    * ``mode``: ``"sync"``, ``"async"`` or ``"ssp"`` (with ``staleness`` epochs).
    * ``epochs``: passes over the data; ``batch_size``: rows per step of each subtask
      (``None``: the whole partition, one step per epoch); ``shuffle``: a seeded new
      order every epoch; ``tol``: also stop once an epoch's loss is <= ``tol``.
    * ``num_shards``: shard actors (``None``: one per 2.5 million parameters, at most 4).

    Checked before any job: every argument, and ``init`` finite (a NaN/inf names the
    parameter and index). Checked on each worker before a step is sent: the gradient has
    exactly its parameter's shape (no reshaping) and is finite, the loss is finite
    (``NonFiniteGradient`` names the parameter, index, partition, epoch and step; no shard
    receives any part of that step). A loss that rises for 5 epochs in a row (see
    ``_Epochs``) stops the run naming the optimizer's learning rate. A failed training
    raises ``TrainFailedError`` whose ``params`` are what the shards held when it stopped.
    """
    check_dataframe("ps.train", df, call="ps.train(df, ...)")
    if not callable(grad_fn):
        raise IterationConfigError(
            f"ps.train(grad_fn=...) must be a function (params, batch) -> (loss, grad), got "
            f"{type(grad_fn).__name__}"
        )
    layout, flat = Layout.of(init)
    if optimizer is None:
        optimizer = SGD()
    if not isinstance(optimizer, Optimizer):
        raise IterationConfigError(
            f"ps.train(optimizer=...) must be hybrid_iter.ps.SGD(...) or ps.Adam(...), got "
            f"{type(optimizer).__name__}"
        )
    iteration_staleness = check_mode("ps.train", mode, staleness)
    check_int("ps.train", "epochs", epochs, minimum=1)
    check_int("ps.train", "batch_size", batch_size, minimum=1, optional=True)
    check_int("ps.train", "num_shards", num_shards, minimum=1, optional=True)
    if num_shards is not None and num_shards > layout.size:
        raise IterationConfigError(
            f"ps.train(num_shards={num_shards}) exceeds the {layout.size} parameters; use at "
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
    names, widths = _columns(df, columns)
    bounds = _shard_bounds(layout.size, num_shards)

    from spark_ops import available_task_slots

    from .._runtime.iterate import _ray_address
    from .._runtime.ray_util import connect

    n = parallelism or available_task_slots(df.sparkSession)
    if n < 1:
        raise IterationConfigError("Spark has no task slots; start executors or a Session")
    connect(_ray_address(df.sparkSession), namespace=NAMESPACE)
    import ray

    def run_once() -> tuple[IterationResult, list[Any], list[Any]]:
        # new shards from ``init`` each launch: a relaunch never sees a failed one's updates
        shards: list[Any] = []
        try:
            shard_names, shards = launch_shards(
                flat, bounds, optimizer, num_workers=n, sync=mode == "sync"
            )
            worker = _Worker(
                grad_fn=grad_fn,
                layout=layout,
                columns=names,
                vector_widths=widths,
                shard_names=shard_names,
                bounds=bounds,
                batch_size=batch_size,
                shuffle=shuffle,
                seed=seed,
                optimizer=optimizer,
                sync_shards=mode == "sync",
            )
            body = IterationBody(
                partition=worker,
                coordinator=_Epochs(epochs, tol, optimizer),
                criteria=True if tol is not None else None,  # else epochs (max_epochs) ends it
            )
            scalar = [c for c in names if c not in widths and column_kind(_type(df, c)) == "scalar"]
            stream = DataStream(df.select(*names), numeric_columns=tuple(scalar) or None)
            config = IterationConfig(
                staleness=iteration_staleness,
                max_epochs=epochs,
                parallelism=n,
                progress=progress,
                name=name or f"ps[{mode}]",
            )
            result = iterate_bounded_streams_until_termination(
                {"epoch": 0}, ReplayableDataStreamList.not_replay(stream), config, body
            )
            values = ray.get([s.values.remote() for s in shards])
            info = ray.get([s.info.remote() for s in shards])
            return result, values, info
        except WorkerDiedError:
            raise  # relaunched from ``init`` below: nothing of this launch is kept
        except IterationFailedError as ex:
            # what the shards applied before the failure is kept, not lost with them
            failed = TrainFailedError(ex.message, ex.failures, _salvage(layout, shards))
            raise failed.with_traceback(ex.__traceback__) from ex.__cause__
        finally:
            stop_shards(shards)

    result, values, info = relaunch_if_worker_died("ps.train", run_once)
    return TrainResult(_params(layout, values), result, info)


def _params(layout: Layout, values: Sequence[np.ndarray]) -> Any:
    """The shards' values as fresh arrays in ``init``'s structure."""
    final = np.concatenate(values) if len(values) > 1 else np.array(values[0])
    params = layout.unflatten(final)
    if isinstance(params, dict):
        return {k: np.array(v) for k, v in params.items()}
    return np.array(params)


#: seconds to read the shards after a failure (a lost shard must not hang the error)
_SALVAGE_TIMEOUT = 60.0


def _salvage(layout: Layout, shards: Sequence[Any]) -> Any:
    """The parameters the shards hold now, or None when one cannot be read."""
    import ray

    try:
        return _params(
            layout, ray.get([s.values.remote() for s in shards], timeout=_SALVAGE_TIMEOUT)
        )
    except Exception:  # a shard lost with the failure: the error itself says what failed
        return None


def launch_shards(
    flat: np.ndarray,
    bounds: Sequence[int],
    optimizer: Optimizer,
    *,
    num_workers: int,
    sync: bool,
) -> tuple[list[str], list[Any]]:
    """Start one shard actor per key range ``[bounds[i], bounds[i + 1])`` (driver; Ray
    must be connected); returns their names and handles once every one is up."""
    import ray

    run_id = uuid.uuid4().hex[:12]
    # sync mode: an asyncio actor whose pulls wait for a step; async mode: a plain actor,
    # one call at a time with no event loop in between (nothing ever waits there)
    concurrency = max(1000, 4 * num_workers + 16) if sync else 1
    shard_cls = actor_class(shard_class(sync), max_concurrency=concurrency)
    names = [f"hybrid_iter.ps.{run_id}.shard{i}" for i in range(len(bounds) - 1)]
    handles: list[Any] = []
    try:
        for i, name in enumerate(names):
            lo, hi = bounds[i], bounds[i + 1]
            spec = ShardSpec(
                shard_id=i,
                lo=lo,
                hi=hi,
                init=flat[lo:hi],
                rule=optimizer.rule,
                rule_params=optimizer.rule_params(),
                num_workers=num_workers,
                sync=sync,
            )
            handles.append(launch(shard_cls, name, spec))
        ray.get([h.info.remote() for h in handles])  # started (a bad spec fails here)
    except BaseException:
        stop_shards(handles)
        raise
    return names, handles


def stop_shards(handles: Sequence[Any]) -> None:
    for i, h in enumerate(handles):
        kill(h, f"parameter shard {i}")  # never hides the training's own outcome


def _type(df: Any, name: str) -> Any:
    return next(f.dataType for f in df.schema.fields if f.name == name)
