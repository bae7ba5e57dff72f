"""Test-only hooks: injected faults, forced process exits, simulated stragglers.

Nothing here runs unless a test or a benchmark passes it in. The product only calls a
``RuntimeHooks`` object at named points (``IterationConfig(hooks=...)``,
``OnlineConfig(hooks=...)``, the ``hybrid_iter.ml`` estimators' private ``_fit(...,
hooks=...)``); the actions live here::

    from hybrid_iter.testing import FaultInjection, Straggler

    config = hi.IterationConfig(hooks=FaultInjection(fail_partition=1, at_epoch=10))
    config = hi.IterationConfig(hooks=FaultInjection(kill_coordinator_at=14))
    online = hi.OnlineConfig(hooks=FaultInjection(kill_driver_after_batch=3))
    model = LogisticRegression(solver="sgd")._fit(df, hooks=Straggler(partition=1, factor=4))
    model = KMeans(k=3)._fit(df, hooks=PauseWorker(directory=d, partition=1, at_epoch=2))
    hooks = CombinedHooks((Straggler(partition=1, factor=4), TraceVersions(directory=d)))

Never use these in production: they end processes and sleep on purpose.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import storage_uri
from coordinator import RuntimeHooks

from ._config import _is_int
from ._errors import InjectedFault, IterationConfigError, UsageError

__all__ = [
    "EXIT_CODE",
    "CombinedHooks",
    "FaultInjection",
    "InjectedFault",
    "LoseKeptArrays",
    "PauseWorker",
    "RuntimeHooks",
    "Straggler",
    "TraceVersions",
    "pause_worker",
]

#: the status a process ended by a ``FaultInjection`` exits with
EXIT_CODE = 17


@dataclass(frozen=True, kw_only=True)
class FaultInjection(RuntimeHooks):
    """Deterministic faults for tests of recovery (never use in production).

    * ``fail_partition=p, at_epoch=e, on_attempt=a``: subtask ``p`` raises
      ``InjectedFault`` right before its watermark callback of epoch ``e``, on launch ``a``
      of the stage (0 is the first; a retry is 1, ...).
    * ``kill_coordinator_at=e``: the coordinator actor's process exits at the global
      alignment ``e`` of the first launch (once: not again after Ray restarts it).
    * ``kill_driver_after_batch=b`` (``iterate_unbounded_streams``): the driver process
      exits right after committing micro-batch ``b``, before Spark commits it (once: not
      in a query that resumed).
    """

    fail_partition: int | None = None
    at_epoch: int = 0
    on_attempt: int = 0
    kill_coordinator_at: int | None = None
    kill_driver_after_batch: int | None = None

    def __post_init__(self) -> None:
        for name in ("at_epoch", "on_attempt"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise IterationConfigError(f"FaultInjection.{name} must be an int >= 0, got {v!r}")
        for name in ("fail_partition", "kill_coordinator_at", "kill_driver_after_batch"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise IterationConfigError(f"FaultInjection.{name} must be None or an int >= 0")

    def at_alignment(self, epoch: int, *, attempt: int | None, restarted: bool) -> None:
        if epoch == self.kill_coordinator_at and not attempt and not restarted:
            os._exit(EXIT_CODE)  # the coordinator's process dies here

    def before_watermark(self, partition: int, epoch: int, attempt: int) -> None:
        if (partition, epoch, attempt) == (self.fail_partition, self.at_epoch, self.on_attempt):
            raise InjectedFault(
                f"injected fault: partition {partition} at epoch {epoch} on attempt {attempt}"
            )

    def after_batch(self, batch_id: int, *, resumed: bool) -> None:
        if batch_id == self.kill_driver_after_batch and not resumed:
            os._exit(EXIT_CODE)  # after our commit, before Spark's


@dataclass(frozen=True)
class Straggler(RuntimeHooks):
    """Subtask ``partition`` computes ``factor`` times slower than it does (benchmarks of
    async and bounded-staleness modes): it sleeps ``(factor - 1)`` times the compute time
    of each epoch, loading excluded."""

    partition: int
    factor: float

    def __post_init__(self) -> None:
        if not _is_int(self.partition) or self.partition < 0:
            raise IterationConfigError(
                f"Straggler.partition must be an int >= 0, got {self.partition!r}"
            )
        if not isinstance(self.factor, int | float) or not self.factor >= 1:
            raise IterationConfigError(
                f"Straggler.factor must be a number >= 1, got {self.factor!r}"
            )

    def after_epoch_compute(self, partition: int, seconds: float) -> None:
        if partition == self.partition:
            time.sleep((self.factor - 1.0) * seconds)


def pause_worker(directory: str, *, pauses: int = 1, timeout: float = 300.0) -> int:
    """Spark task: the handshake of a test that kills a Python worker from outside.

    Records this process's pid in ``directory/pid-<n>`` (written whole;
    ``n`` counts the calls before it, so a relaunch writes the next one) and, for the
    first ``pauses`` calls, waits there until the test kills the process, or until
    ``directory/release-<n>`` appears; past ``timeout`` seconds it raises
    ``InjectedFault`` (the test never killed it). Returns ``n``.
    """
    n = 0
    while True:  # claim the next number: two tasks never take the same one
        try:
            os.close(os.open(os.path.join(directory, f"claim-{n}"), os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            n += 1
    with storage_uri.atomic_output(os.path.join(directory, f"pid-{n}")) as f:
        f.write(str(os.getpid()).encode())
    if n >= pauses:
        return n
    release = os.path.join(directory, f"release-{n}")
    deadline = time.monotonic() + timeout
    while not os.path.exists(release):  # polls a file the test writes, bounded
        if time.monotonic() > deadline:
            raise InjectedFault(
                f"pause_worker: pid {os.getpid()} waited {timeout:g} s in {directory} and was "
                f"neither killed nor released"
            )
        time.sleep(0.02)
    return n


@dataclass(frozen=True, kw_only=True)
class PauseWorker(RuntimeHooks):
    """Subtask ``partition`` stops right before its watermark callbacks of epoch
    ``at_epoch`` in ``pause_worker(directory, pauses=...)``: mid-run, its Python
    worker's pid in a file, for a test to kill from outside. Every launch records
    its pid (the count of ``pid-*`` files is the count of launches); the first
    ``pauses`` wait."""

    directory: str
    partition: int = 0
    at_epoch: int = 1
    pauses: int = 1
    timeout: float = 300.0

    def before_watermark(self, partition: int, epoch: int, attempt: int) -> None:
        if (partition, epoch) == (self.partition, self.at_epoch):
            pause_worker(self.directory, pauses=self.pauses, timeout=self.timeout)


@dataclass(frozen=True, eq=False)
class LoseKeptArrays(RuntimeHooks):
    """A fit that decided to read arrays the array cache kept finds them gone: the store
    actor is killed (``ray.kill``, as from outside) right after the decision, before the
    fit's tasks read. The call is on the driver, so ``killed`` of the object passed to
    ``_fit(df, hooks=...)`` lists the killed stores."""

    killed: list[str] = field(default_factory=list)

    def after_array_lookup(self, store: Any) -> None:
        import ray

        ray.kill(store, no_restart=True)
        self.killed.append(repr(store))


@dataclass(frozen=True)
class TraceVersions(RuntimeHooks):
    """Benchmarks: every version of the variables the coordinator operator publishes,
    with when, and when each subtask began its first epoch, as files in ``directory``
    (a path every process of the run writes to: a local run's). ``read(directory)``
    returns them."""

    directory: str

    def before_watermark(self, partition: int, epoch: int, attempt: int) -> None:
        if epoch == 0:
            _write_whole(
                os.path.join(self.directory, f"start-{partition}-{attempt}.npz"), t=time.time()
            )

    def after_publish(self, epoch: int, variables: Mapping[str, Any]) -> None:
        name = f"version-{time.time_ns():020d}-{os.getpid()}.npz"
        arrays = {f"v_{k}": np.asarray(v) for k, v in variables.items()}
        _write_whole(os.path.join(self.directory, name), t=time.time(), epoch=epoch, **arrays)

    @staticmethod
    def read(directory: str) -> list[tuple[float, int, dict[str, np.ndarray]]]:
        """``(seconds since the first subtask began epoch 0, epoch, variables)`` of every
        published version, in the order published."""
        names = sorted(os.listdir(directory))
        starts = [np.load(os.path.join(directory, n)) for n in names if n.startswith("start-")]
        if not starts:
            raise UsageError(f"{directory!r} holds no trace: was TraceVersions passed as hooks?")
        t0 = min(float(s["t"]) for s in starts)
        out = []
        for n in names:
            if n.startswith("version-"):
                f = np.load(os.path.join(directory, n))
                variables = {k[2:]: f[k] for k in f.files if k.startswith("v_")}
                out.append((float(f["t"]) - t0, int(f["epoch"]), variables))
        return out


def _write_whole(path: str, **arrays: Any) -> None:
    """``np.savez`` to ``path``, written whole (a reader never sees half)."""
    with storage_uri.atomic_output(path) as f:
        np.savez(f, **arrays)


@dataclass(frozen=True)
class CombinedHooks(RuntimeHooks):
    """Each of ``parts`` at every hook point, in order (a straggler and a trace, say)."""

    parts: tuple[RuntimeHooks, ...]

    def at_alignment(self, epoch: int, *, attempt: int | None, restarted: bool) -> None:
        for h in self.parts:
            h.at_alignment(epoch, attempt=attempt, restarted=restarted)

    def before_watermark(self, partition: int, epoch: int, attempt: int) -> None:
        for h in self.parts:
            h.before_watermark(partition, epoch, attempt)

    def after_epoch_compute(self, partition: int, seconds: float) -> None:
        for h in self.parts:
            h.after_epoch_compute(partition, seconds)

    def after_array_lookup(self, store: Any) -> None:
        for h in self.parts:
            h.after_array_lookup(store)

    def after_publish(self, epoch: int, variables: Mapping[str, Any]) -> None:
        for h in self.parts:
            h.after_publish(epoch, variables)

    def after_batch(self, batch_id: int, *, resumed: bool) -> None:
        for h in self.parts:
            h.after_batch(batch_id, resumed=resumed)
