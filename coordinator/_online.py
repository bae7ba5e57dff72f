"""The coordinator of an unbounded (online) iteration: one round per micro-batch.

Runs in a Ray actor (a plain class, made an actor where it is launched). Spark
Structured Streaming drives it: every micro-batch's tasks report their partition's
emissions keyed by ``(batch_id, partition)``; the driver then commits the batch. In sync
mode the commit applies the batch's feedback in partition order and runs the
coordinator's watermark callback of the round (one lock-step round per micro-batch, one
variables version); in async mode feedback is applied as it arrives and the commit only
closes the round.

Exactly once is ``OnlineLedger``'s pure bookkeeping: a batch id at or below the last
committed one is a replay (Spark re-runs the last batch after a restart) and is ignored;
a task that Spark retries within a batch reports the same key again and is counted once;
a journal is replayed in order and never across a gap. With a checkpoint store every
commit, before ``foreachBatch`` returns (so Spark never commits a batch whose update
could be lost), writes

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
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ._checkpoint import (
    LoadedCheckpoint,
    delete_name,
    list_names,
    read_record,
    write_record,
)
from ._core import COORDINATOR, Apply, FeedbackShapes, Watermark
from ._errors import CheckpointCorrupt, RemoteFailure, UserCodeFailed
from ._host import OperatorHost
from ._identity import refuse_not_online
from ._online_protocol import OnlineCommit, OnlineRestore, OnlineStatus
from ._protocol import Emissions, OutputRecord, ResultData
from ._shell import LOADING, ProgressWaiters, object_store, startup_failure
from ._snapshots import Snapshots
from ._spec import CoordinatorSpec
from ._variables import VariablesPayload, VariablesStore

__all__ = ["OnlineCoordinator", "OnlineLedger"]

#: commits kept for the batches/s and rows/s window
_RATE_WINDOW = 64


class OnlineLedger:
    """Exactly once over Spark's micro-batches, and the stream's counters: pure
    bookkeeping (no Ray, no I/O). ``sync``: a batch's reports wait for its commit."""

    def __init__(self, *, sync: bool) -> None:
        self.sync = sync
        self.committed = -1  # the last committed micro-batch id
        self.round = 0
        self.batches = self.rows = self.dead_letters = self.dead_files = 0
        self.last_commit: float | None = None
        self.rate: deque[tuple[float, int]] = deque(maxlen=_RATE_WINDOW)
        #: sync: each batch's reports by partition (a task retry overwrites its own)
        self._reports: dict[int, dict[int, Emissions]] = {}
        #: async: (batch, partition) applied, and each batch's emissions in applied order
        self._applied: set[tuple[int, int]] = set()
        self._journal: dict[int, list[tuple[int, Emissions]]] = {}

    def report(self, batch: int, partition: int, em: Emissions) -> Literal["held", "apply", "old"]:
        """A micro-batch partition's emissions: held for the commit (sync), to apply now
        (async; kept for the journal), or old (a replay, or a retry already applied)."""
        if batch <= self.committed:
            return "old"
        if self.sync:
            self._reports.setdefault(batch, {})[partition] = em
            return "held"
        if (batch, partition) in self._applied:
            return "old"
        self._applied.add((batch, partition))
        self._journal.setdefault(batch, []).append((partition, em))
        return "apply"

    def entries(self, batch: int) -> list[tuple[int, Emissions]] | None:
        """The emissions batch ``batch`` commits, in the order they apply (sync: to apply
        now, in partition order; async: applied already); None for a replayed batch."""
        if batch <= self.committed:
            return None
        if self.sync:
            return sorted(self._reports.get(batch, {}).items())
        return list(self._journal.get(batch, []))

    def close(self, batch: int, rows: int, dead_letters: int, dead_files: int, now: float) -> None:
        """Batch ``batch`` is committed (what it held is let go): the next round starts."""
        self._reports = {b: r for b, r in self._reports.items() if b > batch}
        self._journal = {b: e for b, e in self._journal.items() if b > batch}
        self._applied = {k for k in self._applied if k[0] > batch}
        self.committed = batch
        self.round += 1
        self.batches += 1
        self.rows += rows
        self.dead_letters += dead_letters
        self.dead_files += dead_files
        self.last_commit = now
        self.rate.append((now, rows))

    def replay_plan(self, journal: Sequence[int]) -> tuple[list[int], tuple[int, str] | None]:
        """Which of the journal records on disk (batch ids) a restore replays after the
        state it holds, in order: the run of consecutive batches after the last committed
        one. The first record past a missing batch cannot be applied (nor anything after
        it): it comes back with why, as ``(batch, why)``; None when there is no gap."""
        plan: list[int] = []
        for b in sorted(set(journal)):
            if b <= self.committed:
                continue
            expected = self.committed + 1 + len(plan)
            if b != expected:
                return plan, (b, f"batch {expected} has no journal record")
            plan.append(b)
        return plan, None

    def validate(self) -> None:
        """Invariants that hold between calls (the ledger's tests check them at their end)."""
        assert self.committed >= -1 and self.round >= 0, (self.committed, self.round)
        assert min(self.batches, self.rows, self.dead_letters, self.dead_files) >= 0
        assert len(self.rate) <= self.batches, "a commit rate without its commit"
        assert all(b > self.committed for b in self._reports), "a committed batch still held"
        assert all(b > self.committed for b in self._journal), "a committed batch journaled"
        assert all(b > self.committed for b, _ in self._applied), "a committed batch applied"
        if self.sync:
            assert not self._applied and not self._journal, "sync applies only at commit"
        else:
            assert not self._reports, "async holds nothing for the commit"
            by_batch: dict[int, list[int]] = {}
            for b, entries in self._journal.items():
                by_batch[b] = [p for p, _ in entries]
                assert len(set(by_batch[b])) == len(by_batch[b]), f"batch {b} applied twice"
            applied = {(b, p) for b, ps in by_batch.items() for p in ps}
            assert applied == self._applied, "the journal and the applied set disagree"

    def rates(self) -> tuple[float | None, float | None]:
        """Batches and rows per second over the last commits."""
        window = list(self.rate)
        span = window[-1][0] - window[0][0] if len(window) >= 2 else 0.0
        if span <= 0:
            return None, None
        return (len(window) - 1) / span, sum(r for _, r in window[1:]) / span

    def snapshot(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "round": self.round,
            "batches": self.batches,
            "rows": self.rows,
            "dead_letters": self.dead_letters,
            "dead_files": self.dead_files,
        }

    def restore(self, data: Mapping[str, Any]) -> None:
        self.committed, self.round = data["committed"], data["round"]
        self.batches, self.rows = data["batches"], data["rows"]
        self.dead_letters, self.dead_files = data["dead_letters"], data.get("dead_files", 0)


