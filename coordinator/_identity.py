"""Whether a checkpoint is the one this run expects: its identity and every refusal.

One module decides it for every reader: the driver before a run (``resume_from``, a
path that already holds another run's files, a node-local path on a multi-node
cluster), the checkpoint store (a file of another run id), the coordinator restoring
(another iteration's fingerprint, less than the driver saw written), and the driver
after Ray restarted the coordinator (the same check on what it reports). Pure: it reads
no file; the callers hand it what they read.

A checkpoint belongs to a run when both hold

* the same **run id** (written into every file's authenticated header), and
* the same **fingerprint**: what makes the result (``iteration_fingerprint``: operator
  classes, their source and attributes, the initial variables, the config fields that
  change the result, the subtask count).

and a restore is the expected one when it finds at least the newest checkpoint the
driver saw written (``RestoredCheckpoint``), unless the newer files are visible but
damaged (then falling back to an older one is right).
"""

from __future__ import annotations

import hashlib
import inspect
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import storage_uri

from ._errors import ForeignCheckpoint, IterationConfigError, MissingCheckpoint

__all__ = [
    "RestoredCheckpoint",
    "damaged_since",
    "fingerprint_mismatch",
    "iteration_fingerprint",
    "node_local_refusal",
    "refuse_foreign_fingerprint",
    "refuse_foreign_run",
    "refuse_not_online",
    "refuse_occupied_path",
    "refuse_unresumable",
]


# -- the fingerprint ------------------------------------------------------------------------


def _digest_operator(op: Any) -> bytes:
    """A digest of one operator that is stable across processes (cloudpickle's bytes
    are not: they carry per-process class ids): its class, the class's source, and
    each attribute pickled by value where plain pickle can, else its type."""
    if op is None:
        return b"-"
    h = hashlib.sha256(f"{type(op).__module__}.{type(op).__qualname__}".encode())
    for klass in type(op).__mro__:
        if klass.__module__.split(".")[0] in ("builtins", "hybrid_iter"):
            continue
        try:
            h.update(inspect.getsource(klass).encode())
        except (OSError, TypeError):
            h.update(klass.__qualname__.encode())
    for key, value in sorted(getattr(op, "__dict__", {}).items()):
        h.update(key.encode())
        try:
            h.update(pickle.dumps(value, protocol=4))
        except Exception:
            h.update(f"{type(value).__module__}.{type(value).__qualname__}".encode())
    return h.digest()


