"""Plain records of an online iteration's calls: what a micro-batch partition's task
hands the driver (``PartitionTally``, with its ``BadFile`` rejects), what the driver's
commit of a batch answers (``OnlineCommit``), and where the iteration is
(``OnlineStatus``, with what its restore found, ``OnlineRestore``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._errors import RemoteFailure
from ._protocol import OutputRecord

__all__ = ["BadFile", "OnlineCommit", "OnlineRestore", "OnlineStatus", "PartitionTally"]


@dataclass(frozen=True, slots=True)
class BadFile:
    """A source file a micro-batch could not train on (not Parquet, columns of the wrong
    type, unreadable): its path and why; it goes to the dead-letter path."""

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class PartitionTally:
    """What one micro-batch partition's task hands the driver after it reported its
    emissions: the rows it trained on, the malformed rows it set aside, and the files of
    its share it rejected."""

    partition: int
    rows: int
    dead_letters: int
    bad_files: tuple[BadFile, ...] = ()


@dataclass(frozen=True)
class OnlineCommit:
    """What ``commit_batch`` answers: whether the batch was applied (a replay is not), the
    failure that stopped it, the batch's output records, and the next round."""

    applied: bool
    failure: RemoteFailure | None = None
    outputs: list[OutputRecord] = field(default_factory=list)
    round: int | None = None


@dataclass
class OnlineRestore:
    """What a restore found: the snapshot it took (None: none), the damaged files it
    skipped, the journal records it replayed, those it could not use ``(batch, why)``,
    the newest batch id on disk, and how long it took. The driver holds it against
    Spark's own commit log."""

    snapshot: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    replayed: list[int] = field(default_factory=list)
    unusable: list[tuple[int, str]] = field(default_factory=list)
    newest_on_disk: int = -1
    seconds: float | None = None


@dataclass(frozen=True)
class OnlineStatus:
    """Where an online iteration is (``online_state()``)."""

    committed: int
    round: int
    batches: int
    rows: int
    dead_letters: int
    dead_files: int
    version: int
    last_loss: Any
    last_commit: float | None
    last_checkpoint: float | None
    batches_per_s: float | None
    rows_per_s: float | None
    failures: list[RemoteFailure]
    restore: OnlineRestore
    held_outputs: int
    #: (time, rows) of the last commits
    recent_commits: list[tuple[float, int]]
    pid: int
