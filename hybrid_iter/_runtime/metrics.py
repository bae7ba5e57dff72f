"""Progress as Ray metrics, and readable Spark job descriptions (the driver).

Every figure of a run's progress (a bounded iteration's epoch, loss, rows/s, model
version, relaunch attempt; an online query's micro-batch id, rows, dead letters,
checkpoint age, ...) is recorded with ``ray.util.metrics`` in the driver process, so
Ray's per-node metrics agent exports it on its Prometheus endpoint (and the Ray
dashboard's metrics view shows it); docs/observability.md lists them.

Where the values come from: the driver already polls the coordinator for its progress
(the progress line); a bounded run hands each snapshot to its ``RunMeter`` (a dict
update, no Ray call), an online run's meter polls the handle's ``progress`` every few
seconds on a thread of its own. One daemon thread per driver records what the meters
hold into Ray every ``refresh`` seconds: Ray's agent drops a gauge that was not
recorded within two of its export intervals, so a run that sits between two slow
micro-batches (or a finished run, for ``HYBRID_ITER_METRICS_LINGER_S``) stays visible.
Nothing is recorded on the epoch's critical path.

``HYBRID_ITER_METRICS=0`` switches the metrics off (read at each run's start). The
export needs Ray's metrics agent, i.e. ``ray[default]`` (``pip install
'hybrid-iter[metrics]'``); with a minimal Ray the values go nowhere, at no cost that
matters.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._errors import IterationConfigError

__all__ = [
    "ENV",
    "LINGER_ENV",
    "METRICS",
    "PREFIX",
    "RunMeter",
    "bounded_description",
    "bounded_meter",
    "job_description",
    "online_description",
    "online_meter",
    "set_job_description",
]

log = logging.getLogger("hybrid_iter")

#: every metric's name starts with this (Ray's exporter adds its own ``ray_`` in front)
PREFIX = "hybrid_iter_"
#: ``0``/``false``/``off`` switches the metrics off
ENV = "HYBRID_ITER_METRICS"
#: seconds a finished run's gauges stay exported (default 300)
LINGER_ENV = "HYBRID_ITER_METRICS_LINGER_S"
DEFAULT_LINGER_S = 300.0
#: the tags of every series: bounded per run (never a tag per epoch or per partition)
TAG_KEYS = ("iteration", "run", "mode")
#: seconds between two polls of an online query's progress
ONLINE_POLL_S = 5.0
#: bucket bounds (seconds) of the micro-batch duration histogram
BATCH_SECONDS_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

#: name (after PREFIX) -> (kind, unit, description); docs/observability.md says more
METRICS: dict[str, tuple[str, str, str]] = {
    "epoch": ("gauge", "epochs", "epochs completed (global alignments) of a bounded iteration"),
    "loss": ("gauge", "", "the newest output of the run's progress_tag (default 'loss')"),
    "epoch_seconds": ("gauge", "seconds", "duration of the last global epoch"),
    "rows": ("gauge", "rows", "rows of one pass over every data stream"),
    "rows_per_second": ("gauge", "rows/s", "rows of one pass / duration of the last epoch"),
    "subtask_epoch_spread": (
        "gauge",
        "epochs",
        "epochs of the fastest minus the slowest subtask (async, bounded staleness)",
    ),
    "model_version": ("gauge", "versions", "variables versions published by the coordinator"),
    "checkpoint_epoch": ("gauge", "epochs", "the newest checkpoint written or restored"),
    "attempt": ("gauge", "", "launch attempt of the run (0: first; n: n-th relaunch)"),
    "running": ("gauge", "", "1 while the run runs, 0 once it ended"),
    "failed": ("gauge", "", "1 once the run ended with an error (after its relaunches)"),
    "online_batch_id": ("gauge", "", "id of the last committed micro-batch"),
    "online_batch_rows": ("gauge", "rows", "rows of the last committed micro-batch"),
    "online_batches": ("counter", "batches", "micro-batches committed"),
    "online_rows": ("counter", "rows", "rows trained on"),
    "online_dead_letters": ("counter", "rows", "malformed rows sent to the dead-letter path"),
    "online_dead_files": ("counter", "files", "files rejected to the dead-letter path"),
    "online_batches_per_second": ("gauge", "batches/s", "over the last 64 commits"),
    "online_rows_per_second": ("gauge", "rows/s", "over the last 64 commits"),
    "online_lag_files": ("gauge", "files", "files waiting in the source (when it says)"),
    "online_checkpoint_age_seconds": ("gauge", "seconds", "since the last checkpoint"),
    "online_lost_batches": (
        "gauge",
        "batches",
        "micro-batches lost by on_corrupt_checkpoint='reset'",
    ),
    "online_batch_seconds": (
        "histogram",
        "seconds",
        "driver wall time of each micro-batch (its Spark jobs and the commit)",
    ),
}

_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def metrics_enabled() -> bool:
    """``HYBRID_ITER_METRICS``: on unless ``0``/``false``/``no``/``off``."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise IterationConfigError(
        f"environment variable {ENV}={os.environ[ENV]!r}: use 1 (export the progress as Ray "
        f"metrics, the default) or 0 (off)"
    )


