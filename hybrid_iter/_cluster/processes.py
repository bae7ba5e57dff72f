"""This driver's processes: what Spark's Python workers need in the environment, whether a
process is alive, and the Ray processes a failed start leaves behind. Runs on the driver.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

__all__ = ["alive", "end_ray_processes_left_by_a_failed_start", "prepare_process_env"]


def end_ray_processes_left_by_a_failed_start() -> None:
    """``ray.init`` that fails midway (e.g. after starting the GCS) keeps no handle to
    what it started, so ``ray.shutdown`` cannot end it: end this process's descendants
    that run Ray's own programs (found by the Ray package's path in their command line;
    Spark's JVM, started beside it, does not match), SIGTERM then SIGKILL."""
    import signal

    import ray

    ray_dir = os.path.dirname(os.path.abspath(ray.__file__))
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    mine = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    mine.discard(os.getpid())
    doomed = []
    for pid in mine:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ray_dir in cmdline:
            doomed.append(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while doomed and time.monotonic() < deadline:
            doomed = [p for p in doomed if alive(p)]
            if doomed:
                time.sleep(0.05)  # polling the processes' exit, bounded
        if not doomed:
            return


def alive(pid: int) -> bool:
    """``pid`` is running (a zombie is reaped here if it is our child)."""
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def prepare_process_env() -> None:
    """Spark's Python workers must run this interpreter and stay on loopback."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
