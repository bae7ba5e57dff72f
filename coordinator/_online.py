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
reports the same key again and is counted once. With a checkpoint store every commit,
before ``foreachBatch`` returns (so Spark never commits a batch whose update could be
lost), writes

* a **journal record** ``jrn-<batch>.ckpt``: the batch's partition emissions in the order
  they were applied, its row and dead-letter counts (small: feedback, not state);
* a **snapshot** ``chk-<batch>.ckpt``: variables, operator state, counters, and the output
  records of that batch (so a driver that died before delivering them can deliver them
  again when Spark replays the batch).

A restore takes the newest valid snapshot and applies the journal records after it in
order, so a missing or corrupt newest snapshot loses nothing as long as the journal of
the batches after the previous snapshot is readable. Snapshots are pruned to
``keep_last``, journals to those after the oldest kept snapshot: the directory holds at
most ``2 * keep_last`` files (+1 being written) however long the stream runs, and a
restore reads at most ``keep_last`` snapshots and ``keep_last - 1`` journal records.
Output records leave the actor's memory once the driver has taken them.
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from typing import Any

from ._actor import CoordinatorSpec, IterationCoordinator, _UserCodeFailed
from ._checkpoint import (
    CheckpointCorrupt,
    ForeignCheckpoint,
    delete_name,
    list_names,
    read_record,
    write_record,
)
from ._errors import RemoteFailure
from ._protocol import Emissions, OutputRecord

__all__ = ["OnlineCoordinator"]

#: commits kept for the batches/s and rows/s window
_RATE_WINDOW = 64


def _journal_name(batch_id: int) -> str:
    return f"jrn-{batch_id:012d}.ckpt"


def _batch_of(name: str, prefix: str, suffix: str) -> int | None:
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    try:
        return int(name[len(prefix) : -len(suffix)])
    except ValueError:
        return None


