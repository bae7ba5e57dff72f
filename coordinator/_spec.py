"""What the driver hands a coordinator actor: plain, picklable data (and the user's
operators, cloudpickled); and how the driver decides a run's ``CheckpointSpec``
(``bounded_checkpoint_spec``, ``online_checkpoint_spec``: the store read, every refusal
of ``_identity`` applied, before any job)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._checkpoint import CheckpointStore, checkpoint_key, previous_checkpoint_key
from ._errors import IterationConfigError
from ._hooks import RuntimeHooks
from ._identity import (
    iteration_fingerprint,
    node_local_refusal,
    refuse_occupied_path,
    refuse_unresumable,
)
from ._tree import TreeSpec
from ._variables import INLINE_LIMIT

__all__ = ["CheckpointSpec", "CoordinatorSpec", "bounded_checkpoint_spec", "online_checkpoint_spec"]


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


# -- a run's checkpoint spec, decided on the driver -----------------------------------------


def bounded_checkpoint_spec(
    config: Any,
    body: Any,
    streams: Any,
    variables: Mapping[str, Any],
    n: int,
    alive_nodes: int = 1,
    warn: Callable[[str], None] = lambda _: None,
) -> CheckpointSpec | None:
    """The coordinator's ``CheckpointSpec`` of a bounded run (``config``: its
    ``IterationConfig``; None: it neither checkpoints nor resumes). Every refusal is
    raised here, on the driver, before any job: a node-local path on a multi-node
    cluster, replayed streams, a ``resume_from`` that is not the checkpoint path, a new
    run at a path that holds another run's files, a ``resume_from`` that holds no valid
    checkpoint or one of another iteration. ``warn`` hears of damaged files skipped."""
    ck = config.checkpoint
    if ck is None and config.resume_from is None:
        return None
    uri = ck.path if ck is not None else config.resume_from
    refusal = node_local_refusal(
        uri, alive_nodes, bool(ck is not None and getattr(ck, "shared_filesystem", False))
    )
    if refusal:
        raise IterationConfigError(refusal)
    if streams.any_replayed:
        raise IterationConfigError(
            "checkpoints and resume_from are not supported with replayed streams yet: an "
            "iteration with replayed streams restarts from round 0; read the streams once "
            "(not_replay) to checkpoint it"
        )
    if ck is not None and config.resume_from is not None and ck.path != config.resume_from:
        raise IterationConfigError(
            f"resume_from={config.resume_from!r} and CheckpointConfig.path={ck.path!r} differ; "
            f"a resumed iteration continues writing checkpoints where it resumes from"
        )
    fingerprint = iteration_fingerprint(body, streams, variables, n, config)
    try:
        key, previous_key = checkpoint_key(), previous_checkpoint_key()
    except ValueError as ex:
        raise IterationConfigError(str(ex)) from ex
    keep_last = ck.keep_last if ck is not None else 2
    store = CheckpointStore(uri, keep_last=keep_last, key=key, previous_key=previous_key)
    run_id, expect = uuid.uuid4().hex[:16], None
    if config.resume_from is None:
        if store.holds_files():
            refuse_occupied_path(uri, store.peek_run_id())
    else:
        loaded = store.load_latest()
        run_id, expect = refuse_unresumable(loaded, config.resume_from, fingerprint)
        for path, why in loaded.skipped if loaded is not None else ():
            warn(f"skipping checkpoint {path}: {why}")
    return CheckpointSpec(
        uri=store.uri,
        every_epochs=ck.every_epochs if ck is not None else 0,
        keep_last=keep_last,
        fingerprint=fingerprint,
        run_id=run_id,
        key=key,
        previous_key=previous_key,
        expect_epoch=expect,
    )


def online_checkpoint_spec(
    uri: str, keep_last: int, body: Any, streams: Any, variables: Mapping[str, Any]
) -> CheckpointSpec:
    """The coordinator's ``CheckpointSpec`` of an online run checkpointing under
    ``uri``: it always restores what is there, if it is an online checkpoint of this
    iteration (``refuse_not_online``, the fingerprint); a run id is not checked (a
    restarted query is a new driver process continuing the same state)."""
    return CheckpointSpec(
        uri=uri,
        every_epochs=1,
        keep_last=keep_last,
        fingerprint={**iteration_fingerprint(body, streams, variables, 0), "online": True},
        restore=True,
    )
