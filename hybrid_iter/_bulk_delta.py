"""Bulk and delta iterations: the old DataSet ``iterate`` / ``iterateDelta`` patterns.

Built on the iteration core. The partial solution lives in the coordinator as
variables and is broadcast to every subtask each round; each subtask holds its share of
the constant input (e.g. a graph's edges), read once (``replay=False``, the fast path:
the step's ``prepare`` runs once per subtask) or replayed from Spark's cache every round
with per-round operators (``replay=True``, the DataSet semantics: ``prepare`` runs every
round).

* **Bulk**: every round each subtask computes a partial from the whole current solution
  (``BulkStep.partial``), the coordinator combines the partials in partition order
  (``combine``) and computes the next solution (``next_solution``), which replaces the
  old one. Stops at ``max_iter`` rounds or when ``converged``.
* **Delta**: the solution set is an array indexed by key (dense int keys 0..n-1) and the
  workset is the set of keys changed in the last round. Every round each subtask
  proposes candidate values for keys from the workset (``DeltaStep.candidates``); the
  coordinator folds them into the solution with ``DeltaStep.combine`` (a numpy ufunc such
  as ``np.minimum``); the keys whose value changed form the next workset. Stops when the
  workset is empty (``terminated_by == "criteria"``) or at ``max_iter``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ._body import IterationBody
from ._config import IterationConfig, OperatorLifecycle
from ._errors import IterationConfigError
from ._operators import CoordinatorOperator, PartitionOperator
from ._result import IterationResult
from ._runtime.iterate import iterate_bounded_streams_until_termination
from ._streams import DataStream, ReplayableDataStreamList

__all__ = ["BulkStep", "DeltaStep", "iterate_bulk", "iterate_delta"]


class BulkStep(ABC):
    """The step of a bulk iteration. ``prepare`` and ``partial`` run in Spark tasks;
    ``combine``, ``next_solution`` and ``converged`` in the Ray coordinator actor."""

    def prepare(self, batches: Sequence[pa.RecordBatch]) -> Any:
        """The subtask's share of the input in a compact form (default: the batches)."""
        return list(batches)

    @abstractmethod
    def partial(self, data: Any, solution: Mapping[str, np.ndarray], ctx: Any) -> Any:
        """This subtask's contribution to the next solution."""

    def combine(self, a: Any, b: Any) -> Any:
        """Two partials combined (default ``a + b``)."""
        return a + b

    @abstractmethod
    def next_solution(
        self, solution: Mapping[str, np.ndarray], combined: Any, round_: int
    ) -> Mapping[str, np.ndarray]:
        """The next partial solution: it replaces the whole current one."""

    def converged(
        self, old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], round_: int
    ) -> bool:
        """Stop after this round (default: never; ``max_iter`` decides)."""
        return False