def linger_seconds() -> float:
    """``HYBRID_ITER_METRICS_LINGER_S``: how long a finished run stays exported."""
    raw = os.environ.get(LINGER_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_LINGER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value < math.inf):
        raise IterationConfigError(
            f"environment variable {LINGER_ENV}={raw!r}: use seconds >= 0 (how long a "
            f"finished run's gauges stay exported; default {DEFAULT_LINGER_S:g})"
        )
    return value


def _number(value: Any) -> float | None:
    """A real scalar as float (a loss can be anything a user outputs: skip the rest)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


# -- the exporter: one per driver process ----------------------------------------------


@dataclass
class _Series:
    tags: dict[str, str]
    #: the Ray cluster (GCS address) the run belongs to: never exported into another
    cluster: str
    gauges: dict[str, float] = field(default_factory=dict)
    #: counters as running totals; ``pushed`` is what Ray has been given so far
    totals: dict[str, float] = field(default_factory=dict)
    pushed: dict[str, float] = field(default_factory=dict)
    observations: list[tuple[str, float]] = field(default_factory=list)
    #: monotonic time after which the series is dropped (None: the run is live)
    expires: float | None = None


class _Exporter:
    """Holds every series of this process and records them into Ray every ``refresh``
    seconds on a daemon thread, which exits when no series is left."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], _Series] = {}
        self._metrics: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    # called by the meters (any thread): no Ray call, a lock and a dict update
    def update(
        self,
        key: tuple[str, ...],
        new: Callable[[], _Series],
        gauges: Mapping[str, float | None] | None = None,
        totals: Mapping[str, float | None] | None = None,
        observe: tuple[str, float] | None = None,
        end: float | None = None,
    ) -> None:
        with self._lock:
            held = self._series.get(key)
            if held is None:
                held = self._series[key] = new()
            for k, v in (gauges or {}).items():
                if v is not None:
                    held.gauges[k] = float(v)
            for k, v in (totals or {}).items():
                if v is not None:
                    held.totals[k] = float(v)
            if observe is not None:
                held.observations.append(observe)
            if end is not None:
                held.expires = time.monotonic() + end
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hybrid_iter-metrics", daemon=True
                )
                self._thread.start()
        if end is not None:
            self._wake.set()  # the final values now, not at the next tick

    def _run(self) -> None:
        while True:
            self._wake.wait(_refresh_seconds())
            self._wake.clear()
            with self._lock:
                now = time.monotonic()
                for key in [k for k, s in self._series.items() if s.expires and now > s.expires]:
                    del self._series[key]
                if not self._series:
                    self._thread = None
                    return
                work = []
                for s in self._series.values():
                    deltas = {
                        k: v - s.pushed.get(k, 0.0)
                        for k, v in s.totals.items()
                        if v > s.pushed.get(k, 0.0)
                    }
                    s.pushed.update({k: s.totals[k] for k in deltas})
                    work.append((s.cluster, dict(s.tags), dict(s.gauges), deltas, s.observations))
                    s.observations = []
            try:
                self._record(work)
            except Exception as ex:  # metrics must never take a run down
                log.debug("hybrid_iter metrics not recorded: %s", ex)

    def _record(self, work: list[Any]) -> None:
        import ray

        if not ray.is_initialized():
            return
        cluster = ray.get_runtime_context().gcs_address
        for where, tags, gauges, deltas, observations in work:
            if where != cluster:
                continue  # a run of a Ray instance this process has left
            for name, value in gauges.items():
                self._metric(name).set(value, tags=tags)
            for name, value in deltas.items():
                self._metric(name).inc(value, tags=tags)
            for name, value in observations:
                self._metric(name).observe(value, tags=tags)

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util import metrics

            kind, unit, what = METRICS[name]
            description = f"{what} ({unit})" if unit else what
            if kind == "gauge":
                metric = metrics.Gauge(PREFIX + name, description, tag_keys=TAG_KEYS)
            elif kind == "counter":
                metric = metrics.Counter(PREFIX + name, description, tag_keys=TAG_KEYS)
            else:
                metric = metrics.Histogram(
                    PREFIX + name,
                    description,
                    boundaries=list(BATCH_SECONDS_BOUNDS),
                    tag_keys=TAG_KEYS,
                )
            self._metrics[name] = metric
        return metric


