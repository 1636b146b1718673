"""A store's calls in flight and its health: what every call path checks first.

* :class:`Operations` counts the calls in flight, so that ``aclose()`` can refuse new
  ones and wait for those running (puts, gets, quarantines, deletes, background
  promotions and prefetches).
* :class:`Health` remembers why the store stopped accepting writes (G5): a failed write
  or fdatasync means the kernel may have dropped pages that sync covered, so no later
  acknowledgement could be trusted.  Reads still work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from kvstore.errors import ReadOnlyError, StoreClosedError

__all__ = ["Health", "Operations"]


class Operations:
    """Calls in flight, so that ``aclose()`` can wait for every one of them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.closed = False
        self.running = 0
        self.draining = False  # aclose() is waiting for the calls in flight
        self._idle: anyio.Event | None = None

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"store {self.path} is closed")

    @contextmanager
    def track(self) -> Iterator[None]:
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if not self.running and self._idle is not None:
                self._idle.set()

    async def drain(self) -> None:
        self.draining = True
        while self.running:
            self._idle = anyio.Event()
            await self._idle.wait()
        self.draining = False


class Health:
    """Whether the store still accepts writes, and why not."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.read_only_reason: str | None = None

    @property
    def read_only(self) -> bool:
        return self.read_only_reason is not None

    def fail_closed(self, why: str) -> None:
        """Stop accepting writes (the first reason is the one reported)."""
        if self.read_only_reason is None:
            self.read_only_reason = why

    def check_writable(self) -> None:
        if self.read_only_reason is not None:
            raise ReadOnlyError(
                f"store {self.path} stopped accepting writes: {self.read_only_reason}. "
                "Reads still work; fix the device, run `python -m kvstore fsck`, and reopen.")

    def check_still_writable(self) -> None:
        """A put about to commit: refused if the store failed closed meanwhile."""
        if self.read_only_reason is not None:
            raise ReadOnlyError(
                f"store {self.path} stopped accepting writes while this put was in "
                f"flight: {self.read_only_reason}. The put is not stored.")
