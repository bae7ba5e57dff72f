"""``Session.local`` whose Spark or Ray side fails to start, in a process of its own (the
suite's shared session already runs Spark and Ray in the test process)::

    PYTHONPATH=tests:. python -c "import session_start_job, sys; sys.exit(session_start_job.main('spark'))"

``main(side)`` makes that side fail while the other starts beside it and reports as one
JSON line (prefixed with ``RESULT ``): the error's type and text, whether Ray is still
initialised and a SparkContext still active, and this process's children still alive
afterwards (pid -> command name; zombies are gone already).
"""

from __future__ import annotations

import json
import os
import sys
import time

RESULT_PREFIX = "RESULT "


def children() -> dict[int, str]:
    """Live (non-zombie) descendants of this process: pid -> command name."""
    parent, names = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state != "Z":
            parent[int(entry)] = int(ppid)
            names[int(entry)] = stat[stat.index("(") + 1 : stat.rindex(")")]
    found = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    found.discard(os.getpid())
    return {pid: names[pid] for pid in found}


def main(side: str) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import ray
    from pyspark import SparkContext

    import hybrid_iter as hi

    kwargs: dict = {"parallelism": 1}
    if side == "spark":
        # the JVM starts, then the SparkContext fails (no event log directory): the JVM
        # must go too
        kwargs["spark_conf"] = {
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": "file:///nonexistent/hybrid_iter-event-log",
        }
    else:
        kwargs["object_store_memory"] = 1  # far below Ray's minimum: Ray refuses it
    report: dict = {}
    try:
        with hi.Session.local(**kwargs):
            report["error"] = None
    except Exception as ex:
        report["error"] = [type(ex).__name__, str(ex)]
    report["ray_initialized"] = ray.is_initialized()
    report["spark_active"] = SparkContext._active_spark_context is not None
    # processes a failed start ended may take a moment to exit (bounded)
    deadline = time.monotonic() + 60
    left = children()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)  # polling processes' exit, not synchronising with our code
        left = children()
    report["children"] = left
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