def iteration_fingerprint(
    body: Any,
    streams: Any,
    variables: Mapping[str, Any],
    n: int,
    config: Any = None,
) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by this iteration (``body``: an
    ``IterationBody``, ``streams``: a ``ReplayableDataStreamList``). With ``config``
    (bounded runs) also digests of the body (operator classes' source and pickled
    attributes), of the initial variables' values and of the config fields that change
    the result: a resume with another learning rate or other initial values is refused."""

    def name(obj: Any) -> str | None:
        return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"

    out: dict[str, Any] = {
        "variables": {k: (tuple(v.shape), str(v.dtype)) for k, v in sorted(variables.items())},
        "partition_operator": name(body.partition),
        "coordinator_operator": name(body.coordinator),
        "listeners": [name(x) for x in body.coordinator_listeners],
        "data_streams": len(streams),
        "subtasks": n,
    }
    if config is not None:
        ops: dict[str, Any] = {
            "partition": body.partition,
            "coordinator": body.coordinator,
            "per_round_partition": body.per_round_partition,
            "per_round_coordinator": body.per_round_coordinator,
        }
        ops.update({f"listener{i}": x for i, x in enumerate(body.coordinator_listeners)})
        out["body"] = {k: _digest_operator(op).hex()[:16] for k, op in ops.items()}
        h = hashlib.sha256()
        for k, v in sorted(variables.items()):
            h.update(f"{k}|{v.dtype.str}|{v.shape}|".encode())
            h.update(np.ascontiguousarray(v).tobytes())
        out["init_variables"] = h.hexdigest()[:16]
        out["config"] = {
            "staleness": config.staleness,
            "operator_lifecycle": str(config.operator_lifecycle.value),
            "replayed": list(streams.replayed),
        }
    return out


def fingerprint_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """Why a checkpoint's fingerprint does not match this iteration ("" when it does)."""
    return "; ".join(
        f"{key}: checkpoint has {saved.get(key)!r}, this iteration has {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    )


# -- refusals -------------------------------------------------------------------------------


def refuse_foreign_fingerprint(
    data: Mapping[str, Any], fingerprint: Mapping[str, Any], what: str
) -> None:
    """``ForeignCheckpoint`` when the file ``what`` (its ``data``) holds another
    iteration's fingerprint."""
    mismatch = fingerprint_mismatch(data.get("fingerprint", {}), fingerprint)
    if mismatch:
        raise ForeignCheckpoint(f"{what} is of another iteration: {mismatch}")


def refuse_foreign_run(path: str, found: str, this_run: str, uri: str) -> None:
    """``ForeignCheckpoint`` when the valid file ``path`` was written by run ``found``,
    not by ``this_run`` (empty: any run is accepted)."""
    if this_run and found != this_run:
        raise ForeignCheckpoint(
            f"checkpoint {path} belongs to run {found!r}, not to this run {this_run!r}; it "
            f"is never restored into another run: give this run its own "
            f"CheckpointConfig.path (or resume run {found!r} with resume_from={uri!r})"
        )


def refuse_occupied_path(uri: str, other_run: str | None) -> None:
    """A new run (no ``resume_from``) refuses a path that already holds files of some
    run: nothing there is overwritten."""
    raise IterationConfigError(
        f"CheckpointConfig.path {uri!r} already holds checkpoints of "
        f"{'run ' + repr(other_run) if other_run else 'a run'}; resume it with "
        f"IterationConfig(resume_from={uri!r}) or use an empty directory (nothing there is "
        f"overwritten)"
    )


def refuse_unresumable(
    loaded: Any, resume_from: str, fingerprint: Mapping[str, Any]
) -> tuple[str, int]:
    """The run id and epoch ``resume_from`` continues (``loaded``: its store's
    ``load_latest()``); ``IterationConfigError`` when it holds no valid checkpoint or
    one of another iteration."""
    if loaded is None or loaded.epoch < 0:
        why = "; ".join(f"{p}: {w}" for p, w in (loaded.skipped if loaded else ()))
        raise IterationConfigError(
            f"resume_from={resume_from!r} holds no valid checkpoint" + (f" ({why})" if why else "")
        )
    mismatch = fingerprint_mismatch(loaded.data.get("fingerprint", {}), fingerprint)
    if mismatch:
        raise IterationConfigError(
            f"checkpoint {loaded.path} is of another iteration (run {loaded.run_id!r}) and "
            f"cannot be resumed by this one (a new run): {mismatch}"
        )
    return loaded.run_id, loaded.epoch


def node_local_refusal(uri: str, alive_nodes: int, shared_filesystem: bool) -> str | None:
    """Why a checkpoint path cannot be used on this cluster (None: it can).

    A ``file:`` URI or a plain path lands on the disk of whichever node runs the
    coordinator; on a multi-node cluster a coordinator restarted elsewhere would not
    find it, and the driver's checks would read another disk."""
    local = storage_uri.parse(uri, what="checkpoint path", error=IterationConfigError).is_local
    if not local or alive_nodes <= 1 or shared_filesystem:
        return None
    return (
        f"checkpoint path {uri!r} is node-local, and the Ray cluster has {alive_nodes} nodes: "
        f"checkpoints would land on whichever node runs the coordinator, and a coordinator "
        f"restarted on another node (or the driver) would not find them. Use storage every "
        f"node shares (s3://, gs://, hdfs://), or, for a mount every node sees at the same "
        f"path (NFS, ...), declare it with CheckpointConfig(path, shared_filesystem=True)"
    )


def refuse_not_online(data: Mapping[str, Any], path: str) -> None:
    """An online iteration restores only a checkpoint an online iteration wrote (its
    ``data`` marks it ``online``)."""
    if not data.get("online"):
        raise ForeignCheckpoint(f"checkpoint {path} is of another iteration: not online")


# -- the restore ----------------------------------------------------------------------------


def damaged_since(damaged_epochs: Iterable[int], epoch: int) -> bool:
    """True when a checkpoint of ``epoch`` or newer was found damaged (skipped): the
    files are visible, only damaged, so falling back to an older checkpoint is right
    (unlike files that are missing: a node-local path)."""
    return any(e >= epoch for e in damaged_epochs)


@dataclass(frozen=True)
class RestoredCheckpoint:
    """What a restore found, against what it must find.

    ``found``: the epoch of the checkpoint restored (None: none); ``expected``: the
    newest checkpoint the driver saw written (None: nothing is expected);
    ``damaged``: the epochs of checkpoint files skipped as damaged; ``skipped``: their
    (path, why)."""

    found: int | None
    expected: int | None
    damaged: tuple[int, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of_info(cls, info: Mapping[str, Any], expected: int | None) -> RestoredCheckpoint:
        """From a coordinator's ``checkpoint_info()`` (a ``CheckpointInfo``)."""
        return cls(
            info["restored_epoch"],
            expected,
            tuple(info["skipped_epochs"]),
            tuple((str(p), str(w)) for p, w in info["skipped"]),
        )

    @property
    def older(self) -> bool:
        """It restored less than was written (or nothing)."""
        return self.expected is not None and (self.found is None or self.found < self.expected)

    @property
    def missing(self) -> bool:
        """Older, and not because the newer files are damaged: they are not visible."""
        return (
            self.older
            and self.expected is not None
            and not damaged_since(self.damaged, self.expected)
        )

    def error(self, uri: str, who: str) -> MissingCheckpoint:
        """The error of this restore when it is ``missing`` a checkpoint; ``who`` names
        the reader ("the coordinator (on node 10.0.0.3)")."""
        found = f"checkpoint {self.found}" if self.found is not None else "no checkpoint"
        newest = " as the newest valid one" if self.found is not None else ""
        skipped = "; ".join(f"{p}: {w}" for p, w in self.skipped) or "none skipped"
        return MissingCheckpoint(
            f"{who} found {found} in {uri!r}{newest}, but checkpoint {self.expected} was "
            f"written: the checkpoint path is not visible on that node (a node-local "
            f"file:// path on a multi-node cluster?) or newer files were lost ({skipped}); "
            f"use storage every node shares (s3://, gs://, hdfs://, or a shared mount with "
            f"CheckpointConfig(shared_filesystem=True))"
        )
