"""The records of the parameter shard's core (``_shard_core.py``): what a shard is
(``ShardSpec``), the events it takes and the instructions it gives.

Events are calls: of workers (``Pull``, ``Push``, ``Lookup``, ``Retire``), of the run's
driver and coordinator (``Reset``, ``Save``, ``Restore``, ``LoadRows``), of the spare
pool (``Configure``, ``Forget``). Each carries the shell's ``slot`` (its future, or any
handle), which gets exactly one ``Reply`` or ``Refuse``: at once, or after a ``Wait``
from a later event. ``Put`` and ``WriteCheckpoint`` are what the shell does for the core
(an object-store put, a checkpoint file). Plain data: no asyncio, no Ray, no I/O.

The records are never changed once made, but are not frozen dataclasses: a frozen
one's ``__init__`` sets each field through ``object.__setattr__``, about 1 us more per
push (12 fields) on the path every training step takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import HybridIterError
from ._tables import TableSpec
from ._variables import INLINE_LIMIT

__all__ = [
    "Configure",
    "Event",
    "Forget",
    "Instruction",
    "LoadRows",
    "Lookup",
    "Pull",
    "Push",
    "Put",
    "Refuse",
    "Reply",
    "Reset",
    "Restore",
    "Retire",
    "Save",
    "ShardSpec",
    "Values",
    "Wait",
    "WriteCheckpoint",
]


@dataclass(frozen=True)
class ShardSpec:
    """What one shard needs: its key range, initial values, update rule, worker count;
    with tables, their specs and the shard count (the hash routing), the fencing token
    of the first launch, the step staleness bound (async), the checkpoint key and the
    run it belongs to."""

    shard_id: int
    lo: int
    hi: int
    init: np.ndarray
    rule: str
    rule_params: Mapping[str, float]
    num_workers: int
    sync: bool
    inline_limit: int = INLINE_LIMIT
    extra: Mapping[str, Any] = field(default_factory=dict)
    tables: tuple[TableSpec, ...] = ()
    num_shards: int = 1
    token: str | None = None
    staleness_steps: int | None = None
    run_id: str = ""
    key: bytes = field(default=b"", repr=False)


# -- events: calls of workers ---------------------------------------------------------------


@dataclass(slots=True)
class Pull:
    """Worker ``pid`` wants the parameters of its step ``(epoch, step)`` (sync: exactly
    those before it; async: the newest), with the rows of ``keys`` (per table)."""

    slot: Any
    pid: int
    epoch: int
    step: int
    token: str | None
    keys: Any = None
    #: per table, how often the step sees each of ``keys`` (tables with admission)
    counts: Any = None


@dataclass(slots=True)
class Push:
    """Worker ``pid``'s gradient of step ``(epoch, step)`` (None: no step), weighted by
    ``rows``; ``tables``: per table, gradient rows aligned with the rows sent for this
    step; ``pull_next``: reply with the parameters of its next step (and the rows of
    ``keys``); ``span``: its steps per epoch (the staleness count)."""

    slot: Any
    pid: int
    epoch: int
    step: int
    grad: Any
    rows: float
    last: bool
    pull_next: bool
    token: str | None = None
    tables: Any = None
    keys: Any = None
    span: int | None = None
    #: per table, how often the next step sees each of ``keys`` (tables with admission)
    counts: Any = None


@dataclass(slots=True)
class Lookup:
    """The values of ``keys`` (per table) without creating rows; ``dense``: with the
    dense parameters, once step ``at`` is reached (sync; None: now)."""

    slot: Any
    token: str | None
    keys: Any
    dense: bool = False
    at: tuple[int, int] | None = None


@dataclass(slots=True)
class Retire:
    """Worker ``pid`` takes no more steps: it no longer holds back the others."""

    slot: Any
    pid: int


# -- events: calls of the run's driver and coordinator --------------------------------------


@dataclass(slots=True)
class Reset:
    """Back to the initial state (a new launch of the stage), under ``token``."""

    slot: Any
    token: str


@dataclass(slots=True)
class Save:
    """Checkpoint ``cut``: the whole shard as one record, written as ``name`` in
    ``uri`` (both opaque here: the shell's)."""

    slot: Any
    cut: str
    uri: str
    name: str


@dataclass(slots=True)
class Restore:
    """Replace the whole state by ``record`` (read from ``where``), which must belong to
    checkpoint ``cut``, under ``token``."""

    slot: Any
    record: Mapping[str, Any]
    cut: str
    token: str
    where: str


@dataclass(slots=True)
class LoadRows:
    """Add rows of ``table`` (a loaded model): keys that hash here, none held yet."""

    slot: Any
    table: str
    keys: np.ndarray
    values: np.ndarray


@dataclass(slots=True)
class Configure:
    """Make a spare the shard of ``spec`` (``can_put``: an object store runs here;
    ``restarted``: Ray restarted this process)."""

    slot: Any
    spec: ShardSpec
    can_put: bool
    restarted: bool


@dataclass(slots=True)
class Forget:
    """The run ended well: drop it and be a spare, unless ``declined`` (Ray restarted
    the process, or it serves its own endpoint): then answer False."""

    slot: Any
    declined: bool


Event = Pull | Push | Lookup | Retire | Reset | Save | Restore | LoadRows | Configure | Forget


# -- instructions ---------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Values:
    """A reply's parameters: ``version``; ``inline``, the dense values themselves (a copy,
    or the live array where the shell sends it before the next event), or None when
    ``by_ref`` (the object-store copy of this version); ``rows`` per table (None: the
    call asked for none)."""

    version: int
    inline: np.ndarray | None
    by_ref: bool
    rows: tuple[np.ndarray | None, ...] | None = None


@dataclass(slots=True)
class Reply:
    """Answer the call at ``slot`` with ``value`` (``Values``, rows, a summary or None)."""

    slot: Any
    value: Any


@dataclass(slots=True)
class Refuse:
    """Answer the call at ``slot`` with ``error``: nothing of it was applied."""

    slot: Any
    error: HybridIterError


@dataclass(slots=True)
class Wait:
    """The call at ``slot`` waits (``until``: sync, for that step; None: its staleness
    gate); a later event answers it."""

    slot: Any
    until: tuple[int, int] | None


@dataclass(slots=True, eq=False)
class Put:
    """Put ``value`` (the dense values of ``version``) into the object store: the
    replies ``by_ref`` after it carry that reference."""

    version: int
    value: np.ndarray


@dataclass(slots=True, eq=False)
class WriteCheckpoint:
    """Write ``record`` (the whole shard) as the sealed record ``name`` in ``uri``."""

    uri: str
    name: str
    record: dict[str, Any]


Instruction = Reply | Refuse | Wait | Put | WriteCheckpoint
