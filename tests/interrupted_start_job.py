"""``Session.local`` interrupted by SIGINT while its main thread waits for Spark's start,
in a process of its own (``tests/hybrid_iter/session/test_session_start.py``)::

    PYTHONPATH=tests:. python -c "import interrupted_start_job as j, sys; sys.exit(j.main(MARKS))"

``MARKS`` is a folder. The test holds the JVM's launch (the ``spark-env.sh`` of its
``SPARK_CONF_DIR`` writes ``MARKS/jvm`` and waits for ``MARKS/go``, which never comes:
the interrupted start has to end the launch itself). A thread of this job writes
``MARKS/waiting`` once the main thread waits for Spark's start (seen in its frames); the
test then sends SIGINT. When the KeyboardInterrupt reaches this job, it prints one JSON
line (``RESULT ``: its live descendants at that moment, and its threads) and raises it
again: the interpreter exits as it does on an uncaught KeyboardInterrupt.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

from session_start_job import RESULT_PREFIX, children

#: where the main thread waits for Spark's start
WAITS = {"SparkStart.result", "SparkStart.wait"}


def _says_when_waiting(main: int, marks: Path) -> None:
    while True:
        frame = sys._current_frames().get(main)
        if frame is None:
            return
        names = set()
        while frame is not None:
            names.add(frame.f_code.co_qualname)
            frame = frame.f_back
        if names & WAITS:
            (marks / "waiting").write_text("")
            return
        time.sleep(0.01)  # polling the main thread's frames, not synchronising with it


def main(marks: str) -> int:
    # a user's terminal interrupts a process whose SIGINT handler is Python's; a process
    # started from a background job of a non-interactive shell (CI) inherits SIGINT
    # ignored, and then Python installs no handler and the signal never arrives
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import hybrid_iter as hi

    watcher = threading.Thread(
        target=_says_when_waiting, args=(threading.get_ident(), Path(marks)), daemon=True
    )
    watcher.start()
    try:
        hi.Session.local(1, warm_up=False)
    except KeyboardInterrupt:
        report = {
            "children": children(),
            "threads": sorted(t.name for t in threading.enumerate() if t is not watcher),
        }
        print(RESULT_PREFIX + json.dumps(report), flush=True)
        raise
    print(RESULT_PREFIX + json.dumps({"error": "the start was not interrupted"}), flush=True)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
