"""The Spark task side of ``ps.train``: one ``_Worker`` per subtask.

Runs in Spark tasks. It reads its partition once (dense columns as numpy, id columns as
CSR: ``ml._features.read_csr``), then runs each epoch's steps against the shards: a step
pulls the dense parameters and the rows its batch references (fused with the previous
push), calls ``grad_fn``, checks the whole gradient (shapes, finiteness: nothing of a bad
step is sent), and pushes it. After its epoch it may score its part of the evaluation
data (``predict_fn``) against the model as the epoch left it; only ``(loss, rows, steps,
start, evaluation)`` per epoch goes to the iteration's coordinator.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator._errors import NonFiniteGradient
from coordinator._finite import count_nonfinite, first_nonfinite

from .._errors import ConfigTypeError, DataValidationError
from .._operators import PartitionOperator
from ..ml._features import ColumnCache
from ._client import Shards, StepKeys, TablePlan, step_keys
from ._csr import CSR, Rows
from ._layout import Layout

__all__ = ["EvalPlan", "TrainPlan", "Worker", "batch_params"]

#: rows per evaluation batch (bounded: a batch's ids and rows are held at once)
EVAL_BATCH = 8192


@dataclass(frozen=True)
class EvalPlan:
    """Scoring the evaluation stream after each epoch: ``predict_fn`` and the label."""

    predict_fn: Callable[[Any, dict[str, Any]], Any]
    label: str
    columns: tuple[str, ...]
    probabilities: bool


@dataclass(frozen=True)
class TrainPlan:
    """What every subtask needs, plain data (pickled into the stage)."""

    layout: Layout | None
    columns: tuple[str, ...]
    vector_widths: Mapping[str, int]
    csr_columns: tuple[str, ...]
    tables: TablePlan
    shard_names: tuple[str, ...]
    bounds: tuple[int, ...]
    dtype: str
    batch_size: int | None
    shuffle: bool
    seed: int
    sync: bool
    staleness_steps: int | None
    eval: EvalPlan | None
    #: over the endpoint: each shard's ``EndpointAddress`` (None: the shards through Ray)
    shard_endpoints: tuple[Any, ...] | None = None


def batch_params(
    layout: Layout | None, dense: np.ndarray, tables: TablePlan, keys: StepKeys | None, values: Any
) -> Any:
    """``grad_fn``'s ``params``: the dense parameters in ``init``'s structure (views of
    ``dense``) and one ``Rows`` per table."""
    params = layout.unflatten(dense) if layout is not None else {}
    if not tables.names:
        return params
    assert keys is not None
    out = dict(params)
    for t, name in enumerate(tables.names):
        out[name] = Rows(name, keys.uniq[tables.group_of[t]], values[t])
    return out


def with_locals(
    plan: TablePlan, sparse: Mapping[str, CSR], keys: StepKeys | None
) -> dict[str, Any]:
    """The batch's CSR columns, each knowing where its ids are in its tables' rows."""
    out: dict[str, Any] = {}
    for name, x in sparse.items():
        loc = {}
        if keys is not None:
            for t, tname in enumerate(plan.names):
                g = plan.group_of[t]
                if name in plan.groups[g]:
                    loc[tname] = (keys.positions[g][name], len(keys.uniq[g]))
        out[name] = x.with_locals(loc)
    return out


class Worker(PartitionOperator):
    """Runs in a Spark task: caches its columns, runs each epoch's steps against the
    shards, feeds back ``(loss sum, rows, steps, epoch start, evaluation)``."""

    def __init__(
        self,
        *,
        grad_fn: Callable[[Any, dict[str, Any]], Any],
        plan: TrainPlan,
        optimizer: Any,
    ) -> None:
        self.grad_fn = grad_fn
        self.plan = plan
        self.optimizer = optimizer

    def open(self, ctx: Any) -> None:
        p = self.plan
        self.cache = ColumnCache(list(p.columns), dict(p.vector_widths), p.csr_columns)
        self.eval_cache: ColumnCache | None = None
        if p.eval is not None:
            self.eval_cache = ColumnCache(
                list(p.eval.columns), dict(p.vector_widths), p.csr_columns
            )
        self.shards: Shards | None = None
        self._keys: dict[int, StepKeys] = {}  # per step, when the order never changes

    def snapshot_state(self) -> None:
        """Nothing: a worker's state is its data, which a restored task reads again."""
        return None

    def restore_state(self, state: Any) -> None:
        pass

    def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
        if stream == 0:
            self.cache.add(batch)
        elif self.eval_cache is not None:
            self.eval_cache.add(batch)

    # -- a step ---------------------------------------------------------------------------

    def _call(self, params: Any, batch: dict[str, Any]) -> tuple[float, Any]:
        got = self.grad_fn(params, batch)
        if not isinstance(got, tuple) or len(got) != 2:
            raise ConfigTypeError(
                f"grad_fn must return (loss, gradient), got {type(got).__name__}; e.g. "
                f"`return float(loss), grad`"
            )
        loss, grad = got
        try:
            loss = float(loss)
        except (TypeError, ValueError) as ex:
            raise ConfigTypeError(
                f"grad_fn must return the batch's mean loss as a number first, got "
                f"{type(loss).__name__}"
            ) from ex
        return loss, grad

    def _split(self, grad: Any, keys: StepKeys | None) -> tuple[Any, list[np.ndarray | None]]:
        """The flat dense gradient and, per table, its rows (checked: exact shape)."""
        plan = self.plan
        layout = plan.layout
        tables = plan.tables
        if not tables.names:
            assert layout is not None
            return layout.flatten_grad(grad), []
        if not isinstance(grad, Mapping):
            raise ConfigTypeError(
                f"grad_fn must return the gradient as a dict like init (keys "
                f"{[*(layout.names or ()), *tables.names] if layout else list(tables.names)}), "
                f"got {type(grad).__name__}"
            )
        dense_names = set(layout.names or ()) if layout is not None else set()
        unknown = set(grad) - dense_names - set(tables.names)
        if unknown:
            raise ConfigTypeError(
                f"grad_fn returned gradients of unknown parameters {sorted(unknown)}; init has "
                f"{sorted(dense_names) + list(tables.names)}"
            )
        dense_grad: Any = None
        if layout is not None:
            dense_grad = layout.flatten_grad({k: v for k, v in grad.items() if k in dense_names})
        assert keys is not None
        rows: list[np.ndarray | None] = []
        for t, name in enumerate(tables.names):
            g = grad.get(name)
            if g is None:
                rows.append(None)
                continue
            n = len(keys.uniq[tables.group_of[t]])
            arr = np.asarray(g)
            want = (n, tables.dims[t])
            if arr.shape != want or arr.dtype.kind not in "biuf":
                raise ConfigTypeError(
                    f"grad_fn returned grad[{name!r}] of shape {arr.shape} ({arr.dtype}); the "
                    f"table {name!r} has dim {tables.dims[t]} and this batch references "
                    f"{n} of its keys: return an array of shape {want} aligned with "
                    f"params[{name!r}].ids (e.g. x.t_dot(r) of a column keying it)"
                )
            rows.append(np.ascontiguousarray(arr, dtype=np.float64))
        return dense_grad, rows

    def _check_step(
        self,
        loss: float,
        grad: Any,
        rows: Sequence[np.ndarray | None],
        keys: StepKeys | None,
        w: np.ndarray,
        tvals: Sequence[np.ndarray],
        pid: int,
        epoch: int,
        step: int,
    ) -> None:
        """Refuse a step whose gradient or loss is not finite before any of it is sent:
        every shard then holds exactly the updates before this step, none of it (a
        shard's own check would let the shards before it apply their slices)."""
        layout, tables = self.plan.layout, self.plan.tables
        bad = layout.nonfinite_grad(grad) if layout is not None else None
        if bad is None:
            for t, g in enumerate(rows):
                if g is None:
                    continue
                i = first_nonfinite(g)
                if i is not None:
                    assert keys is not None
                    dim = tables.dims[t]
                    key = int(keys.uniq[tables.group_of[t]][i // dim])
                    count = count_nonfinite(g)
                    col = f", column {i % dim}" if dim > 1 else ""
                    bad = (
                        f"grad[{tables.names[t]!r}] for key {key}{col} (row {i // dim} of "
                        f"the batch's {len(g)}) is {g.reshape(-1)[i]}; {count} of its "
                        f"{g.size} values are NaN/inf"
                    )
                    break
        if bad is None and math.isfinite(loss):
            return
        what = f"a gradient with {bad}" if bad else f"a loss of {loss} (its gradient is finite)"
        cause = self._overflow(w, tvals, keys)
        if cause is None:
            cause = (
                f"if the parameters grew too large, lower the {self.optimizer.rate_name} of "
                f"{self.optimizer}; otherwise look in grad_fn for a division by zero, a log "
                f"of 0 or an overflow (np.seterr(all='raise') in it stops at the first)"
            )
        raise NonFiniteGradient(
            f"grad_fn returned {what} in partition {pid} at epoch {epoch}, step {step}; "
            f"nothing of this step was sent to the parameter server (it holds every "
            f"earlier update). {cause[0].upper()}{cause[1:]}"
        )

    def _overflow(
        self, w: np.ndarray, tvals: Sequence[np.ndarray], keys: StepKeys | None
    ) -> str | None:
        layout, tables = self.plan.layout, self.plan.tables
        fix = f"an update overflowed; lower the {self.optimizer.rate_name} of {self.optimizer}"
        i = first_nonfinite(w)
        if i is not None and layout is not None:
            return (
                f"the parameters it was computed from already hold "
                f"{layout.locate(i, 'init')} = {w[i]}: {fix}"
            )
        for t, v in enumerate(tvals):
            j = first_nonfinite(v)
            if j is not None and keys is not None:
                key = int(keys.uniq[tables.group_of[t]][j // tables.dims[t]])
                return (
                    f"the rows it was computed from already hold table {tables.names[t]!r}'s "
                    f"key {key} = {v.reshape(-1)[j]}: {fix}"
                )
        return None

    # -- an epoch -------------------------------------------------------------------------

    def _client(self) -> Shards:
        if self.shards is None:
            p = self.plan
            self.shards = Shards(
                p.shard_names,
                p.bounds,
                p.dtype,
                sync=p.sync,
                plan=p.tables if p.tables.names else None,
                endpoints=p.shard_endpoints,
            )
        return self.shards

    def _batch(
        self,
        s: int,
        n: int,
        b: int,
        order: np.ndarray | None,
        arrays: Mapping[str, np.ndarray],
        csr: Mapping[str, CSR],
    ) -> tuple[dict[str, Any], dict[str, CSR], int]:
        lo, hi = s * b, min(n, (s + 1) * b)
        if order is not None:
            rows = order[lo:hi]
            dense = {k: v[rows] for k, v in arrays.items()}
            sparse = {k: x.take(rows) for k, x in csr.items()}
        elif lo == 0 and hi == n:
            dense, sparse = dict(arrays), dict(csr)
        else:
            dense = {k: v[lo:hi] for k, v in arrays.items()}
            sparse = {k: x.slice(lo, hi) for k, x in csr.items()}
        return dense, sparse, hi - lo

    def _keys_of(self, s: int, sparse: Mapping[str, CSR], cache: bool) -> StepKeys | None:
        p = self.plan
        if not p.tables.names:
            return None
        got = self._keys.get(s) if cache else None
        if got is None:
            got = step_keys(
                p.tables, {c: sparse[c].ids for c in p.tables.key_columns}, len(p.shard_names)
            )
            if cache:
                self._keys[s] = got
        return got

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        started = time.time()
        p = self.plan
        shards = self._client()
        arrays = self.cache.arrays()
        csr = {k: CSR(k, *v) for k, v in self.cache.csr().items()}
        n = self.cache.num_rows
        pid = ctx.partition_id
        b = n if p.batch_size is None or p.batch_size >= n else p.batch_size
        steps = math.ceil(n / b) if n else 0
        tables = p.tables.names
        if steps == 0:
            shards.push(
                pid, epoch, 0, None, 0.0, True, span=0, table_grads=None if not tables else ()
            )
            out.feedback((0.0, 0, 0, started, self._evaluate(epoch)))
            return
        order = np.random.default_rng([p.seed, pid, epoch]).permutation(n) if p.shuffle else None
        cache_keys = order is None  # the same batches every epoch: their ids too
        dense, sparse, rows = self._batch(0, n, b, order, arrays, csr)
        keys = self._keys_of(0, sparse, cache_keys)
        if tables:
            w, tvals = shards.pull(epoch, 0, keys, pid)
        else:
            w, tvals = shards.pull(epoch, 0), []
        loss_sum = 0.0
        for s in range(steps):
            params = batch_params(p.layout, w, p.tables, keys, tvals)
            batch = {**dense, **with_locals(p.tables, sparse, keys)}
            loss, grad = self._call(params, batch)
            flat, trows = self._split(grad, keys)
            self._check_step(loss, flat, trows, keys, w, tvals, pid, epoch, s)
            loss_sum += loss * rows
            last = s == steps - 1
            step_rows = float(rows)
            if not last:
                dense, sparse, rows = self._batch(s + 1, n, b, order, arrays, csr)
                nkeys = self._keys_of(s + 1, sparse, cache_keys)
            else:
                nkeys = None
            if tables:
                nxt = shards.push(
                    pid,
                    epoch,
                    s,
                    flat,
                    step_rows,
                    last,
                    keys=keys,
                    table_grads=trows,
                    next_keys=nkeys,
                    span=steps,
                )
                if nxt is not None:
                    w, tvals = nxt
            else:
                nxt = shards.push(pid, epoch, s, flat, step_rows, last)
                if nxt is not None:
                    w = nxt
            keys = nkeys
        out.feedback((loss_sum, n, steps, started, self._evaluate(epoch)))

    def on_iteration_terminated(self, ctx: Any, out: Any) -> None:
        if self.shards is not None and self.plan.staleness_steps is not None:
            self.shards.retire(ctx.partition_id)  # no longer holds back the others

    # -- evaluation -----------------------------------------------------------------------

    def _evaluate(self, epoch: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Scores and labels of this subtask's evaluation rows under the model as epoch
        ``epoch`` left it (sync: every worker's last step of it applied)."""
        p = self.plan
        ev = p.eval
        if ev is None or self.eval_cache is None:
            return None
        shards = self._client()
        arrays = self.eval_cache.arrays()
        csr = {k: CSR(k, *v) for k, v in self.eval_cache.csr().items()}
        n = self.eval_cache.num_rows
        scores, labels = [], []
        at = epoch + 1 if p.sync else None  # sync: once every last step of it is applied
        for lo in range(0, n, EVAL_BATCH):
            hi = min(n, lo + EVAL_BATCH)
            dense = {k: v[lo:hi] for k, v in arrays.items()}
            sparse = {k: x.slice(lo, hi) for k, x in csr.items()}
            keys = self._keys_of(-1, sparse, False)
            if keys is not None:
                w, tvals = shards.lookup(keys, at, 0)
            else:
                w, tvals = shards.pull(epoch + 1 if p.sync else 0, 0), []
            params = batch_params(p.layout, w, p.tables, keys, tvals)
            batch = {**dense, **with_locals(p.tables, sparse, keys)}
            scores.append(check_scores(ev.predict_fn(params, batch), hi - lo, ev.probabilities))
            labels.append(check_labels(dense[ev.label], ev.label))
        if not scores:
            return np.zeros(0), np.zeros(0)
        return np.concatenate(scores), np.concatenate(labels)


def check_scores(got: Any, n: int, probabilities: bool) -> np.ndarray:
    """``predict_fn``'s result: one finite score per row (probabilities in [0, 1] when a
    log loss is computed from them)."""
    arr = np.asarray(got, dtype=np.float64) if not isinstance(got, np.ndarray) else got
    if arr.shape != (n,) or arr.dtype.kind not in "biuf":
        raise ConfigTypeError(
            f"predict_fn must return one number per row of the batch, shape ({n},), got "
            f"shape {arr.shape} ({arr.dtype})"
        )
    arr = arr.astype(np.float64, copy=False)
    i = first_nonfinite(arr)
    if i is not None:
        raise DataValidationError(f"predict_fn returned {arr[i]} for row {i} of a batch")
    if probabilities and len(arr) and (arr.min() < 0 or arr.max() > 1):
        bad = arr[(arr < 0) | (arr > 1)][0]
        raise ConfigTypeError(
            f"predict_fn returned {bad}, not a probability: the log loss needs P(label = 1) "
            f"in [0, 1] (apply the sigmoid), or evaluate with eval_metrics=('auc',) only"
        )
    return arr


def check_labels(y: np.ndarray, name: str) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    if len(y) and not np.isin(y, (0.0, 1.0)).all():
        bad = y[~np.isin(y, (0.0, 1.0))][0]
        raise DataValidationError(
            f"label column {name!r} holds {bad}; the evaluation metrics need labels 0 or 1"
        )
    return y