class OnlineCoordinator(IterationCoordinator):
    """Rounds are micro-batches; there is no termination (an online iteration runs until
    it is stopped)."""

    def __init__(self, spec: CoordinatorSpec, put: Any = None) -> None:
        self.committed = -1  # the last committed micro-batch id
        self.round = 0
        self.batches = 0
        self.total_rows = 0
        self.dead_letters = 0
        self.dead_files = 0
        self.last_commit: float | None = None
        self.last_checkpoint: float | None = None
        self._reports: dict[int, dict[int, Emissions]] = {}
        #: async: (batch, partition) applied, and the batch's emissions in applied order
        self._applied: set[tuple[int, int]] = set()
        self._journal: dict[int, list[tuple[int, Emissions]]] = {}
        #: the output records of the last committed batch (delivered again on a replay)
        self._last_outputs: tuple[int, list[OutputRecord]] = (-1, [])
        self._rate: deque[tuple[float, int]] = deque(maxlen=_RATE_WINDOW)
        self.restore_report: dict[str, Any] = {}
        super().__init__(spec, put)
        self._attempt = 0

    def _new_feedback_counts(self) -> Counter[int]:
        return Counter()  # partitions vary between micro-batches: only those seen

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
        self._journal.setdefault(batch_id, []).append((partition, emissions))
        try:
            self._apply_partition_emissions(partition, self.round, emissions)
        except _UserCodeFailed:
            pass
        return True

    # -- calls from the driver ----------------------------------------------------------

    def commit_batch(
        self, batch_id: int, rows: int, dead_letters: int, dead_files: int = 0
    ) -> dict[str, Any]:
        """Close micro-batch ``batch_id`` (a round); returns the new output records."""
        if self._failures:
            return {"applied": False, "failure": self._failures[0], "outputs": []}
        if batch_id <= self.committed:
            return {"applied": False, "failure": None, "outputs": []}  # a replayed batch
        if self.spec.staleness == 0:
            entries = sorted(self._reports.pop(batch_id, {}).items())
        else:
            entries = self._journal.pop(batch_id, [])
        try:
            if self.spec.staleness == 0:
                for partition, em in entries:
                    self._apply_partition_emissions(partition, self.round, em)
            self._close_round(batch_id, rows, dead_letters, dead_files)
        except _UserCodeFailed:
            return {"applied": False, "failure": self._failures[0], "outputs": []}
        new, self._outputs = self._outputs, []  # delivered: they leave the actor's memory
        self._last_outputs = (batch_id, new)
        if self._ckpt_store is not None:
            try:
                self._write_journal(batch_id, entries, rows, dead_letters, dead_files)
                self._persist()
                self._prune_journal()
            except Exception as ex:
                self._record_failure(
                    RemoteFailure.capture(
                        ex, source="coordinator", epoch=self.round, where="writing a checkpoint"
                    )
                )
                return {"applied": False, "failure": self._failures[0], "outputs": []}
        self._notify_progress()
        return {"applied": True, "failure": None, "outputs": list(new), "round": self.round}

    def _close_round(self, batch_id: int, rows: int, dead_letters: int, dead_files: int) -> None:
        """The coordinator's watermark callback of the batch's round and the counters."""
        self._coordinator_watermark(self.round)
        self._reports = {b: r for b, r in self._reports.items() if b > batch_id}
        self._journal = {b: e for b, e in self._journal.items() if b > batch_id}
        self.sm.counts.clear()  # termination counts mean nothing online
        self._applied = {k for k in self._applied if k[0] > batch_id}
        self.committed = batch_id
        self.round += 1
        self.batches += 1
        self.total_rows += rows
        self.dead_letters += dead_letters
        self.dead_files += dead_files
        self.last_commit = time.time()
        self._rate.append((self.last_commit, rows))
        # progress() needs the last two; the list must not grow with the stream's age
        self._alignment_times = [*self._alignment_times[-1:], self.last_commit]

    def online_state(self) -> dict[str, Any]:
        window = list(self._rate)
        span = window[-1][0] - window[0][0] if len(window) >= 2 else 0.0
        return {
            "committed": self.committed,
            "round": self.round,
            "batches": self.batches,
            "rows": self.total_rows,
            "dead_letters": self.dead_letters,
            "dead_files": self.dead_files,
            "version": self.store.version,
            "last_loss": self._last_loss,
            "last_commit": self.last_commit,
            "last_checkpoint": self.last_checkpoint,
            "batches_per_s": (len(window) - 1) / span if span > 0 else None,
            "rows_per_s": sum(r for _, r in window[1:]) / span if span > 0 else None,
            "failures": list(self._failures),
            "restore": dict(self.restore_report),
            "restore_s": self.restore_report.get("seconds"),
            "held_outputs": len(self._outputs),
            "recent_commits": list(self._rate),  # (time, rows) of the last commits
            "pid": os.getpid(),
        }

    def latest_variables(self) -> dict[str, Any]:
        return dict(self.store.values)

    def last_outputs(self) -> tuple[int, list[OutputRecord]]:
        """The output records of the last committed batch (for a replayed batch)."""
        return self._last_outputs

    def recent_outputs(self, limit: int = 1000) -> list[OutputRecord]:
        return list(self._last_outputs[1][-limit:])

    # -- persistence --------------------------------------------------------------------

    def _write_journal(
        self,
        batch_id: int,
        entries: list[tuple[int, Emissions]],
        rows: int,
        dead_letters: int,
        dead_files: int,
    ) -> None:
        assert self._ckpt_store is not None and self.spec.checkpoint is not None
        record = {
            "fingerprint": dict(self.spec.checkpoint.fingerprint),
            "batch_id": batch_id,
            "entries": entries,
            "rows": rows,
            "dead_letters": dead_letters,
            "dead_files": dead_files,
        }
        write_record(self._ckpt_store, _journal_name(batch_id), record)

    def _prune_journal(self) -> None:
        """Journal records at or before the oldest kept snapshot are not needed any more."""
        assert self._ckpt_store is not None
        snapshots = self._ckpt_store.checkpoint_epochs()
        if not snapshots:
            return
        oldest = snapshots[0]
        for name in list_names(self._ckpt_store):
            b = _batch_of(name, "jrn-", ".ckpt")
            if b is not None and b <= oldest:
                delete_name(self._ckpt_store, name)

    def _persist(self) -> None:
        data = {
            **self._checkpoint_common(),
            "online": True,
            "committed": self.committed,
            "round": self.round,
            "batches": self.batches,
            "rows": self.total_rows,
            "dead_letters": self.dead_letters,
            "dead_files": self.dead_files,
            "last_outputs": self._last_outputs,
        }
        started = time.perf_counter()
        # keyed by the batch id: a replay rewrites the same file; the outputs are in the
        # snapshot (``last_outputs``), so no ``out-*`` segment piles up per batch
        self._save_checkpoint(self.committed, data, started)
        self.checkpoints = self.checkpoints[-8:]
        self.last_checkpoint = time.time()

    def _restore(self) -> bool:
        """Online state from the newest valid snapshot plus the journal after it (False
        when there is nothing to restore). What could not be restored is in
        ``restore_report`` for the driver to hold against Spark's own commit log."""
        assert self._ckpt_store is not None and self.spec.checkpoint is not None
        started = time.perf_counter()
        self._feedback_counts = self._new_feedback_counts()
        names = list_names(self._ckpt_store)
        journal_ids = sorted(
            b for b in (_batch_of(n, "jrn-", ".ckpt") for n in names) if b is not None
        )
        snapshot_ids = self._ckpt_store.checkpoint_epochs()
        report: dict[str, Any] = {
            "snapshot": None,
            "skipped": [],
            "replayed": [],
            "unusable": [],
            "newest_on_disk": max([*journal_ids, *snapshot_ids], default=-1),
        }
        self.restore_report = report
        if not journal_ids and not snapshot_ids:
            return False
        loaded = self._ckpt_store.load_latest()
        if loaded is not None:
            report["skipped"] = list(loaded.skipped)
            self.skipped_checkpoints = list(loaded.skipped)
        if loaded is not None and loaded.epoch >= 0:
            self._restore_snapshot(loaded)
            report["snapshot"] = loaded.path
        else:
            self._main.open_all_round()  # no usable snapshot: the journal starts from init
        for b in journal_ids:
            if b <= self.committed:
                continue
            if b != self.committed + 1:  # a gap: what follows it cannot be applied
                report["unusable"].append((b, f"batch {self.committed + 1} has no journal record"))
                break
            try:
                record = read_record(self._ckpt_store, _journal_name(b))
                self._check_fingerprint(record, f"{_journal_name(b)} in {self._ckpt_store.uri}")
            except (CheckpointCorrupt, OSError) as ex:
                report["unusable"].append((b, str(ex)))
                break
            for partition, em in record["entries"]:
                self._apply_partition_emissions(partition, self.round, em)
            self._close_round(b, record["rows"], record["dead_letters"], record["dead_files"])
            self._last_outputs = (b, self._outputs)
            self._outputs = []
            report["replayed"].append(b)
        self._saved_outputs = 0
        if report["skipped"] and report["replayed"]:
            # the journal rebuilt what a damaged snapshot held: write it down again, so the
            # damaged file is replaced and does not count among the kept snapshots
            self._persist()
        report["seconds"] = time.perf_counter() - started
        return True

    def _restore_snapshot(self, loaded: Any) -> None:
        data = loaded.data
        if not data.get("online"):
            raise ForeignCheckpoint(f"checkpoint {loaded.path} is of another iteration: not online")
        self._restore_common(loaded)
        self.committed, self.round = data["committed"], data["round"]
        self.batches, self.total_rows, self.dead_letters = (
            data["batches"],
            data["rows"],
            data["dead_letters"],
        )
        self.dead_files = data.get("dead_files", 0)
        self._last_outputs = data.get("last_outputs", (self.committed, []))
        self._outputs = []
