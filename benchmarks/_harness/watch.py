"""Process watchers: the CPU seconds and memory of a process tree (or of given pids)
over a run, read from Linux's /proc.

* ``rss(pid)``, ``peak_rss(pid)``: a process's resident memory now and its high-water
  mark (VmRSS, VmHWM; bytes, 0 for a process that is gone); ``"self"`` for this one;
* ``reset_peak(pid)``: the high-water mark starts again from the memory now (False where
  the kernel does not let this process reset it);
* ``tree(root)``: ``root`` and every process under it (children of any of its threads),
  each with its CPU seconds so far;
* ``role(pid, driver)``: what a process is in a hybrid_iter run (``driver``, ``spark_jvm``,
  ``spark_python``, ``ps_shards``, ``ray_actors``, ``ray_idle``, ``ray_system``,
  ``other``; ``gone`` for a process that exited);
* ``Watch``: a context manager sampling them every ``interval`` seconds over a run.

A process's peak is its high-water mark, reset when the watch starts, so a peak between
two samples is not missed; a process the kernel does not let us reset counts its sampled
memory instead (a floor). A process born during the watch counts from its birth.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from .timing import slope

__all__ = [
    "Sample",
    "Watch",
    "peak_rss",
    "reset_peak",
    "role",
    "rss",
    "tree",
]

_TICK = os.sysconf("SC_CLK_TCK")
MB = 2**20


def _status(pid: int | str, fields: Sequence[str]) -> dict[str, int]:
    """Fields of /proc/<pid>/status in bytes (absent ones 0)."""
    out = dict.fromkeys(fields, 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in out:
                    out[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def rss(pid: int | str = "self") -> int:
    return _status(pid, ("VmRSS",))["VmRSS"]


def peak_rss(pid: int | str = "self") -> int:
    return _status(pid, ("VmHWM",))["VmHWM"]


def reset_peak(pid: int | str = "self") -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the RSS now
        return True
    except OSError:
        return False


def _stat(pid: int) -> tuple[int, float] | None:
    """Parent pid and CPU seconds (user + system, all threads) of a process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None


