"""Recovery at start: the coordinator's restored state held against Spark's commit log
of the query. A micro-batch Spark committed (so it will not run it again) whose update
the restored state lacks is lost; ``on_corrupt_checkpoint`` says whether that fails the
start (``OnlineCheckpointError`` naming the batches and the choices) or is accepted."""

from __future__ import annotations

import logging

from coordinator import OnlineStatus

from ..._errors import OnlineCheckpointError
from .storage import filesystem

__all__ = ["at_risk", "checkpoint_error", "reconcile", "spark_last_commit"]

log = logging.getLogger("hybrid_iter")


def reconcile(location: str, state: OnlineStatus, on_corrupt: str, label: str) -> tuple[int, ...]:
    """The batch ids lost between Spark's commit log under ``location`` and the restored
    ``state``: raises ``OnlineCheckpointError`` when there are some and ``on_corrupt`` is
    ``"fail"``; logs them when it is ``"reset"``."""
    spark_last = spark_last_commit(location)
    lost = at_risk(state, spark_last)
    if lost and on_corrupt == "fail":
        raise checkpoint_error(location, state, lost, spark_last)
    if lost:
        log.warning(
            "online iteration %s: on_corrupt_checkpoint='reset': micro-batches %s are "
            "lost (Spark committed them; the restored state is after batch %d)",
            label,
            list(lost),
            state.committed,
        )
    return lost


def spark_last_commit(location: str) -> int | None:
    """The last batch id in Spark's commit log of the query (None: none, or unreadable)."""
    import pyarrow.fs as pafs

    try:
        fs, base = filesystem(location)
        infos = fs.get_file_info(
            pafs.FileSelector(f"{base.rstrip('/')}/commits", allow_not_found=True)
        )
    except Exception as ex:
        log.warning("could not read Spark's commit log under %s: %s", location, ex)
        return None
    ids = [int(i.base_name) for i in infos if i.base_name.isdigit()]
    return max(ids) if ids else None


def at_risk(state: OnlineStatus, spark_last: int | None) -> tuple[int, ...]:
    """Batch ids Spark will not run again whose update the restored state lacks."""
    committed = state.committed
    if spark_last is not None:
        return tuple(range(committed + 1, spark_last + 1))
    # no commit log to hold against: anything newer on disk than what was restored
    restore = state.restore
    damaged = bool(restore.skipped or restore.unusable)
    return tuple(range(committed + 1, restore.newest_on_disk + 1)) if damaged else ()


def checkpoint_error(
    location: str, state: OnlineStatus, at_risk: tuple[int, ...], spark_last: int | None
) -> OnlineCheckpointError:
    restore = state.restore
    problems = [f"{p}: {why}" for p, why in restore.skipped]
    problems += [f"journal of batch {b}: {why}" for b, why in restore.unusable]
    committed = state.committed
    base = f"the state after batch {committed}" if committed >= 0 else "the initial variables"
    ids = ", ".join(map(str, at_risk[:20])) + (" ..." if len(at_risk) > 20 else "")
    log_note = (
        f"Spark's commit log under {location}/commits ends at batch {spark_last}"
        if spark_last is not None
        else "files newer than the restored state are damaged"
    )
    return OnlineCheckpointError(
        f"the online checkpoint under {location}/hybrid_iter cannot restore micro-batches "
        f"[{ids}] ({len(at_risk)} batch(es)): {log_note}, but the newest state that could "
        f"be restored is {base}"
        + (f" ({'; '.join(problems)})" if problems else " (the files are missing)")
        + ". Continuing would skip them silently. Choose: put the files back (e.g. from a "
        "backup) and restart; or accept the loss with OnlineConfig("
        "on_corrupt_checkpoint='reset'), which continues from "
        + base
        + " and reports the lost ids in progress.lost_batches; or start over with a new "
        "checkpoint_location.",
        at_risk,
    )
