"""The spare life cycle, one protocol for both kinds of actor started ahead of need: the
iteration coordinator (``_actor.py``) and the parameter shards (``_shard_core.py``).

A *spare* is an idle process constructed with no spec: its start and its imports are
the slow part of a launch, so a run takes one that is up. ``configure(spec)`` makes a
spare serve one run, exactly as its constructor given ``spec`` would have. After a run
that ended well, the actor's give-back call (``IterationCoordinator.retire``, a shard's
``forget``) drops everything of that run (the instance's whole ``__dict__``: values,
references, counters) and makes it a spare again, or declines (it owns other actors,
holds a failure, was restarted by Ray...: then the caller kills it). Giving back a spare
is a no-op that answers True.

Misuse is refused with ``SpareMisuse`` naming it: ``configure`` of an actor that serves
a run (constructed with a spec, or configured already), or of a spare Ray restarted
(its constructor ran again as a spare, after whatever its process held was lost).

Pure: what only the process knows (was it restarted) is the caller's argument. Imports
neither pyspark nor Ray nor ``hybrid_iter``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ._errors import SpareMisuse

__all__ = ["SpareLife"]


class SpareLife:
    """Mixed into what goes through the spare life cycle: ``_spare`` says whether it is
    a spare (False for one constructed with a spec, the class default)."""

    #: what the messages call it ("coordinator", "parameter shard")
    SPARE_OF: ClassVar[str] = "actor"
    _spare: bool = False

    def _take_run(self, *, restarted: bool) -> None:
        """Check that a ``configure`` may make this a run's actor (``SpareMisuse`` if
        not) and mark it as serving one; the caller then sets up the run."""
        if not self._spare:
            raise SpareMisuse(
                f"this {self.SPARE_OF} is configured already: configure makes a spare (one "
                f"constructed with no spec, or given back after its run) serve one run; "
                f"start another {self.SPARE_OF} (or take another spare) for another run"
            )
        if restarted:
            raise SpareMisuse(
                f"a restarted spare {self.SPARE_OF} cannot take a run: Ray restarted its "
                f"process, whose constructor ran again as a spare; kill it and take another"
            )
        self._spare = False

    def _back_to_spare(self, keep: Sequence[str] = ()) -> None:
        """Drop everything of the run served (every instance attribute but those named
        in ``keep``, which outlive runs) and be a spare again."""
        held: dict[str, Any] = vars(self)
        kept = {name: held[name] for name in keep if name in held}
        held.clear()
        held.update(kept)
        self._spare = True
