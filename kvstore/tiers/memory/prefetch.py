"""The handle ``Store.prefetch(keys)`` returns at once, while the blocks are brought into
the memory tier in the background.

``await handle`` (or ``await handle.wait()``) returns how many of the requested blocks
are in memory because of it (blocks that were cached already, not stored, failed
verification or found no room under the prefetch share do not count); ``cancel()``
stops it (what arrived stays cached; a later ``get_many`` of the rest reads the disk).
A ``get_many`` of keys being prefetched waits only for those keys' reads to land, then
serves them from memory.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import anyio


class Prefetch:
    """A prefetch in flight (or done): see the module docstring."""

    def __init__(self, requested: int,
                 awaited: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self.requested = requested  # keys asked for
        self.scheduled = 0  # of which read from disk (stored, not yet in memory)
        self.arrived = 0  # of which now in memory because of this prefetch
        self.cancelled = False
        self.error: BaseException | None = None
        self._done = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        # held while a caller awaits the handle: the store's scheduler then lets
        # prefetch reads go even while gets are served (a caller waits for it now)
        self._awaited = awaited or nullcontext

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop reading; idempotent.  Blocks already in memory stay there."""
        self.cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    async def wait(self) -> int:
        """Wait until it ended (finished, cancelled or failed); the blocks that arrived.
        A failure (an I/O error, the store closing) is raised here.  While awaited, its
        reads are not held back by gets (a stream of them would hold them for ever)."""
        if not self._done.is_set():
            with self._awaited():
                await self._done.wait()
        if self.error is not None:
            raise self.error
        return self.arrived

    def __await__(self) -> Generator[Any, None, int]:
        return self.wait().__await__()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around the prefetch's work (the memory tier's): :meth:`cancel` stops it (also a
        cancel that came before it began), and however it ends, the handle is done."""
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self.cancelled:
                    scope.cancel()
                yield
        finally:
            self._scope = None
            self._done.set()

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return (f"<Prefetch {state}: {self.arrived} of {self.requested} arrived"
                f"{', cancelled' if self.cancelled else ''}>")


__all__ = ["Prefetch"]
