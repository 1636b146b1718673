"""A minimal progress bar on stderr (no dependency): redrawn in place on a terminal,
printed once at the end otherwise, so logs stay readable."""

from __future__ import annotations

import sys
import time

from kvstore.tools.cli.units import human_bytes


class Progress:
    """``unit=" sessions"`` counts things; ``unit="bytes"`` prints sizes in human units."""

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

    def _amount(self) -> str:
        if self.unit == "bytes":
            return f"{human_bytes(self.done)} of {human_bytes(self.total)}"
        return f"{self.done}/{self.total}{self.unit}"

    def _draw(self, end: str) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        elapsed = time.perf_counter() - self.start
        line = f"{self.label:<28} [{bar:<30}] {self._amount()} {elapsed:5.1f}s"
        # on a terminal: redraw in place and clear what a longer earlier line left behind
        sys.stderr.write(f"\r{line}\033[K{end}" if self._tty else f"{line}{end}")
        sys.stderr.flush()

    def close(self) -> None:
        self._draw(end="\n")
