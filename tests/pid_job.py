"""A job that starts no JVM and no Ray, for the tests of ``fresh_process.py`` itself:
``main("pid")`` reports its process id; ``main("wait")`` waits for a signal (a job that
runs until it is ended, whatever its stdin is)."""

from __future__ import annotations

import json
import os
import signal


def main(case: str) -> int:
    if case == "wait":
        signal.pause()
    print("RESULT " + json.dumps({"pid": os.getpid(), "case": case}), flush=True)
    return 0
