"""What the driver hands a coordinator actor: plain, picklable data (and the user's
operators, cloudpickled)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._checkpoint import checkpoint_key, previous_checkpoint_key
from ._hooks import RuntimeHooks
from ._tree import TreeSpec
from ._variables import INLINE_LIMIT

__all__ = ["CheckpointSpec", "CoordinatorSpec"]


@dataclass(frozen=True)
class CoordinatorSpec:
    """Everything the actor needs; plain, picklable data plus the user's operators."""

    num_subtasks: int
    num_streams: int
    staleness: int | None
    max_epochs: int | None
    has_criteria: bool
    init_variables: Mapping[str, Any]
    #: cloudpickle of ``(main_operator_or_None, per_round_operator_or_None, [listeners])``,
    #: loaded in the actor
    operators: bytes = b""
    #: the main coordinator operator is created afresh every round (PER_ROUND lifecycle)
    main_per_round: bool = False
    checkpoint: CheckpointSpec | None = None
    #: called at named points (tests: ``hybrid_iter.testing``); None: no hooks
    hooks: RuntimeHooks | None = None
    inline_limit: int = INLINE_LIMIT
    progress_tag: str = "loss"
    #: feedback_combine: merge feedback in a tree (sync only; ``coordinator._tree``)
    tree: TreeSpec | None = None
    #: the launch whose calls a newly created actor accepts from the start, so the driver
    #: need not wait for the actor's process before the Spark stage (None: none until
    #: ``begin_attempt``); a restarted actor ignores it (the driver opens the next one)
    attempt: int | None = None
    #: the Ray resources the coordinator tier asks for (the driver's placement rule,
    #: ``hybrid_iter._cluster.placement``): the tree's aggregators go where it goes
    placement: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often the coordinator checkpoints, and whether it restores."""

    uri: str
    #: checkpoint at every alignment that is a multiple of this (0: never, only restore)
    every_epochs: int = 1
    keep_last: int = 2
    #: what identifies the iteration; a checkpoint with another fingerprint is refused
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    #: start from the newest valid checkpoint (a retry, or resume_from)
    restore: bool = False
    #: the run this iteration is; a checkpoint of another run is refused
    run_id: str = ""
    #: the HMAC key authenticating the files (resolved on the driver: ``checkpoint_key``)
    key: bytes = field(default_factory=checkpoint_key, repr=False)
    #: a key still accepted for reading during a key rotation (``previous_checkpoint_key``)
    previous_key: bytes | None = field(default_factory=previous_checkpoint_key, repr=False)
    #: a restore must find a checkpoint of at least this epoch (the driver saw it
    #: written, or resumes from it); finding less is an error, never a silent restart
    expect_epoch: int | None = None
