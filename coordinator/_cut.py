"""The consistent cut and the restore: pure logic, no Ray, no I/O.

Runs inside the coordinator actor (``_actor.py``), which feeds it events and carries out
its instructions; tests step it event by event without Ray (``tests/coordinator/test_cut.py``).

What it decides (docs/fault_tolerance.md):

* **Fencing**: calls of an earlier launch of the stage (tasks still dying after a
  failure) are refused; only the current ``attempt`` is served.
* **Sync buffering**: in sync mode a subtask's emissions of call ``k`` are held until
  global alignment ``k`` and then applied in partition order, so a run is deterministic
  whatever order the calls arrived in.
* **The cut**: at a checkpoint alignment every subtask is held in its pending call and
  asked for its state (in sync mode a subtask that knows its call is a cut's, because
  the cut epochs are fixed, may send its state with the call itself: one round trip
  instead of two); once every state is in, the cut is complete and holds, per
  subtask, the call it was held in (it makes that call again after a restore), the
  variables version its operators had processed (a restored subtask reports *that*
  version, so the newer variables of its held call are handed to it again *after* its
  state is restored), and its operator state; plus the emissions buffered for later
  alignments that were not applied yet (never lost, never applied twice).
* **The restore**: from a cut, the instructions for each relaunched subtask.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import CutError, IterationConfigError

__all__ = ["Cut", "CutProtocol", "SubtaskCut"]


@dataclass(frozen=True)
class SubtaskCut:
    """What one subtask had seen at the cut, and so what it restores.

    ``call``: the call it was held in (it makes it again); ``known_version``: the
    variables version its operators had processed; ``state``: its operator state as
    the subtask sent it (opaque here: ``None``, ``("state", blob)`` or
    ``("object", blob)``).
    """

    call: int
    known_version: int
    state: Any = None


@dataclass(frozen=True)
class Cut:
    """A complete consistent cut at global alignment ``epoch``."""

    epoch: int
    subtasks: Mapping[int, SubtaskCut]
    #: sync mode: emissions of calls beyond the cut, held for their alignment (by call,
    #: then partition); restored into the buffer so they are applied exactly once
    unapplied: Mapping[int, Mapping[int, Any]] = field(default_factory=dict)

    def to_plain(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "subtasks": {
                p: (s.call, s.known_version, s.state) for p, s in sorted(self.subtasks.items())
            },
            "unapplied": {k: dict(v) for k, v in self.unapplied.items()},
        }

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> Cut:
        return cls(
            data["epoch"],
            {p: SubtaskCut(*v) for p, v in data["subtasks"].items()},
            {k: dict(v) for k, v in data.get("unapplied", {}).items()},
        )


class CutProtocol:
    """Fencing, sync buffering, the cut and the restore of one iteration's coordinator."""

    def __init__(self, num_subtasks: int, *, sync: bool, every_epochs: int = 0) -> None:
        if num_subtasks < 1:
            raise IterationConfigError(f"num_subtasks must be >= 1, got {num_subtasks}")
        self.num_subtasks = num_subtasks
        self.sync = sync
        self.every_epochs = every_epochs
        self.attempt: int | None = None
        self._buffered: dict[int, dict[int, Any]] = {}
        self._pending: int | None = None  # the alignment being cut
        self._states: dict[int, SubtaskCut] = {}
        #: sync: states sent with a call ahead of its cut (by subtask)
        self._offered: dict[int, SubtaskCut] = {}
        self._restored: dict[int, SubtaskCut] = {}

    # -- fencing --------------------------------------------------------------------------

    def begin_attempt(self, attempt: int) -> None:
        """From now on only calls of launch ``attempt`` are served."""
        self.attempt = attempt

    def accepts(self, attempt: int) -> bool:
        return attempt == self.attempt

    # -- sync buffering ----------------------------------------------------------------------

    def on_report(self, pid: int, call: int, emissions: Any) -> bool:
        """Subtask ``pid`` made ``call`` with ``emissions``: True when they are to be
        applied now (async, bounded staleness), False when held for alignment ``call``."""
        if not self.sync:
            return True
        held = self._buffered.setdefault(call, {})
        if pid in held:
            raise CutError(f"subtask {pid} made call {call} twice")
        held[pid] = emissions
        return False

    def aligned(self, k: int) -> list[tuple[int, Any]]:
        """Alignment ``k`` is being completed: the held emissions to apply, in partition
        order."""
        return sorted(self._buffered.pop(k, {}).items())

    # -- the cut ---------------------------------------------------------------------------

    def is_cut(self, k: int) -> bool:
        """A cut starts at alignment ``k`` unless the iteration terminates there."""
        return k >= 1 and bool(self.every_epochs) and k % self.every_epochs == 0

    def offer_state(
        self, pid: int, call: int, known_version: int, state: Any, aligned: int
    ) -> None:
        """Sync: subtask ``pid`` sent its state with ``call`` (a cut's call, made with
        variables ``known_version``) so that the cut need not ask for it. Taken when
        alignment ``call`` starts a cut; dropped otherwise (the iteration terminated
        there, or the call was already aligned: a restored subtask making its held call
        again)."""
        if not self.sync or call <= aligned or not self.is_cut(call):
            return
        if not 0 <= pid < self.num_subtasks:
            raise CutError(f"subtask id {pid} out of range [0, {self.num_subtasks})")
        self._offered[pid] = SubtaskCut(call, known_version, state)

    def after_alignment(self, k: int, *, terminated: bool) -> bool:
        """Alignment ``k`` completed: True when a cut starts here (subtasks are held;
        the states offered with call ``k`` are in already)."""
        offered = {p: s for p, s in self._offered.items() if s.call == k}
        self._offered = {p: s for p, s in self._offered.items() if s.call > k}
        if terminated:
            self._pending, self._states = None, {}
            return False
        if self.is_cut(k):
            self._pending, self._states = k, offered
            return True
        return False

    @property
    def cutting(self) -> int | None:
        """The alignment being cut (subtasks are held until it completes), or None."""
        return self._pending

    def ask_state(self, waiting: list[int]) -> list[int]:
        """Of the subtasks held in a call, those that must send their state now."""
        if self._pending is None:
            return []
        return sorted(p for p in waiting if p not in self._states)

    def on_state(self, pid: int, call: int, known_version: int, state: Any) -> bool:
        """Subtask ``pid``, held in ``call`` with variables ``known_version``, sent its
        state; True when the cut is complete (every subtask's state is in)."""
        if self._pending is None:
            return False  # the cut was abandoned (the iteration terminated or failed)
        if not 0 <= pid < self.num_subtasks:
            raise CutError(f"subtask id {pid} out of range [0, {self.num_subtasks})")
        if pid in self._states:
            raise CutError(f"subtask {pid} sent its state twice for the cut at {self._pending}")
        self._states[pid] = SubtaskCut(call, known_version, state)
        return self.complete

    @property
    def complete(self) -> bool:
        return self._pending is not None and len(self._states) == self.num_subtasks

    def take(self) -> Cut:
        """The completed cut; subtasks may be released after it is written."""
        if not self.complete:
            raise CutError("the cut is not complete")
        assert self._pending is not None
        cut = Cut(
            self._pending,
            dict(self._states),
            {k: dict(v) for k, v in self._buffered.items() if v},
        )
        self._pending, self._states = None, {}
        return cut

    def abandon(self) -> None:
        self._pending, self._states, self._offered = None, {}, {}

    # -- the restore --------------------------------------------------------------------

    def restore(self, cut: Cut) -> None:
        """Load ``cut``: every subtask restores what it had seen and makes its held call
        again; emissions beyond the cut are held again for their alignments."""
        if sorted(cut.subtasks) != list(range(self.num_subtasks)):
            raise CutError(
                f"a cut of subtasks {sorted(cut.subtasks)} cannot restore "
                f"{self.num_subtasks} subtasks"
            )
        self._restored = dict(cut.subtasks)
        self._buffered = {k: dict(v) for k, v in cut.unapplied.items()}
        self._pending, self._states, self._offered = None, {}, {}

    def instruction(self, pid: int) -> SubtaskCut | None:
        """What relaunched subtask ``pid`` restores (None: it starts from scratch)."""
        return self._restored.get(pid)