def _journal_name(batch_id: int) -> str:
    return f"jrn-{batch_id:012d}.ckpt"


def _batch_of(name: str, prefix: str, suffix: str) -> int | None:
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    try:
        return int(name[len(prefix) : -len(suffix)])
    except ValueError:
        return None


class OnlineCoordinator:
    """Rounds are micro-batches; there is no termination (an online iteration runs until
    it is stopped). All public methods are called through Ray."""

    def __init__(self, spec: CoordinatorSpec, put: Any = None) -> None:
        put, get = object_store(put)
        self.spec = spec
        self.ledger = OnlineLedger(sync=spec.staleness == 0)
        self.store = VariablesStore(
            spec.init_variables, put=put, get=get, inline_limit=spec.inline_limit
        )
        self.host = OperatorHost(
            num_subtasks=spec.num_subtasks,
            staleness=spec.staleness,
            has_criteria=spec.has_criteria,
            store=self.store,
            aligned=lambda: self.ledger.round,  # rounds before the current one are complete
            progress_tag=spec.progress_tag,
            hooks=spec.hooks,
        )
        self.failures: list[RemoteFailure] = []
        self.feedback_counts: Counter[int] = Counter()  # partitions vary between batches
        self._shapes = FeedbackShapes()
        self._failure_waiters = ProgressWaiters()
        self._alignment_times: list[float] = []
        #: the output records of the last committed batch (delivered again on a replay)
        self._last_outputs: tuple[int, list[OutputRecord]] = (-1, [])
        self.last_checkpoint: float | None = None
        self.restore_report = OnlineRestore()
        self.snapshots: Snapshots | None = None
        try:
            if spec.operators:
                self.host.load(spec.operators, main_per_round=spec.main_per_round)
        except Exception as ex:
            self._fail(RemoteFailure.capture(ex, source=COORDINATOR, epoch=None, where=LOADING))
        try:
            self.snapshots = Snapshots(spec.checkpoint) if spec.checkpoint is not None else None
            if self.snapshots is None or not self._restore():
                self.host.open(checkpointed=self.snapshots is not None)
        except Exception as ex:
            self._fail(startup_failure(ex))

    # -- calls from Spark tasks -------------------------------------------------------------

    async def variables(self, known_version: int = -1) -> VariablesPayload | None:
        """The newest variables if newer than ``known_version``."""
        return self.store.payload() if self.store.version > known_version else None

    async def online_report(self, batch_id: int, partition: int, emissions: Emissions) -> bool:
        """A micro-batch partition's emissions; False when it is a replay (ignored)."""
        if self.failures:
            return False
        verdict = self.ledger.report(batch_id, partition, emissions)
        if verdict == "apply":
            try:
                self._apply(partition, self.ledger.round, emissions)
            except UserCodeFailed:
                pass
        return verdict != "old"

    async def fail(self, failure: RemoteFailure, attempt: int = 0) -> None:
        """A task failed: keep the failure for the driver."""
        self._fail(failure)

    # -- calls from the driver --------------------------------------------------------------

    def commit_batch(
        self, batch_id: int, rows: int, dead_letters: int, dead_files: int = 0
    ) -> OnlineCommit:
        """Close micro-batch ``batch_id`` (a round); returns the new output records."""
        if self.failures:
            return OnlineCommit(False, self.failures[0])
        entries = self.ledger.entries(batch_id)
        if entries is None:
            return OnlineCommit(False)  # a replayed batch
        try:
            if self.ledger.sync:
                for partition, em in entries:
                    self._apply(partition, self.ledger.round, em)
            self._close_round(batch_id, rows, dead_letters, dead_files)
        except UserCodeFailed:
            return OnlineCommit(False, self.failures[0])
        new, self.host.outputs = self.host.outputs, []  # delivered: they leave memory
        self._last_outputs = (batch_id, new)
        if self.snapshots is not None:
            try:
                self._write_journal(batch_id, entries, rows, dead_letters, dead_files)
                self._persist()
                self._prune_journal()
            except Exception as ex:
                where = "writing a checkpoint"
                round_ = self.ledger.round
                self._fail(RemoteFailure.capture(ex, source=COORDINATOR, epoch=round_, where=where))
                return OnlineCommit(False, self.failures[0])
        return OnlineCommit(True, None, list(new), self.ledger.round)

    def online_state(self) -> OnlineStatus:
        ledger = self.ledger
        batches_per_s, rows_per_s = ledger.rates()
        return OnlineStatus(
            committed=ledger.committed,
            round=ledger.round,
            batches=ledger.batches,
            rows=ledger.rows,
            dead_letters=ledger.dead_letters,
            dead_files=ledger.dead_files,
            version=self.store.version,
            last_loss=self.host.last_loss,
            last_commit=ledger.last_commit,
            last_checkpoint=self.last_checkpoint,
            batches_per_s=batches_per_s,
            rows_per_s=rows_per_s,
            failures=list(self.failures),
            restore=self.restore_report,
            held_outputs=len(self.host.outputs),
            recent_commits=list(ledger.rate),
            pid=os.getpid(),
        )

    def latest_variables(self) -> dict[str, Any]:
        return dict(self.store.values)

    def last_outputs(self) -> tuple[int, list[OutputRecord]]:
        """The output records of the last committed batch (for a replayed batch)."""
        return self._last_outputs

    async def wait_failure(self, timeout: float) -> bool:
        """Whether a failure is recorded, answered at once when one is, else when one
        comes or at ``timeout`` (the driver's failure watch long-polls this)."""
        await self._failure_waiters.wait((), self._failed, timeout)
        return bool(self.failures)

    def _failed(self) -> bool:
        return bool(self.failures)

    def result(self) -> ResultData:
        return ResultData(
            variables=dict(self.store.values),
            outputs=[] if self.failures else list(self.host.outputs),
            epochs=self.ledger.round,
            terminated_by=None,
            alignment_times=list(self._alignment_times),
            subtask_epochs={},
            feedback_counts=dict(sorted(self.feedback_counts.items())),
            rows=[self.ledger.rows],
            publishes=self.store.publishes,
            object_store_puts=self.store.puts,
            failures=list(self.failures),
        )

    # -- internals ----------------------------------------------------------------------------

    def _apply(self, partition: int, round_: int, em: Emissions) -> None:
        failure = self._shapes.check(partition, round_, em.feedback)
        if failure is not None:
            self._fail(failure)
            raise UserCodeFailed(failure)
        self.feedback_counts[partition] += em.feedback_count
        self._user(Apply(round_, partition, em))

    def _user(self, call: Any) -> None:
        done = self.host.run(call)  # publishes and criteria decide nothing online
        if done.failure is not None:
            self._fail(done.failure)
            raise UserCodeFailed(done.failure)

    def _fail(self, failure: RemoteFailure) -> None:
        self.failures.append(failure)
        self._failure_waiters.notify(self._failed)

    def _close_round(self, batch_id: int, rows: int, dead_letters: int, dead_files: int) -> None:
        """The coordinator's watermark callback of the batch's round and the counters."""
        self._user(Watermark(self.ledger.round))
        self.ledger.close(batch_id, rows, dead_letters, dead_files, time.time())
        # the last two are kept (the list must not grow with the stream's age)
        self._alignment_times = [*self._alignment_times[-1:], time.time()]

    # -- persistence --------------------------------------------------------------------------

    def _write_journal(
        self,
        batch_id: int,
        entries: list[tuple[int, Emissions]],
        rows: int,
        dead_letters: int,
        dead_files: int,
    ) -> None:
        assert self.snapshots is not None
        record = {
            "fingerprint": dict(self.snapshots.spec.fingerprint),
            "batch_id": batch_id,
            "entries": entries,
            "rows": rows,
            "dead_letters": dead_letters,
            "dead_files": dead_files,
        }
        write_record(self.snapshots.store, _journal_name(batch_id), record)

    def _prune_journal(self) -> None:
        """Journal records at or before the oldest kept snapshot are not needed any more."""
        assert self.snapshots is not None
        store = self.snapshots.store
        kept = store.checkpoint_epochs()
        if not kept:
            return
        for name in list_names(store):
            b = _batch_of(name, "jrn-", ".ckpt")
            if b is not None and b <= kept[0]:
                delete_name(store, name)

    def _persist(self) -> None:
        assert self.snapshots is not None
        data = {
            **self.snapshots.common(self.host, self.store),
            "online": True,
            **self.ledger.snapshot(),
            "last_outputs": self._last_outputs,
        }
        started = time.perf_counter()
        # keyed by the batch id: a replay rewrites the same file; the outputs are in the
        # snapshot (``last_outputs``), so no ``out-*`` segment piles up per batch
        self.snapshots.save(self.ledger.committed, data, [], started)
        self.snapshots.written = self.snapshots.written[-8:]
        self.last_checkpoint = time.time()

    def _restore(self) -> bool:
        """Online state from the newest valid snapshot plus the journal after it (False
        when there is nothing to restore). What could not be restored is in
        ``restore_report`` for the driver to hold against Spark's own commit log."""
        assert self.snapshots is not None
        started = time.perf_counter()
        store = self.snapshots.store
        names = list_names(store)
        journal_ids = sorted(
            b for b in (_batch_of(n, "jrn-", ".ckpt") for n in names) if b is not None
        )
        snapshot_ids = store.checkpoint_epochs()
        report = self.restore_report = OnlineRestore(
            newest_on_disk=max([*journal_ids, *snapshot_ids], default=-1)
        )
        if not journal_ids and not snapshot_ids:
            return False
        loaded = store.load_latest()
        if loaded is not None:
            report.skipped = list(loaded.skipped)
            self.snapshots.skipped = list(loaded.skipped)
        if loaded is not None and loaded.epoch >= 0:
            self._restore_snapshot(loaded)
            report.snapshot = loaded.path
        else:
            self.host.main.open_all_round()  # no usable snapshot: the journal starts from init
        plan, gap = self.ledger.replay_plan(journal_ids)
        for b in plan:
            try:
                record = read_record(store, _journal_name(b))
                self.snapshots.check_fingerprint(record, f"{_journal_name(b)} in {store.uri}")
            except (CheckpointCorrupt, OSError) as ex:
                report.unusable.append((b, str(ex)))
                break
            for partition, em in record["entries"]:
                self._apply(partition, self.ledger.round, em)
            self._close_round(b, record["rows"], record["dead_letters"], record["dead_files"])
            self._last_outputs, self.host.outputs = (b, self.host.outputs), []
            report.replayed.append(b)
        else:  # every record of the run was read: what follows a gap cannot be applied
            if gap is not None:
                report.unusable.append(gap)
        if report.skipped and report.replayed:
            # the journal rebuilt what a damaged snapshot held: write it down again, so the
            # damaged file is replaced and does not count among the kept snapshots
            self._persist()
        report.seconds = time.perf_counter() - started
        return True

    def _restore_snapshot(self, loaded: LoadedCheckpoint) -> None:
        assert self.snapshots is not None
        data = loaded.data
        refuse_not_online(data, loaded.path)
        self.snapshots.restore_common(loaded, self.host, self.store)
        self.ledger.restore(data)
        self._last_outputs = data.get("last_outputs", (self.ledger.committed, []))
        self.host.outputs = []