def _refresh_seconds() -> float:
    """Half Ray's metrics export interval (at most 2.5 s): every export sees each live
    gauge recorded since the previous one."""
    try:
        import ray

        interval = max(float(ray._config.metrics_report_interval_ms()), 1000.0) / 1000.0
    except Exception:
        interval = 10.0
    return min(2.5, interval / 2)


_EXPORTER = _Exporter()


# -- the meters: one per run ---------------------------------------------------------------


class RunMeter:
    """The metrics of one run, fed by the driver; a no-op when the metrics are off."""

    def __init__(
        self, tags: dict[str, str] | None, cluster: str = "", linger: float = DEFAULT_LINGER_S
    ) -> None:
        self.tags = tags
        self._linger = linger
        self._key = tuple(tags.values()) if tags else ()
        self._cluster = cluster
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.tags is not None

    def _series(self) -> _Series:
        assert self.tags is not None
        return _Series(dict(self.tags), self._cluster)

    def set(self, **gauges: float | None) -> None:
        if self.tags is not None:
            _EXPORTER.update(self._key, self._series, gauges=gauges)

    def progress(self, p: Any, *, attempt: int) -> None:
        """A bounded run's ``coordinator.Progress`` snapshot."""
        if self.tags is None:
            return
        from .progress import rows_per_second

        spread = max(p.subtask_epochs) - min(p.subtask_epochs) if p.subtask_epochs else None
        self.set(
            epoch=p.epochs,
            loss=_number(p.loss),
            epoch_seconds=p.last_epoch_seconds,
            rows=p.rows or None,
            rows_per_second=rows_per_second(p),
            subtask_epoch_spread=spread,
            model_version=p.version,
            checkpoint_epoch=p.checkpointed if p.checkpointed >= 0 else None,
            attempt=attempt,
        )

    def online(self, p: Any, *, running: bool = True, failed: bool = False) -> None:
        """An online query's ``OnlineProgress`` (and whether its query runs, or failed)."""
        if self.tags is None:
            return
        gauges = {
            "online_batch_id": p.last_batch_id if p.last_batch_id >= 0 else None,
            "online_batch_rows": getattr(p, "last_batch_rows", None),
            "online_batches_per_second": p.batches_per_s,
            "online_rows_per_second": p.rows_per_s,
            "online_lag_files": p.lag_files,
            "online_checkpoint_age_seconds": p.last_checkpoint_age_s,
            "online_lost_batches": len(p.lost_batches),
            "loss": _number(p.last_loss),
            "model_version": p.version,
            "running": 1 if running else 0,
            "failed": 1 if failed else 0,
        }
        totals = {
            "online_batches": p.batches,
            "online_rows": p.rows,
            "online_dead_letters": p.dead_letters,
            "online_dead_files": p.dead_files,
        }
        _EXPORTER.update(self._key, self._series, gauges=gauges, totals=totals)

    def batch_seconds(self, seconds: float) -> None:
        """One micro-batch's wall time on the driver."""
        if self.tags is not None:
            _EXPORTER.update(
                self._key, self._series, observe=("online_batch_seconds", float(seconds))
            )

    def watch(
        self,
        progress: Callable[[], Any],
        query: Any,
        failed: Callable[[], bool],
        every: float = ONLINE_POLL_S,
    ) -> None:
        """Poll ``progress()`` (an online handle's) every ``every`` seconds on a daemon
        thread until ``close``; ``query`` (Spark's ``StreamingQuery``) and ``failed()``
        (a micro-batch raised) say whether it still runs: a query that died shows as
        such before anyone calls ``stop()``."""
        if self.tags is None or self._poller is not None:
            return

        def run() -> None:
            while True:
                try:
                    active = bool(query.isActive)
                    bad = failed() or (not active and query.exception() is not None)
                    self.online(progress(), running=active, failed=bad)
                except Exception as ex:  # a status figure must never take the job down
                    log.debug("online metrics unavailable: %s", ex)
                if self._stop.wait(every):
                    return

        self._poller = threading.Thread(target=run, name="hybrid_iter-online-metrics", daemon=True)
        self._poller.start()

    def close(self, *, failed: bool, final: Callable[[], Any] | None = None) -> None:
        """The run ended: its last values, then it lingers (``HYBRID_ITER_METRICS_LINGER_S``)
        and is dropped."""
        if self.tags is None:
            return
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=30)
        if final is not None:
            try:
                self.online(final(), running=False, failed=failed)
            except Exception as ex:
                log.debug("online metrics unavailable: %s", ex)
        gauges = {"running": 0.0, "failed": 1.0 if failed else 0.0}
        _EXPORTER.update(self._key, self._series, gauges=gauges, end=self._linger)


