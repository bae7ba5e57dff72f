"""What a failed Spark job says about its Python workers: did one die under a task?

Runs on the driver, on the error a Spark action raised. A Python worker that dies
(SIGKILL, the kernel's out-of-memory killer, a container limit, a crash in native code)
reaches the driver as a wall of JVM trace whose wording depends on the Spark version and
on when the worker died:

* reading its output: ``SparkException: Python worker exited unexpectedly (crashed)``
  (Spark 3.5 and 4.x; 4.x may add advice, or ``: Fatal Python error: Segmentation
  fault ...`` when the fault handler is on), caused by an ``EOFException``;
* writing its input (the JVM's writer thread): the socket's own error,
  ``java.net.SocketException: Connection reset`` or ``Broken pipe``, or a bare
  ``java.io.EOFException``, from frames of ``org.apache.spark.api.python``;
* a worker Spark's kill monitor stopped after it went back to the idle pool (a race of
  Spark 3.5 after a cancelled job), handed to the next task:
  ``java.net.SocketException: Socket is closed`` in ``BasePythonRunner.compute``.

The failed task is named in the job's message: ``barrier task ResultTask(stage,
partition)`` for a barrier stage, ``Lost task p.a in stage ...`` otherwise (for the
result stages hybrid_iter runs, the task index is the partition id). A Python exception
raised by user code (``PythonException: Traceback ...``) is never a death, whatever its
text says. ``python_worker_death`` is pure: it reads text and returns what it found. Text
because nothing else says it: PySpark raises a worker's death as the same exception type
as any other failed job, and a Connect client gets only the server's message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["WorkerDeath", "python_worker_death"]


@dataclass(frozen=True)
class WorkerDeath:
    """A Spark Python worker died under a task: the task's ``partition`` (None when
    Spark did not name it), Spark's one-line ``report`` and the ``signal`` (``"SIGSEGV"``,
    ...) or ``exit_code`` when Spark's report gives one."""

    partition: int | None
    report: str
    signal: str | None = None
    exit_code: int | None = None


_BARRIER = re.compile(
    r"barrier task (?:Result|ShuffleMap)Task\(\d+, (?P<part>\d+)\) finished unsuccessfully\.?"
    r"[ \t]*\r?\n(?P<reason>[^\n]*)"
)
_LOST = re.compile(r"Lost task (?P<part>\d+)\.\d+ in stage [\d.]+ \(TID \d+\)(?: \([^)]*\))?: ")
_CRASHED = "Python worker exited unexpectedly"
#: what the JVM's side of a worker's socket says once the process is gone
_SOCKET = re.compile(
    r"^(?:java\.io\.EOFException\s*$"
    r"|(?:java\.net\.SocketException|java\.io\.IOException)"
    r": (?:Connection reset(?: by peer)?|Broken pipe|Socket (?:is )?closed|Stream closed)\b)"
)
#: where a reason's own stack ends and the driver's begins
_DRIVER_SIDE = re.compile(r"\n\s*(?:Driver stacktrace:|at org\.apache\.spark\.scheduler\.DAG)")
_FATAL = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
_FATAL_RE = re.compile(r"Fatal Python error: (" + "|".join(map(re.escape, _FATAL)) + ")")
_EXIT_RE = re.compile(r"exit(?:ed with)? (?:code|status)[ :=]+(-?\d+)", re.IGNORECASE)
_SIGNAL_RE = re.compile(
    r"killed by signal (\d+)|\b(SIG(?:KILL|TERM|SEGV|ABRT|BUS|FPE|ILL|INT|HUP|PIPE|XCPU|XFSZ))\b"
)


def _reason(text: str) -> tuple[int | None, str, str] | None:
    """``(partition, reason line, the reason's block)`` of the failed task, if named."""
    m = _BARRIER.search(text)
    if m is not None:
        start, reason = m.start("reason"), m.group("reason")
        part = int(m.group("part"))
    else:
        lost = _LOST.search(text)
        if lost is None:
            return None
        start = lost.end()
        reason = text[start:].split("\n", 1)[0]
        part = int(lost.group("part"))
    end = _DRIVER_SIDE.search(text, start)
    return part, reason.strip(), text[start : end.start() if end else len(text)]


def _report(line: str) -> str:
    """Spark's words without the exception class, at most one sentence of advice."""
    line = re.sub(r"^(?:[\w$]+\.)+[\w$]+(?:Exception|Error): ", "", line.strip())
    return line.split(" Consider setting ", 1)[0].rstrip(". ") or line


def _signal_and_code(block: str) -> tuple[str | None, int | None]:
    fatal = _FATAL_RE.search(block)
    signal = _FATAL[fatal.group(1)] if fatal else None
    if signal is None:
        m = _SIGNAL_RE.search(block)
        if m is not None and m.group(2):
            signal = m.group(2)
        elif m is not None and m.group(1):
            signal = f"signal {m.group(1)}"
    code = _EXIT_RE.search(block)
    return signal, int(code.group(1)) if code else None


def python_worker_death(error: BaseException | str) -> WorkerDeath | None:
    """The Python worker death a failed Spark action reports, or None (another
    failure: user code raised, an executor was lost, the job was cancelled, ...)."""
    text = error if isinstance(error, str) else spark_error_text(error)
    found = _reason(text)
    if found is None:
        # a message that names no task (a streaming batch, another Spark version):
        # only Spark's own sentence counts, never a socket error of unknown origin
        at = text.find(f"SparkException: {_CRASHED}")
        if at < 0 or "PythonException: Traceback" in text[:at]:
            return None
        line = text[at + len("SparkException: ") :].split("\n", 1)[0]
        signal, code = _signal_and_code(text[at:])
        return WorkerDeath(None, _report(line), signal, code)
    part, reason, block = found
    if "PythonException" in reason.split(":", 1)[0]:
        return None  # user code raised: its own traceback, not a death
    if _CRASHED in reason:
        signal, code = _signal_and_code(block)
        return WorkerDeath(part, _report(reason), signal, code)
    if _SOCKET.match(reason) and ("spark.api.python" in block or "execution.python" in block):
        return WorkerDeath(part, reason)
    return None


def spark_error_text(error: BaseException) -> str:
    """All the text a Spark error carries: the message with the JVM's stack trace
    (``Py4JJavaError``), or pyspark's description and trace (its captured exceptions)."""
    parts = []
    try:
        parts.append(str(error))
    except Exception:  # a Py4JJavaError whose gateway is gone
        parts.append(repr(error))
    for attr in ("desc", "stackTrace"):
        value = getattr(error, attr, None)
        if isinstance(value, str) and value not in parts[0]:
            parts.append(value)
    return "\n".join(parts)