class DeltaStep(ABC):
    """The step of a delta iteration. ``prepare`` and ``candidates`` run in Spark tasks;
    ``combine`` (a numpy ufunc) folds candidates into the solution in the actor."""

    #: how a candidate and the current value make the new value; it must be commutative
    #: and associative so the order of candidates does not matter (e.g. np.minimum)
    combine: np.ufunc = np.minimum

    def prepare(self, batches: Sequence[pa.RecordBatch]) -> Any:
        """The subtask's share of the input in a compact form (default: the batches)."""
        return list(batches)

    @abstractmethod
    def candidates(
        self, data: Any, solution: np.ndarray, workset: np.ndarray, ctx: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, values)`` proposed for the next solution, from the keys of the workset
        (``workset`` is a boolean mask over the keys)."""


# -- the operators ------------------------------------------------------------------------------


class _StepPartition(PartitionOperator):
    """Runs in a Spark task: holds the subtask's input, computes the step's partial."""

    def __init__(self, step: Any, delta: bool) -> None:
        self.step = step
        self.delta = delta

    def open(self, ctx: Any) -> None:
        self.batches: list[pa.RecordBatch] | None = []
        self.data: Any = None
        self.solution: Mapping[str, np.ndarray] = {}
        self.fresh = True

    def process_data(self, stream: int, batch: pa.RecordBatch, ctx: Any, out: Any) -> None:
        if self.batches is not None:
            self.batches.append(batch)

    def process_variables(self, variables: Mapping[str, Any], ctx: Any, out: Any) -> None:
        self.solution = variables
        self.fresh = True

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        if getattr(ctx, "terminating", False):
            return  # replay=True: the terminating round has no data and no step to run
        if self.batches is not None:
            self.data = self.step.prepare(self.batches)
            self.batches = None  # the step's compact form replaces the raw batches
        if not self.delta:
            out.feedback(self.step.partial(self.data, self.solution, ctx))
            return
        workset = self.solution["workset"]
        if not self.fresh or not workset.any():
            return  # nothing changed since the last round: nothing to propose
        self.fresh = False
        keys, values = self.step.candidates(self.data, self.solution["solution"], workset, ctx)
        keys = np.asarray(keys, dtype=np.int64)
        if len(keys):
            out.feedback((keys, np.asarray(values)))


class _BulkCoordinator(CoordinatorOperator):
    """Runs in the Ray actor: combines partials, replaces the solution, decides the end."""

    def __init__(self, step: BulkStep, max_iter: int) -> None:
        self.step = step
        self.max_iter = max_iter

    def open(self, init_variables: Mapping[str, Any], ctx: Any) -> None:
        self.solution = dict(init_variables)
        self.acc: Any = None

    def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
        self.acc = value if self.acc is None else self.step.combine(self.acc, value)

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        if self.acc is None:
            return  # no partial this round: nothing to replace
        new = dict(self.step.next_solution(self.solution, self.acc, epoch))
        self.acc = None
        done = bool(self.step.converged(self.solution, new, epoch))
        self.solution = new
        out.publish_variables(**new)
        out.output("converged", done)
        if not done and epoch + 1 < self.max_iter:
            out.criteria()


class _DeltaCoordinator(CoordinatorOperator):
    """Runs in the Ray actor: folds candidates into the solution set; changed keys form
    the next workset; an empty workset ends the iteration."""

    def __init__(self, combine: np.ufunc, max_iter: int) -> None:
        self.combine = combine
        self.max_iter = max_iter

    def open(self, init_variables: Mapping[str, Any], ctx: Any) -> None:
        self.solution = np.array(init_variables["solution"])
        self.workset_size = int(np.count_nonzero(init_variables["workset"]))
        self.new: np.ndarray | None = None

    def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
        keys, values = value
        if self.new is None:
            self.new = self.solution.copy()
        self.combine.at(self.new, keys, values)

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        changed = np.zeros(len(self.solution), dtype=bool)
        if self.new is not None:
            changed = self.new != self.solution
            self.solution, self.new = self.new, None
        size = int(changed.sum())
        out.output("workset_size", size)
        if size:
            out.publish_variables(solution=self.solution, workset=changed)
        if size and epoch + 1 < self.max_iter:
            out.criteria()


# -- entry points ------------------------------------------------------------------------------


def _stream(data: Any) -> Any:
    if isinstance(data, ReplayableDataStreamList):
        raise IterationConfigError(
            "pass the constant input as a DataFrame (or hi.DataStream); use replay=True to "
            "replay it every round"
        )
    return data if isinstance(data, DataStream) else DataStream(data)


def _check_max_iter(max_iter: Any) -> int:
    if not isinstance(max_iter, int) or isinstance(max_iter, bool) or max_iter < 1:
        raise IterationConfigError(f"max_iter must be an int >= 1, got {max_iter!r}")
    return max_iter


def _run(
    init: Mapping[str, Any],
    data: Any,
    partition: PartitionOperator,
    coordinator: CoordinatorOperator,
    *,
    replay: bool,
    config: IterationConfig | None,
) -> IterationResult:
    stream = _stream(data)
    base = config or IterationConfig()
    if base.staleness != 0:
        raise IterationConfigError("bulk and delta iterations are synchronous: use staleness=0")
    cfg = IterationConfig(
        staleness=0,
        max_epochs=base.max_epochs,
        parallelism=base.parallelism,
        operator_lifecycle=OperatorLifecycle.PER_ROUND if replay else OperatorLifecycle.ALL_ROUND,
        progress=base.progress,
        progress_tag=base.progress_tag,
        inline_variables_bytes=base.inline_variables_bytes,
        name=base.name,
    )
    streams = (
        ReplayableDataStreamList.replay(stream)
        if replay
        else ReplayableDataStreamList.not_replay(stream)
    )
    body = IterationBody(partition=partition, coordinator=coordinator, criteria=True)
    return iterate_bounded_streams_until_termination(init, streams, cfg, body)


def iterate_bulk(
    initial_solution: Mapping[str, Any],
    data: Any,
    step: BulkStep,
    *,
    max_iter: int,
    replay: bool = False,
    config: IterationConfig | None = None,
) -> IterationResult:
    """A bulk iteration: ``result.variables`` is the last partial solution.

    ``initial_solution``: named numpy arrays (the variables); ``data``: the constant input
    (a DataFrame), read once (``replay=False``) or replayed every round (``replay=True``).
    """
    if not isinstance(step, BulkStep):
        raise IterationConfigError(
            f"step must be a hybrid_iter.BulkStep, got {type(step).__name__}"
        )
    return _run(
        initial_solution,
        data,
        _StepPartition(step, delta=False),
        _BulkCoordinator(step, _check_max_iter(max_iter)),
        replay=replay,
        config=config,
    )


def iterate_delta(
    solution: Any,
    workset: Any,
    data: Any,
    step: DeltaStep,
    *,
    max_iter: int,
    replay: bool = False,
    config: IterationConfig | None = None,
) -> IterationResult:
    """A delta iteration: ``result.variables["solution"]`` is the final solution set.

    ``solution``: the initial value of every key (a 1-D array indexed by key 0..n-1);
    ``workset``: the keys to consider first (an array of keys, or a boolean mask).
    """
    if not isinstance(step, DeltaStep):
        raise IterationConfigError(
            f"step must be a hybrid_iter.DeltaStep, got {type(step).__name__}"
        )
    if not isinstance(step.combine, np.ufunc) or step.combine.nin != 2:
        raise IterationConfigError(
            f"{type(step).__name__}.combine must be a binary numpy ufunc such as np.minimum"
        )
    sol = np.asarray(solution)
    if sol.ndim != 1 or sol.dtype.kind not in "biuf":
        raise IterationConfigError(
            f"solution must be a 1-D numeric array indexed by key, got shape {sol.shape} "
            f"and dtype {sol.dtype}"
        )
    ws = np.asarray(workset)
    if ws.dtype == bool:
        if ws.shape != sol.shape:
            raise IterationConfigError(
                f"a boolean workset must have the solution's shape {sol.shape}, got {ws.shape}"
            )
        mask = ws
    else:
        keys = ws.astype(np.int64, copy=False).ravel()
        if len(keys) and (keys.min() < 0 or keys.max() >= len(sol)):
            raise IterationConfigError(
                f"workset keys must be in [0, {len(sol)}) (indexes of the solution)"
            )
        mask = np.zeros(len(sol), dtype=bool)
        mask[keys] = True
    return _run(
        {"solution": sol, "workset": mask},
        data,
        _StepPartition(step, delta=True),
        _DeltaCoordinator(step.combine, _check_max_iter(max_iter)),
        replay=replay,
        config=config,
    )
