"""This driver's processes: what Spark's Python workers need in the environment, and what
a ``Session.local`` start that failed or was interrupted midway leaves behind:
``ray.init`` keeps no handle to the processes it started, so ``ray.shutdown`` cannot end
them; PySpark's JVM launch keeps its process to itself until the JVM's port comes. Runs
on the driver.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable

import storage_uri

__all__ = [
    "end_ray_processes_of_a_failed_start",
    "end_spark_jvm_launch",
    "prepare_process_env",
    "start_own_ray",
]


def _processes() -> tuple[dict[int, int], dict[int, int], set[int]]:
    """Every process: its parent and its process group; and which are zombies (a child
    that died, until reaped, is still one's child)."""
    parent: dict[int, int] = {}
    group: dict[int, int] = {}
    zombies: set[int] = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            state, ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
            parent[int(entry)], group[int(entry)] = int(ppid), int(pgrp)
            if state == "Z":
                zombies.add(int(entry))
    return parent, group, zombies


def _below(parent: dict[int, int], roots: set[int]) -> set[int]:
    """The descendants of ``roots``."""
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found - roots


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ray_processes_of_this_one(ray_dir: str) -> set[int]:
    """The live Ray processes this process started: its descendants that run Ray's own
    programs (the Ray package's path in their command line, or a ``ray::...`` title;
    Spark's JVM, started beside them, matches neither) and what those started. A raylet
    that died leaves its agents to init, out of this tree: those of this process group
    that name a raylet of this tree (``RAY_RAYLET_PID`` in their environment) count
    too."""
    parent, group, zombies = _processes()

    def runs_ray(pid: int) -> bool:
        cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
        return ray_dir in cmdline or cmdline.startswith("ray::")

    def raylet_of(pid: int) -> int | None:
        for var in _read(f"/proc/{pid}/environ").split(b"\0"):
            if var.startswith(b"RAY_RAYLET_PID="):
                with contextlib.suppress(ValueError):
                    return int(var[len(b"RAY_RAYLET_PID=") :])
        return None

    mine = _below(parent, {os.getpid()})  # the dead too: a raylet not reaped yet
    found = {p for p in mine - zombies if runs_ray(p)}
    found |= {
        p
        for p, g in group.items()
        if g == os.getpgrp() and p not in mine | zombies and runs_ray(p) and raylet_of(p) in mine
    }
    return found | (_below(parent, found) - zombies)


def end_spark_jvm_launch() -> None:
    """SIGKILL the Spark JVM PySpark is launching for this process, and what it started
    (spark-submit's scripts): the launch, which waits for the JVM's port or its exit,
    then fails at once. The launch marks its child's environment with
    ``_PYSPARK_DRIVER_CONN_INFO_PATH`` (pyspark.java_gateway): only a JVM launched by
    this process has it (one per process)."""
    parent, _, zombies = _processes()
    me = os.getpid()
    launched = {
        pid
        for pid, ppid in parent.items()
        if ppid == me
        and b"\0_PYSPARK_DRIVER_CONN_INFO_PATH=" in b"\0" + _read(f"/proc/{pid}/environ")
    }
    for pid in (launched | _below(parent, launched)) - zombies:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_own_ray(
    start: Callable[[], None],
    *,
    once_more: bool = True,
    before_retry: Callable[[], None] | None = None,
) -> None:
    """``start`` (a ``ray.init`` of an instance of this process's own); when it fails,
    what it started is ended (``end_ray_processes_of_a_failed_start``) and, with
    ``once_more``, it is tried once more after ``before_retry``. Ray waits a fixed 30 s
    for its raylet to register, which a loaded machine can exceed, and says so only in
    its message: any failure is tried once more (a setting Ray refuses fails again at
    once). What the last try raised is raised, with its processes ended too."""
    import ray

    try:
        start()
        return
    except Exception:
        end_ray_processes_of_a_failed_start(ray.shutdown)
        if not once_more:
            raise
    if before_retry is not None:
        before_retry()
    try:
        start()
    except Exception:
        end_ray_processes_of_a_failed_start(ray.shutdown)
        raise


def end_ray_processes_of_a_failed_start(
    before_shutdown: Callable[[], None] | None = None,
) -> None:
    """``ray.init`` that fails midway (e.g. after starting the GCS, or interrupted) keeps
    no handle to what it started, so ``ray.shutdown`` cannot end it: end the Ray
    processes of this one (``_ray_processes_of_this_one``). Those found before
    ``before_shutdown`` (``ray.shutdown``, which may end a raylet and orphan its agents)
    and after it; each is stopped (SIGSTOP) before the next look, so that none starts
    another unseen, then SIGTERM (and SIGCONT), then SIGKILL."""
    import ray

    ray_dir = os.path.dirname(os.path.abspath(ray.__file__))
    doomed = _ray_processes_of_this_one(ray_dir)
    if before_shutdown is not None:
        before_shutdown()
    new = doomed | _ray_processes_of_this_one(ray_dir)
    while new:
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        doomed |= new
        new = _ray_processes_of_this_one(ray_dir) - doomed
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while doomed and time.monotonic() < deadline:
            doomed = {p for p in doomed if _running_unreaped(p)}
            if doomed:
                time.sleep(0.05)  # polling the processes' exit, bounded
        if not doomed:
            return


def _running_unreaped(pid: int) -> bool:
    """``storage_uri.process_running(pid)``, after reaping ``pid`` if it is a child of
    this process that exited (else it would stay a zombie as long as this process runs)."""
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    return storage_uri.process_running(pid)


def prepare_process_env() -> None:
    """Spark's Python workers must run this interpreter and stay on loopback."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
