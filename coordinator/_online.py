"""The coordinator of an unbounded (online) iteration: one round per micro-batch.

Runs in a Ray actor (a plain class, made an actor where it is launched). Spark
Structured Streaming drives it: every micro-batch's tasks report their partition's
emissions keyed by ``(batch_id, partition)``; the driver then commits the batch. In sync
mode the commit applies the batch's feedback in partition order and runs the
coordinator's watermark callback of the round (one lock-step round per micro-batch, one
variables version); in async mode feedback is applied as it arrives and the commit only
closes the round.

Exactly once: a batch id at or below the last committed one is a replay (Spark re-runs
the last batch after a restart) and is ignored; a task that Spark retries within a batch
reports the same key again and is counted once. With a checkpoint store the state is
persisted at every commit, before ``foreachBatch`` returns, so Spark never commits a batch
whose update could be lost.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ._actor import CoordinatorSpec, IterationCoordinator, _UserCodeFailed
from ._errors import RemoteFailure
from ._protocol import Emissions, OutputRecord

__all__ = ["OnlineCoordinator"]


class OnlineCoordinator(IterationCoordinator):
    """Rounds are micro-batches; there is no termination (an online iteration runs until
    it is stopped)."""

    def __init__(self, spec: CoordinatorSpec, put: Any = None) -> None:
        self.committed = -1  # the last committed micro-batch id
        self.round = 0
        self.batches = 0
        self.total_rows = 0
        self.dead_letters = 0
        self.last_commit: float | None = None
        self._reports: dict[int, dict[int, Emissions]] = {}
        self._applied: set[tuple[int, int]] = set()  # async: (batch, partition) applied
        self._delivered = 0  # output records handed to the driver
        super().__init__(spec, put)
        self._attempt = 0
        self._feedback_counts = Counter()  # partitions vary from one micro-batch to the next

    # -- calls from Spark tasks ---------------------------------------------------------

    async def online_report(self, batch_id: int, partition: int, emissions: Emissions) -> bool:
        """A micro-batch partition's emissions; False when it is a replay (ignored)."""
        if self._failures or batch_id <= self.committed:
            return False
        if self.spec.staleness == 0:
            self._reports.setdefault(batch_id, {})[partition] = emissions  # a retry overwrites
            return True
        if (batch_id, partition) in self._applied:
            return False
        self._applied.add((batch_id, partition))
        try:
            self._apply_partition_emissions(partition, self.round, emissions)
        except _UserCodeFailed:
            pass
        return True

    # -- calls from the driver ----------------------------------------------------------

    def commit_batch(self, batch_id: int, rows: int, dead_letters: int) -> dict[str, Any]:
        """Close micro-batch ``batch_id`` (a round); returns the new output records."""
        if self._failures:
            return {"applied": False, "failure": self._failures[0], "outputs": []}
        if batch_id <= self.committed:
            return {"applied": False, "failure": None, "outputs": []}  # a replayed batch
        try:
            for partition, em in sorted(self._reports.pop(batch_id, {}).items()):
                self._apply_partition_emissions(partition, self.round, em)
            self._coordinator_watermark(self.round)
        except _UserCodeFailed:
            return {"applied": False, "failure": self._failures[0], "outputs": []}
        self._reports = {b: r for b, r in self._reports.items() if b > batch_id}
        self.sm.counts.clear()  # termination counts mean nothing online
        self._applied = {k for k in self._applied if k[0] > batch_id}
        self.committed = batch_id
        self.round += 1
        self.batches += 1
        self.total_rows += rows
        self.dead_letters += dead_letters
        self.last_commit = time.time()
        self._alignment_times.append(self.last_commit)
        if self._ckpt_store is not None:
            try:
                self._persist()
            except Exception as ex:
                self._record_failure(
                    RemoteFailure.capture(
                        ex, source="coordinator", epoch=self.round, where="writing a checkpoint"
                    )
                )
                return {"applied": False, "failure": self._failures[0], "outputs": []}
        new = self._outputs[self._delivered :]
        self._delivered = len(self._outputs)
        self._notify_progress()
        return {"applied": True, "failure": None, "outputs": list(new), "round": self.round}

    def online_state(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "round": self.round,
            "batches": self.batches,
            "rows": self.total_rows,
            "dead_letters": self.dead_letters,
            "version": self.store.version,
            "last_loss": self._last_loss,
            "last_commit": self.last_commit,
            "failures": list(self._failures),
        }

    def latest_variables(self) -> dict[str, Any]:
        return dict(self.store.values)

    def recent_outputs(self, limit: int = 1000) -> list[OutputRecord]:
        return list(self._outputs[-limit:])

    # -- persistence --------------------------------------------------------------------

    def _persist(self) -> None:
        import cloudpickle

        main = self._main.alive()
        data = {
            "fingerprint": dict(self.spec.checkpoint.fingerprint),
            "online": True,
            "committed": self.committed,
            "round": self.round,
            "batches": self.batches,
            "rows": self.total_rows,
            "dead_letters": self.dead_letters,
            "variables": self.store.values,
            "version": self.store.version,
            "publishes": self.store.publishes,
            "main": self._dump_operator(main) if main is not None else None,
            "listeners": cloudpickle.dumps(list(self._listeners)),
            "last_loss": self._last_loss,
        }
        started = time.perf_counter()
        # keyed by the batch id: a replay rewrites the same file
        self._save_checkpoint(self.committed, data, started)

    def _restore(self) -> bool:
        """Online state from the newest valid checkpoint (False when there is none)."""
        import cloudpickle

        from ._checkpoint import fingerprint_mismatch

        assert self._ckpt_store is not None and self.spec.checkpoint is not None
        loaded = self._ckpt_store.load_latest()
        if loaded is None:
            return False
        self.skipped_checkpoints = list(loaded.skipped)
        if loaded.epoch < 0:
            return False  # only corrupt files: start fresh, Spark replays from its offsets
        data = loaded.data
        mismatch = fingerprint_mismatch(
            data.get("fingerprint", {}), self.spec.checkpoint.fingerprint
        )
        if mismatch or not data.get("online"):
            raise ValueError(
                f"checkpoint {loaded.path} is of another iteration: {mismatch or 'not online'}"
            )
        self.committed, self.round = data["committed"], data["round"]
        self.batches, self.total_rows, self.dead_letters = (
            data["batches"],
            data["rows"],
            data["dead_letters"],
        )
        self.store.restore(data["variables"], data["version"], data["publishes"])
        if data["main"] is not None and self._main.template is not None:
            kind, blob = data["main"]
            if kind == "state":
                self._main.open_all_round()
                self._user_call(self._main.alive(), "restore_state", cloudpickle.loads(blob))
            else:
                self._main.adopt(cloudpickle.loads(blob))
        self._listeners = cloudpickle.loads(data["listeners"])
        self._last_loss = data["last_loss"]
        self._outputs = list(self._ckpt_store.outputs_until(loaded.epoch))
        self._saved_outputs = self._delivered = len(self._outputs)
        self.restored_from = loaded.path
        return True
