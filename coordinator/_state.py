"""The epoch-watermark and termination state machine: pure logic, no Ray, no I/O.

Events in, decisions out. The Ray actor (``_actor.py``) is a thin shell that feeds it
the subtasks' calls and runs the user's coordinator operator where it says so.

Vocabulary (docs/semantics.md, as implemented here):

* A subtask's **call k** (k = 0, 1, 2, ...) says "my epoch-k input is consumed; may I run
  my ``on_epoch_watermark_incremented(k)``?". Call 0 follows the initial input (initial
  variables and every data batch); call k >= 1 follows the subtask's watermark callback
  of epoch k - 1. A call carries what the subtask emitted since its previous call; those
  are records of epoch ``max(k - 1, 0)``.
* **Global alignment k** happens when every subtask has made call k. Before deciding on
  alignment k >= 1 the coordinator tier runs its own ``on_epoch_watermark_incremented(k-1)``
  (it is downstream of the partition tier, as the parameters vertex is in Flink ML).
* **Termination** is decided at alignment k >= 1 from the records of epoch k - 1 (the
  records that circulate into epoch k): a criteria stream that emitted nothing, no
  ``publish_variables`` (the feedback edge, as the parameters vertex's edge back to the
  head is in Flink ML; a partition's ``out.feedback`` is a forward edge inside the epoch
  and keeps nothing alive), or ``k >= max_epochs``. Alignment 0 never terminates.
* The **terminating round** k of an iteration the criteria ended is the round the
  variables published in epoch k - 1 were fed into: it still runs its per-round
  operators before termination (Flink ML processes records fed back before it
  terminates). Without such a publish, or when ``max_epochs`` ended it, there is none.
* **Release** of a pending call k (the subtask may run epoch k): always after
  termination (it is told to stop); otherwise never for ``k >= max_epochs``; call 0
  at alignment 0 in every mode (all data loaded and checked); then in sync mode
  (staleness 0) once alignment k is done; with staleness s once alignment k - s is
  done; in async mode (staleness ``None``) at once.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Any

from ._errors import StateMachineError

__all__ = ["EpochCounts", "EpochStateMachine", "Release", "TerminationReason"]


class TerminationReason(str, enum.Enum):
    """Why an iteration ended (``IterationResult.terminated_by``).

    ``NO_VARIABLES_PUBLISHED`` (``"no_variables_published"``): nothing was fed back, i.e.
    the coordinator tier published no variables into the next epoch. A member compares
    equal to its value (``result.terminated_by == "criteria"``).
    """

    CRITERIA = "criteria"
    NO_VARIABLES_PUBLISHED = "no_variables_published"
    MAX_EPOCHS = "max_epochs"

    def __str__(self) -> str:
        return self.value


@dataclass
class EpochCounts:
    """Records of one epoch that can circulate into the next one."""

    feedback: int = 0
    published: int = 0
    criteria: int = 0


@dataclass(frozen=True)
class Release:
    """Decision: answer subtask ``pid``'s pending call ``epoch``."""

    pid: int
    epoch: int
    terminated: bool


