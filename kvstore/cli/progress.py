"""A minimal progress bar on stderr (no dependency): redrawn in place on a terminal,
printed once at the end otherwise, so logs stay readable."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, unit: str = "") -> None:
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.done = 0
        self.start = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._last = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self._tty and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            self._draw(end="")

    def _draw(self, end: str) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r{self.label:<28} [{bar:<30}] {self.done}/{self.total}{self.unit} "
                         f"{elapsed:5.1f}s{end}")
        sys.stderr.flush()

    def close(self) -> None:
        self._draw(end="\n")
