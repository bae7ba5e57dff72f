"""A live progress line on the driver: epoch, loss, seconds per epoch."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from coordinator import Progress

__all__ = ["ProgressPrinter"]


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
        self._last_epoch = -1
        self._width = 0

    @staticmethod
    def _fmt_loss(loss: Any) -> str:
        try:
            return f"{float(loss):.6g}"
        except (TypeError, ValueError):
            return "-"

    def _line(self, p: Progress) -> str:
        spe = (
            f"{p.last_epoch_seconds * 1000:.1f} ms/epoch" if p.last_epoch_seconds else "- ms/epoch"
        )
        return (
            f"[{self.label}] epoch {p.epochs:>5}  loss {self._fmt_loss(p.loss):>12}  {spe:>16}  "
            f"elapsed {time.perf_counter() - self._start:6.1f}s"
        )

    def update(self, p: Progress, *, final: bool = False) -> None:
        if not self.enabled or (p.epochs == self._last_epoch and not final):
            return
        now = time.perf_counter()
        if not final and not self.tty and now - self._last_print < 1.0:
            return
        self._last_epoch = p.epochs
        self._last_print = now
        line = self._line(p)
        if final:
            line += f"  done: {p.terminated_by or ('failed' if p.failed else '?')}"
        if self.tty:
            pad = max(self._width - len(line), 0)
            self.stream.write("\r" + line + " " * pad + ("\n" if final else ""))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
