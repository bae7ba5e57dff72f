"""User extension points: the two tiers of an iteration body.

Both are base classes with no-op hooks; override what you need. Each docstring says
which process runs it. Operator objects are pickled on the driver (cloudpickle) and each
subtask gets its own copy, so keep their constructor state small (hyper-parameters),
and build caches in ``process_data``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from coordinator._operator_api import default_hook

if TYPE_CHECKING:
    from coordinator import (
        CoordinatorCollector,
        CoordinatorContext,
        PartitionCollector,
        PartitionContext,
    )

__all__ = ["CoordinatorOperator", "IterationListener", "PartitionOperator"]


class IterationListener:
    """Hooks of the epoch watermark and of termination (FLIP-176 ``IterationListener``)."""

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        """Every record of epochs <= ``epoch`` has been processed. Called for 0, 1, 2, ..."""

    def on_iteration_terminated(self, ctx: Any, out: Any) -> None:
        """The iteration ended; called exactly once per operator instance."""


class PartitionOperator(IterationListener):
    """The data-parallel tier: one instance per subtask. Runs in a Spark task.

    Order of calls in a subtask: ``open``; ``process_variables`` with the initial
    variables; ``process_data`` for every batch of every data stream of the subtask;
    then for each epoch ``e``: ``on_epoch_watermark_incremented(e)`` (sync mode: after the
    global alignment of ``e``), and ``process_variables`` whenever the coordinator
    published a newer version; finally ``on_iteration_terminated`` and ``close``.

    ``out.feedback(value)`` sends a value to the coordinator tier (e.g. a gradient);
    ``out.output(tag, value)`` and ``out.criteria()`` emit outputs and criteria records.
    """

    def open(self, ctx: PartitionContext) -> None:
        """Called once before any record (``ctx.partition_id``, ``ctx.num_partitions``)."""

    def process_data(
        self, stream: int, batch: pa.RecordBatch, ctx: PartitionContext, out: PartitionCollector
    ) -> None:
        """One Arrow batch of data stream ``stream`` (epoch 0). Cache what you need."""

    def process_variables(
        self, variables: Mapping[str, Any], ctx: PartitionContext, out: PartitionCollector
    ) -> None:
        """A new version of the variables (read-only numpy arrays; copy to modify)."""

    def close(self) -> None:
        """Called last, also when the iteration failed. Release resources here.

        A per-round operator (``PER_ROUND`` lifecycle or ``for_each_round``) is closed
        right after the watermark callback of its round: its end of input."""

    @default_hook
    def snapshot_state(self) -> Any:
        """Optional: the operator's state as a picklable value. Used to carry an
        all-round operator from one round job to the next (replayed streams) and for
        checkpoints; without it the whole operator object is pickled. It must not change
        the operator: in sync mode it is called before the call of every checkpoint
        epoch, also when termination criteria end the iteration there and no checkpoint
        is written."""
        return None

    @default_hook
    def restore_state(self, state: Any) -> None:
        """Optional: restore what ``snapshot_state`` returned (after ``open``)."""


class CoordinatorOperator(IterationListener):
    """The parallelism-1 tier (the parameter server). Runs in the Ray coordinator actor.

    ``open`` receives the initial variables. In sync mode ``process_feedback`` is called
    for every feedback record of an epoch (in partition order) and then
    ``on_epoch_watermark_incremented`` for that epoch, where a typical operator applies
    the accumulated update and calls ``out.publish_variables(...)``. In async and bounded-
    staleness modes ``process_feedback`` is called as each record arrives, and may publish
    at once (``ctx.is_sync`` tells the modes apart).
    """

    def open(self, init_variables: Mapping[str, Any], ctx: CoordinatorContext) -> None:
        """Called once in the actor before any feedback."""

    def process_feedback(
        self, value: Any, ctx: CoordinatorContext, out: CoordinatorCollector
    ) -> None:
        """One ``out.feedback(value)`` of a partition (``ctx.source_partition``, ``ctx.epoch``)."""

    def close(self) -> None:
        """Called after ``on_iteration_terminated``; a per-round coordinator operator is
        closed after the watermark callback of its round."""

    @default_hook
    def snapshot_state(self) -> Any:
        """Optional: the operator's state for a checkpoint; without it the operator
        object itself is pickled into the checkpoint."""
        return None

    @default_hook
    def restore_state(self, state: Any) -> None:
        """Optional: restore what ``snapshot_state`` returned (after ``open``)."""
