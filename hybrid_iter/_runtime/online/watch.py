"""The driver's watch over an online iteration's micro-batches: a failure the
coordinator records (a callback raised, or a task's watchdog reported a stuck one)
cancels the Spark jobs of the micro-batch in progress, and that micro-batch raises
``IterationFailedError`` naming the partition, the micro-batch and the method."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spark_ops._spark_compat import JobTag

from ..._errors import IterationFailedError

__all__ = ["FailureWatch", "batch_failed", "recorded_failures"]


def batch_failed(batch_id: int, failures: list[Any]) -> IterationFailedError:
    """The error of micro-batch ``batch_id`` from the failures the coordinator recorded
    (the first is the cause; one per partition, or "coordinator")."""
    by_source: dict[int | str, BaseException] = {}
    for f in failures:
        by_source.setdefault(f.source, f)
    return IterationFailedError(
        f"the online iteration failed in micro-batch {batch_id}: {failures[0]}", by_source
    )


def recorded_failures(actor: Any) -> list[Any]:
    """The failures the coordinator recorded ([] when it cannot say: it is gone)."""
    import ray

    try:
        return list(ray.get(actor.online_state.remote(), timeout=30).failures)
    except Exception:
        return []


class FailureWatch:
    """The driver's watch over an online iteration's micro-batches: one daemon thread
    per iteration long-polls the coordinator (one call per 5 s, off every batch's path)
    and, as soon as a failure is recorded (a callback raised, or a task's watchdog
    reported a stuck one), cancels the Spark jobs of the micro-batch in progress (by
    their job tag), as the bounded path's monitor does: a task stuck in a callback never
    returns by itself. ``batch`` runs one micro-batch's Spark jobs under the tag."""

    def __init__(self, spark: Any, actor: Any, name: str) -> None:
        self._spark, self._actor = spark, actor
        self._lock = threading.Lock()
        self._tag: JobTag | None = None
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while True:
            try:
                # returns at a failure or after 5 s; raises once the coordinator is gone
                failed = ray.get(self._actor.wait_failure.remote(5.0), timeout=60)
            except Exception:
                return  # the iteration was stopped (or its coordinator died)
            if failed:
                with self._lock:
                    self._failed, tag = True, self._tag
                if tag is not None:
                    tag.cancel()
                return

    @contextmanager
    def batch(self, batch_id: int, tag_name: str) -> Iterator[None]:
        """Run micro-batch ``batch_id``'s Spark jobs (in ``foreachBatch``) under job tag
        ``tag_name``, which the watch cancels on a failure.

        When a job fails and the coordinator holds a failure (a task reported the
        callback that raised, or a ``CallTimeout``), raise ``IterationFailedError`` naming
        the partition, the micro-batch and the method; without one (an executor died,
        ...), Spark's own error goes on unchanged. After a failure no batch starts."""
        tag = JobTag(self._spark, tag_name)
        with self._lock:  # either the watch sees this tag, or this batch sees the failure
            self._tag, failed = tag, self._failed
        try:
            with tag.on_this_thread(f"hybrid_iter online micro-batch {batch_id}"):
                if failed:
                    failures = recorded_failures(self._actor)
                    if failures:
                        raise batch_failed(batch_id, failures) from failures[0]
                yield
        except IterationFailedError:
            raise
        except Exception:
            failures = recorded_failures(self._actor)
            if not failures:
                raise
            raise batch_failed(batch_id, failures) from failures[0]
        finally:
            with self._lock:
                self._tag = None