class EpochStateMachine:
    """Tracks every subtask's progress, the global alignment and termination."""

    def __init__(
        self,
        num_subtasks: int,
        *,
        staleness: int | None,
        max_epochs: int | None,
        has_criteria: bool,
    ) -> None:
        if num_subtasks < 1:
            raise ValueError(f"num_subtasks must be >= 1, got {num_subtasks}")
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness must be None or >= 0, got {staleness}")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be None or >= 1, got {max_epochs}")
        self.num_subtasks = num_subtasks
        self.staleness = staleness
        self.max_epochs = max_epochs
        self.has_criteria = has_criteria
        self.last_call = [-1] * num_subtasks
        self.aligned = -1
        self.pending: dict[int, int] = {}
        # O(1) per call at any subtask count: how many subtasks sit at each call, the
        # lowest call (it only grows), and which pending calls may have become
        # releasable since the last ``releasable()`` (all of them after an alignment).
        self._at_call: dict[int, int] = {-1: num_subtasks}
        self._min_call = -1
        self._fresh: list[int] = []
        self._rescan = False
        self.counts: dict[int, EpochCounts] = {}
        self.terminated: TerminationReason | None = None
        self.finished: set[int] = set()
        self.failed = False

    # -- events -------------------------------------------------------------------------

    def report(self, pid: int, epoch: int, *, feedback: int = 0, criteria: int = 0) -> None:
        """Subtask ``pid`` made call ``epoch`` carrying these record counts."""
        self._check_pid(pid)
        if pid in self.finished:
            raise StateMachineError(f"subtask {pid} reported epoch {epoch} after finishing")
        if pid in self.pending:
            raise StateMachineError(
                f"subtask {pid} made call {epoch} while call {self.pending[pid]} is pending"
            )
        expected = self.last_call[pid] + 1
        if epoch != expected:
            raise StateMachineError(f"subtask {pid} made call {epoch}, expected call {expected}")
        self.last_call[pid] = epoch
        self._move_call(epoch - 1, epoch)
        c = self._counts(max(epoch - 1, 0))
        c.feedback += feedback
        c.criteria += criteria
        self.pending[pid] = epoch
        self._fresh.append(pid)

    def record_coordinator(self, epoch: int, *, published: int = 0, criteria: int = 0) -> None:
        """The coordinator tier emitted records of ``epoch``."""
        if epoch < 0:
            raise StateMachineError(f"coordinator records need an epoch >= 0, got {epoch}")
        c = self._counts(epoch)
        c.published += published
        c.criteria += criteria

    def next_alignment(self) -> int | None:
        """The alignment that is ready to be completed, if any."""
        if self.terminated is not None or self.failed:
            return None
        k = self.aligned + 1
        return k if self._min_call >= k else None

    def complete_alignment(self, k: int) -> TerminationReason | None:
        """Complete alignment ``k`` (after the coordinator ran its callback of ``k - 1``)."""
        if k != self.next_alignment():
            raise StateMachineError(f"alignment {k} is not ready (aligned={self.aligned})")
        self.aligned = k
        self._rescan = True  # every pending call's answer may have changed
        if k == 0:
            return None
        c = self.counts.get(k - 1, EpochCounts())
        reason: TerminationReason | None = None
        if self.has_criteria and c.criteria == 0:
            reason = TerminationReason.CRITERIA
        elif c.published == 0:
            # Only the coordinator tier's publish is fed back into epoch k; partition
            # feedback of epoch k - 1 was consumed inside that epoch (a forward edge).
            reason = TerminationReason.NO_VARIABLES_PUBLISHED
        elif self.max_epochs is not None and k >= self.max_epochs:
            reason = TerminationReason.MAX_EPOCHS
        self.terminated = reason
        # Counts of epochs that can no longer matter are dropped (bounded memory).
        for e in [e for e in self.counts if e < k - 1]:
            del self.counts[e]
        return reason

    def releasable(self) -> list[Release]:
        """Pending calls that may be answered now (removed from ``pending``), by subtask
        id. Only calls made since the last call are looked at, unless an alignment
        completed since (then all pending ones): a pending call's answer changes only
        then."""
        if self._rescan:
            candidates = sorted(self.pending.items())
        else:
            fresh = sorted(self._fresh) if len(self._fresh) > 1 else self._fresh
            candidates = [(p, self.pending[p]) for p in fresh if p in self.pending]
        self._fresh = []
        self._rescan = False
        out: list[Release] = []
        for pid, epoch in candidates:
            if self.terminated is not None:
                out.append(Release(pid, epoch, True))
            elif self._may_start(epoch):
                out.append(Release(pid, epoch, False))
        for r in out:
            del self.pending[r.pid]
        return out

    def finish(self, pid: int) -> bool:
        """Subtask ``pid`` ran ``on_iteration_terminated``; True once all have."""
        self._check_pid(pid)
        if self.terminated is None:
            raise StateMachineError(f"subtask {pid} finished before the iteration terminated")
        if pid in self.finished:
            raise StateMachineError(f"subtask {pid} finished twice")
        self.finished.add(pid)
        return self.all_finished

    def fail(self) -> None:
        self.failed = True

    # -- checkpoints --------------------------------------------------------------------

    def snapshot(self, calls: dict[int, int]) -> dict[str, Any]:
        """Plain data of a consistent cut: ``calls[pid]`` is the call each subtask is held
        in (it will make that call again after a restore)."""
        if self.terminated is not None or self.failed:
            raise StateMachineError("a terminated or failed iteration is not checkpointed")
        if sorted(calls) != list(range(self.num_subtasks)):
            raise StateMachineError(f"a checkpoint needs every subtask's call, got {sorted(calls)}")
        return {
            "calls": dict(calls),
            "aligned": self.aligned,
            "counts": {e: (c.feedback, c.published, c.criteria) for e, c in self.counts.items()},
        }

    @classmethod
    def restore(cls, snapshot: dict[str, Any], **config: Any) -> EpochStateMachine:
        """A state machine where every subtask is about to make its held call again."""
        sm = cls(len(snapshot["calls"]), **config)
        sm.aligned = snapshot["aligned"]
        sm.last_call = [snapshot["calls"][p] - 1 for p in range(sm.num_subtasks)]
        sm._at_call = dict(collections.Counter(sm.last_call))
        sm._min_call = min(sm.last_call)
        sm.counts = {e: EpochCounts(*c) for e, c in snapshot["counts"].items()}
        return sm

    # -- queries ------------------------------------------------------------------------

    @property
    def terminating_round(self) -> int | None:
        """After termination by the criteria at alignment k: k when variables were
        published into round k (its per-round operators still run, before
        ``on_iteration_terminated``, as Flink ML processes what was fed back). None
        otherwise: nothing was fed back, or ``max_epochs`` caps the rounds (no subtask
        runs epoch ``max_epochs``)."""
        if self.terminated is not TerminationReason.CRITERIA or self.aligned < 1:
            return None
        c = self.counts.get(self.aligned - 1)
        return self.aligned if c is not None and c.published > 0 else None

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.num_subtasks

    @property
    def epochs_completed(self) -> int:
        """Epochs whose watermark every tier has seen: alignment k completes epoch k - 1."""
        return max(self.aligned, 0)

    @property
    def slowest(self) -> int:
        """The lowest call any subtask has made (its current epoch)."""
        return self._min_call

    def validate(self, *, holding: bool = False) -> None:
        """Invariants that must hold between events (used by tests). ``holding``: a
        checkpoint's cut holds the pending calls (they may be releasable)."""
        assert self.aligned <= min(self.last_call) + 1, (self.aligned, self.last_call)
        assert self._min_call == min(self.last_call), (self._min_call, self.last_call)
        assert self._at_call == {c: n for c, n in collections.Counter(self.last_call).items()}, (
            self._at_call,
            self.last_call,
        )
        for pid, epoch in self.pending.items():
            assert self.last_call[pid] == epoch
        if self.terminated is None and not self.failed:
            assert self.next_alignment() is None, "an alignment was left incomplete"
            for epoch in self.pending.values() if not holding else ():
                assert not self._may_start(epoch), "a releasable call was left pending"

    # -- helpers ------------------------------------------------------------------------

    def _may_start(self, epoch: int) -> bool:
        if self.max_epochs is not None and epoch >= self.max_epochs:
            return False
        if epoch == 0:
            # In every mode epoch 0 starts at alignment 0, once all data is loaded and
            # checked (an empty stream must fail before any callback runs on it).
            return self.aligned >= 0
        if self.staleness is None:
            return True
        return epoch <= self.aligned + self.staleness

    def _move_call(self, old: int, new: int) -> None:
        at = self._at_call
        left = at[old] - 1
        if left:
            at[old] = left
        else:
            del at[old]
        at[new] = at.get(new, 0) + 1
        if old == self._min_call and not left:
            while self._min_call not in at:  # amortised O(1): the minimum only grows
                self._min_call += 1

    def _counts(self, epoch: int) -> EpochCounts:
        c = self.counts.get(epoch)
        if c is None:
            c = self.counts[epoch] = EpochCounts()
        return c

    def _check_pid(self, pid: int) -> None:
        if not 0 <= pid < self.num_subtasks:
            raise StateMachineError(f"subtask id {pid} out of range [0, {self.num_subtasks})")
