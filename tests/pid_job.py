"""A job that starts no JVM and no Ray, for the tests of ``fresh_process.py`` itself:
``main("pid")`` reports its process id; ``main("wait")`` waits until its stdin closes
(a job that runs until it is ended)."""

from __future__ import annotations

import json
import os
import sys


def main(case: str) -> int:
    if case == "wait":
        sys.stdin.read()
    print("RESULT " + json.dumps({"pid": os.getpid(), "case": case}), flush=True)
    return 0
