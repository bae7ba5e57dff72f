"""What a coordinator's checkpoint holds besides its core's part, written and read back.

Runs in the Ray coordinator actor; the bounded (``_actor.py``) and the online
(``_online.py``) coordinators both use it. Every checkpoint holds the fingerprint of the
iteration, the variables and their version, the coordinator operator's state (one form:
``_checkpoint.dump_operator``), the listeners and the last loss; the bounded one adds
its core's part (``CoordinatorCore``: the state machine, the cut, the counters) and the
alignment times, the online one its ledger. The container is ``_checkpoint.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from ._checkpoint import CheckpointStore, LoadedCheckpoint
from ._host import OperatorHost
from ._identity import RestoredCheckpoint, refuse_foreign_fingerprint
from ._variables import VariablesStore

__all__ = ["CheckpointInfo", "Snapshots"]


class CheckpointInfo(TypedDict):
    """What ``checkpoint_info()`` answers (it also lands in ``result.extra["checkpoint"]``)."""

    #: (epoch, path, seconds) of each checkpoint this coordinator wrote
    checkpoints: list[tuple[int, str, float]]
    #: the file it restored, and that checkpoint's epoch (None: it restored none)
    restored_from: str | None
    restored_epoch: int | None
    #: (path, why) of the files it skipped as damaged
    skipped: list[tuple[str, str]]
    #: the epochs of the checkpoint files among them
    skipped_epochs: list[int]
    #: Ray restarted this actor after its process died
    reconstructed: bool


class Snapshots:
    """One coordinator's checkpoint files (``spec``: a ``CheckpointSpec``)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.store = CheckpointStore(
            spec.uri,
            keep_last=spec.keep_last,
            key=spec.key,
            previous_key=spec.previous_key,
            run_id=spec.run_id,
        )
        self.written: list[tuple[int, str, float]] = []  # (epoch, path, seconds)
        self.restored_from: str | None = None
        self.restored_epoch: int | None = None
        self.skipped: list[tuple[str, str]] = []
        self.skipped_epochs: list[int] = []
        self.newest = -1  # the newest checkpoint written or restored
        self.saved_outputs = 0  # outputs[:saved_outputs] are in the files

    def common(self, host: OperatorHost, variables: VariablesStore) -> dict[str, Any]:
        """What every checkpoint of a coordinator holds (``restore_common`` reads it)."""
        return {
            "fingerprint": dict(self.spec.fingerprint),
            "variables": variables.values,
            "version": variables.version,
            "publishes": variables.publishes,
            **host.checkpoint_part(),
        }

    def check_fingerprint(self, data: Mapping[str, Any], what: str) -> None:
        """Refuse a checkpoint file of another iteration (``ForeignCheckpoint``)."""
        refuse_foreign_fingerprint(data, self.spec.fingerprint, what)

    def restore_common(
        self, loaded: LoadedCheckpoint, host: OperatorHost, variables: VariablesStore
    ) -> None:
        """Take back what ``common`` wrote (the fingerprint is checked)."""
        data = loaded.data
        self.check_fingerprint(data, f"checkpoint {loaded.path}")
        variables.restore(data["variables"], data["version"], data["publishes"])
        host.restore(data)
        self.restored_from = loaded.path
        self.restored_epoch = loaded.epoch

    def save(self, epoch: int, data: dict[str, Any], outputs: list[Any], started: float) -> str:
        """Write ``data`` with the outputs not yet saved; record the path and seconds."""
        path = self.store.save(epoch, data, outputs[self.saved_outputs :])
        self.saved_outputs = len(outputs)
        self.written.append((epoch, path, time.perf_counter() - started))
        self.newest = epoch
        return path

    def latest(self, node: Callable[[], str]) -> LoadedCheckpoint | None:
        """The newest valid checkpoint of a bounded iteration (None: there is none); a
        directory of damaged files only, or one without the checkpoint the driver saw
        written (``expect_epoch``), is an error (``node()`` names this host)."""
        loaded = self.store.load_latest()
        if loaded is None:
            return None
        self.skipped = list(loaded.skipped)
        self.skipped_epochs = list(loaded.skipped_epochs)
        if loaded.epoch < 0:
            raise ValueError(
                f"no valid checkpoint in {self.store.uri}: "
                + "; ".join(f"{p}: {why}" for p, why in loaded.skipped)
            )
        self._refuse_missing(loaded.epoch, node)
        return loaded

    def none_found(self, node: Callable[[], str]) -> None:
        """No checkpoint to restore: an error when the driver saw one written."""
        self._refuse_missing(None, node)

    def _refuse_missing(self, found: int | None, node: Callable[[], str]) -> None:
        """``MissingCheckpoint`` when checkpoint ``found`` is less than the driver saw
        written (``expect_epoch``) and the newer files are not merely damaged."""
        restored = RestoredCheckpoint(
            found, self.spec.expect_epoch, tuple(self.skipped_epochs), tuple(self.skipped)
        )
        if restored.missing:
            raise restored.error(self.spec.uri, f"the coordinator (on node {node()})")

    def outputs_until(self, epoch: int) -> list[Any]:
        """The output records saved up to checkpoint ``epoch`` (just restored)."""
        records = list(self.store.outputs_until(epoch))
        self.skipped += self.store.skipped_outputs
        self.saved_outputs = len(records)
        self.newest = epoch
        return records

    @staticmethod
    def info_of(snapshots: Snapshots | None, reconstructed: bool) -> CheckpointInfo:
        """What ``checkpoint_info()`` answers (``snapshots`` None: no checkpoints)."""
        return CheckpointInfo(
            checkpoints=list(snapshots.written) if snapshots else [],
            restored_from=snapshots.restored_from if snapshots else None,
            restored_epoch=snapshots.restored_epoch if snapshots else None,
            skipped=list(snapshots.skipped) if snapshots else [],
            skipped_epochs=list(snapshots.skipped_epochs) if snapshots else [],
            reconstructed=reconstructed,
        )