def tree(root: int | None = None) -> dict[int, float]:
    """``root`` (default: this process) and every process under it: CPU seconds of each."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = _stat(int(name))
            if got is not None:
                children.setdefault(got[0], []).append(int(name))
                cpu[int(name)] = got[1]
    out, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in cpu:
            out[pid] = cpu[pid]
        stack.extend(children.get(pid, []))
    return out


def _cpu_of(pids: Iterable[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        got = _stat(pid)
        if got is not None:
            out[pid] = got[1]
    return out


def role(pid: int, driver: int | None = None) -> str:
    """What ``pid`` is in a run whose driver is ``driver`` (default: this process)."""
    if pid == (os.getpid() if driver is None else driver):
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "gone"
    if not cmd:
        return "gone"  # a zombie: its role was seen while it ran
    argv0 = cmd.split(b"\0", 1)[0]
    if argv0.endswith(b"java"):
        return "spark_jvm"
    if b"pyspark" in cmd or b"hybrid_iter._runtime.worker_daemon" in cmd:
        return "spark_python"  # forked by PySpark's daemon or by Session.local's
    if cmd.startswith(b"ray::"):
        name = argv0[5:]
        if b"Shard" in name:
            return "ps_shards"
        return "ray_idle" if name.startswith(b"IDLE") else "ray_actors"
    if b"default_worker.py" in cmd:
        return "ray_idle"
    return "ray_system" if b"ray" in cmd or b"gcs_server" in cmd else "other"


def _role_entry() -> dict[str, Any]:
    return {
        "cpu_s": 0.0,
        "processes": 0,
        "peak_rss_mb": 0.0,
        "sum_peak_rss_mb": 0.0,
        "start_rss_mb": 0.0,
    }


class Sample:
    """One look: seconds since the watch started, the RSS of each process watched."""

    def __init__(self, t: float) -> None:
        self.t = t
        self.rss: dict[int, int] = {}


class Watch:
    """CPU seconds and peak memory of the processes of a run, sampled every ``interval``
    seconds from a thread while the block runs (and once at its start and end).

    What is watched: ``root`` (default: this process) and every process under it, found
    again at each sample; or exactly ``pids``; either narrowed to ``roles`` (e.g.
    ``{"spark_python"}``). ``pause``/``resume`` leave a stretch out of the CPU seconds
    (e.g. evaluation). After the block: ``report()`` per role, ``peak_one()`` the largest
    peak of one process, ``samples`` and ``rss_slope()`` the memory over time.
    """

    def __init__(
        self,
        root: int | None = None,
        *,
        pids: Iterable[int] | None = None,
        roles: Collection[str] | None = None,
        interval: float = 0.5,
    ) -> None:
        if root is not None and pids is not None:
            raise ValueError("Watch: a root or pids, not both")
        if interval <= 0:
            raise ValueError(f"Watch: interval > 0 seconds, got {interval}")
        self.root = os.getpid() if root is None and pids is None else root
        self.pids = None if pids is None else list(pids)
        self.wanted = None if roles is None else set(roles)
        self.interval = interval
        self.cpu: dict[int, float] = {}
        self.roles: dict[int, str] = {}
        self.peak: dict[int, int] = {}
        self.start: dict[int, int] = {}
        self.samples: list[Sample] = []
        self.active = False
        self._base: dict[int, float] = {}
        self._floor_only: set[int] = set()  # processes whose high-water mark was not reset
        self._t0 = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _scope(self) -> dict[int, float]:
        return tree(self.root) if self.pids is None else _cpu_of(self.pids)

    def _role(self, pid: int) -> str:
        return role(pid, self.root if self.root is not None else os.getpid())

    def _watched(self, pid: int) -> bool:
        """Whether ``pid`` is of the roles watched (its role noted: an idle Ray worker may
        become an actor; a zombie keeps the role it was seen with)."""
        seen = self._role(pid)
        if seen != "gone" and (seen != "ray_idle" or pid not in self.roles):
            self.roles[pid] = seen
        return self.wanted is None or self.roles.get(pid) in self.wanted

    def sample(self) -> Sample:
        """Look now: every watched process's CPU, role and memory."""
        scope = self._scope()
        now = Sample(time.perf_counter() - self._t0)
        with self._lock:
            for pid, cpu in scope.items():
                if not self._watched(pid):
                    continue
                if pid not in self._base:
                    # born while active: all its CPU is the run's
                    self._base[pid] = cpu if not self.active else 0.0
                    self.cpu.setdefault(pid, 0.0)
                if self.active:
                    self.cpu[pid] += cpu - self._base[pid]
                self._base[pid] = cpu
                mem = _status(pid, ("VmRSS", "VmHWM"))
                top = mem["VmRSS"] if pid in self._floor_only else mem["VmHWM"]
                self.peak[pid] = max(self.peak.get(pid, 0), top, mem["VmRSS"])
                now.rss[pid] = mem["VmRSS"]
            self.samples.append(now)
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> Watch:
        self._t0 = time.perf_counter()
        for pid in self._scope():
            if self._watched(pid):
                self.start[pid] = rss(pid)
                if not reset_peak(pid):
                    self._floor_only.add(pid)
        self.sample()
        self.active = True
        self._thread.start()
        return self

    def pause(self) -> None:
        self.sample()
        self.active = False

    def resume(self) -> None:
        self.sample()
        self.active = True

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.active = False

    def peak_one(self, roles: Collection[str] | None = None) -> int:
        """The largest peak (bytes) of one process watched (of ``roles`` if given)."""
        return max(
            (p for pid, p in self.peak.items() if roles is None or self.roles.get(pid) in roles),
            default=0,
        )

    def rss_slope(self, pids: Collection[int] | None = None) -> float | None:
        """Bytes per second the summed RSS of ``pids`` (default: all watched) grew by over
        the samples (least squares); None with fewer than two samples apart in time."""
        xs = [s.t for s in self.samples]
        if len(set(xs)) < 2:
            return None
        ys = [sum(v for p, v in s.rss.items() if pids is None or p in pids) for s in self.samples]
        return slope(xs, ys)

    def report(
        self,
        own_cpu: Mapping[str, Sequence[float]] | None = None,
        own_cpu_from: str = "the processes' own counters",
    ) -> dict[str, Any]:
        """Per role: CPU seconds (summed), processes, the largest peak RSS of one of them
        (MB) and the sum of their peaks, their RSS at the start; a role's CPU from
        ``own_cpu`` (the processes' own counters, e.g. an actor's) where given. Idle Ray
        workers that did not work are left out."""
        out: dict[str, dict[str, Any]] = {}
        for pid, name in self.roles.items():
            if pid not in self.peak:
                continue  # seen, but not of the roles watched
            if name == "ray_idle" and self.cpu.get(pid, 0.0) < 0.05:
                continue
            r = out.setdefault(name, _role_entry())
            r["cpu_s"] += self.cpu.get(pid, 0.0)
            r["processes"] += 1
            mb = self.peak[pid] / MB
            r["peak_rss_mb"] = max(r["peak_rss_mb"], mb)
            r["sum_peak_rss_mb"] += mb
            r["start_rss_mb"] += self.start.get(pid, 0) / MB
        for name, cpus in (own_cpu or {}).items():
            r = out.setdefault(name, _role_entry())
            r["cpu_s"] = float(sum(cpus))
            r["processes"] = max(r["processes"], len(cpus))
            r["cpu_from"] = own_cpu_from
        for r in out.values():
            for k in ("cpu_s", "peak_rss_mb", "sum_peak_rss_mb", "start_rss_mb"):
                r[k] = round(r[k], 2)
        total = sum(r["cpu_s"] for r in out.values())
        return {"total_cpu_s": round(total, 2), "by_role": out}
