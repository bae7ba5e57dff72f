"""A live progress line on the driver: epoch, loss, seconds per epoch, rows per second
and, when subtasks run apart (async, bounded staleness), the slowest and fastest; for an
online iteration the micro-batch, its round, loss and seconds."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from coordinator import OnlineStatus, Progress

__all__ = ["ProgressPrinter", "rows_per_second"]


def rows_per_second(p: Progress) -> float | None:
    """Rows of one pass over the data per second of the last global epoch (None until
    both are known)."""
    if p.rows and p.last_epoch_seconds:
        return p.rows / p.last_epoch_seconds
    return None


class ProgressPrinter:
    """Rewrites one line on a terminal; elsewhere prints at most one line per second."""

    def __init__(self, enabled: bool | None, *, label: str, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = tty if enabled is None else enabled
        self.tty = tty
        self.label = label
        self._start = time.perf_counter()
        self._last_print = 0.0
        self._last_key: tuple[int, tuple[int, ...]] | None = None
        self._width = 0

    @staticmethod
    def _fmt_loss(loss: Any) -> str:
        try:
            return f"{float(loss):.6g}"
        except (TypeError, ValueError):
            return "-"

    @staticmethod
    def _fmt_rate(rows_per_second: float) -> str:
        for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
            if rows_per_second >= scale:
                return f"{rows_per_second / scale:.1f}{unit} rows/s"
        return f"{rows_per_second:.0f} rows/s"

    def _line(self, p: Progress) -> str:
        spe = (
            f"{p.last_epoch_seconds * 1000:.1f} ms/epoch" if p.last_epoch_seconds else "- ms/epoch"
        )
        if isinstance(p.loss, Mapping):  # several figures (hybrid_iter.ps: loss, metrics, shards)
            shown = "  ".join(f"{k} {self._fmt_loss(v)}" for k, v in p.loss.items())
            line = f"[{self.label}] epoch {p.epochs:>5}  {shown}  {spe:>16}"
        else:
            line = (
                f"[{self.label}] epoch {p.epochs:>5}  loss {self._fmt_loss(p.loss):>12}  {spe:>16}"
            )
        rate = rows_per_second(p)
        if rate is not None:
            line += f"  {self._fmt_rate(rate):>14}"
        subtasks = p.subtask_epochs
        if subtasks and max(subtasks) != min(subtasks):
            slow = subtasks.index(min(subtasks))
            fast = subtasks.index(max(subtasks))
            line += (
                f"  subtask epochs {min(subtasks)}..{max(subtasks)} "
                f"(slowest p{slow}, fastest p{fast})"
            )
        return line + f"  elapsed {time.perf_counter() - self._start:6.1f}s"

    def update(self, p: Progress, *, final: bool = False) -> None:
        # async: the subtasks' own epochs move between global alignments
        if self._due((p.epochs, p.subtask_epochs), final):
            line = self._line(p)
            if final:
                line += f"  done: {p.terminated_by or ('failed' if p.failed else '?')}"
            self._write(line, final)

    def update_online(self, s: OnlineStatus, batch_seconds: float) -> None:
        """An online iteration committed micro-batch ``s.committed`` in ``batch_seconds``."""
        if self._due((s.batches, ()), False):
            line = (
                f"[{self.label}] micro-batch {s.committed:>6}  round {s.round:>6}  "
                f"loss {self._fmt_loss(s.last_loss):>12}  {batch_seconds * 1000:>10.1f} ms/batch"
            )
            if s.rows_per_s:
                line += f"  {self._fmt_rate(s.rows_per_s):>14}"
            self._write(line + f"  elapsed {time.perf_counter() - self._start:6.1f}s", False)

    def _due(self, key: tuple[int, tuple[int, ...]], final: bool) -> bool:
        if not self.enabled or (key == self._last_key and not final):
            return False
        now = time.perf_counter()
        if not final and not self.tty and now - self._last_print < 1.0:
            return False
        self._last_key = key
        self._last_print = now
        return True

    def _write(self, line: str, final: bool) -> None:
        if self.tty:
            pad = max(self._width - len(line), 0)
            self.stream.write("\r" + line + " " * pad + ("\n" if final else ""))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