def _meter(label: str, run: str, mode: str) -> RunMeter:
    if not metrics_enabled():
        return RunMeter(None)
    linger = linger_seconds()  # a bad value fails at the start, not at the end of a run
    import ray

    cluster = ray.get_runtime_context().gcs_address if ray.is_initialized() else ""
    return RunMeter({"iteration": label, "run": run, "mode": mode}, cluster, linger)


def bounded_meter(label: str, run: str, mode: str) -> RunMeter:
    """The meter of a bounded run (``mode``: sync, async, ssp); marks it running."""
    meter = _meter(label, run, mode)
    meter.set(running=1, failed=0, attempt=0)
    return meter


def online_meter(label: str, run: str, staleness: int | None) -> RunMeter:
    """The meter of an online query (``mode``: online_sync or online_async); its series
    start with the handle's first poll (``watch``) or micro-batch."""
    return _meter(label, run, "online_sync" if staleness == 0 else "online_async")


# -- Spark job descriptions ------------------------------------------------------------------


def bounded_description(
    label: str, mode: str, subtasks: int, attempt: int, round_: int | None = None
) -> str:
    """What the Spark UI lists for the jobs of a bounded run's barrier stage."""
    text = f"hybrid_iter {label}[{mode}]: barrier stage, {subtasks} subtasks, attempt {attempt}"
    return text if round_ is None else f"{text}, round {round_}"


def online_description(label: str, mode: str, batch_id: int) -> str:
    """What the Spark UI lists for the jobs of an online query's micro-batch."""
    return f"hybrid_iter online {label}[{mode}]: micro-batch {batch_id}"


def set_job_description(sc: Any, text: str | None) -> None:
    """The description of the Spark jobs this thread submits next (the Spark UI's job
    list, the REST API's ``description``); None: none."""
    sc.setJobDescription(text)


@contextmanager
def job_description(sc: Any, text: str) -> Iterator[None]:
    """``text`` for the jobs submitted inside the block; the thread's own description
    (Structured Streaming sets one per batch) afterwards."""
    before = sc.getLocalProperty("spark.job.description")
    set_job_description(sc, text)
    try:
        yield
    finally:
        set_job_description(sc, before)
