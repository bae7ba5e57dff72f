"""A measurement in a fresh process: ``run_worker(cmd, tag)`` runs ``cmd`` and returns
the JSON of the one line it printed as ``<tag> <json>`` (its own Spark, Ray and
imports: nothing a previous measurement loaded is counted). A worker that exits
non-zero, prints no such line or more than one raises ``WorkerFailed`` with its exit
status and the end of its stderr."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["WorkerFailed", "run_worker"]


class WorkerFailed(RuntimeError):
    """A worker process failed: its exit status and the end of its stderr are said."""


def run_worker(
    cmd: Sequence[str],
    tag: str,
    *,
    what: str,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 3600,
    new_session: bool = False,
    stderr_tail: int = 6000,
) -> Any:
    """Run ``cmd``; the JSON after ``tag`` on its one tagged stdout line.
    ``new_session``: in a session of its own (what it starts can be killed as a group)."""
    # here, not at the top: a fresh process that imports the harness times its own imports
    import subprocess

    proc = subprocess.run(
        list(cmd),
        env=None if env is None else dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=new_session,
        check=False,
    )
    prefix = tag + " "
    lines = [x for x in proc.stdout.splitlines() if x.startswith(prefix)]
    if proc.returncode != 0 or len(lines) != 1:
        raise WorkerFailed(
            f"{what} failed (exit {proc.returncode}, {len(lines)} {tag} line(s)):\n"
            f"{proc.stderr[-stderr_tail:]}"
        )
    return json.loads(lines[0][len(prefix) :])
