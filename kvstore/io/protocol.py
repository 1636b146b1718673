"""The contract every I/O engine implements (io_uring, thread pool, and the simulated
disk of the crash tests).  ``tests/conformance.py`` holds the suite each one passes (``tests/io/test_*.py``
run it per engine).

An engine moves bytes between arena runs and files at 4 KiB-aligned offsets and makes
them durable; it knows nothing of keys, slots or the index.  Rules every engine keeps:

* ``write`` returns only when every op finished; any failure (error or short write)
  raises :class:`~kvstore.errors.StoreIOError` after all ops of the call have ended, so
  no buffer is still in the kernel's hands when the caller reuses it.
* ``read`` never raises for one bad op: it returns a per-op result (bytes read, or the
  ``OSError``), so one unreadable block is a miss and not a failed batch.
* ``datasync`` is ordered after every ``write`` that returned before it was called.
* No call blocks the event loop.
* A cancelled caller's ops are finished (or never started) before the call returns:
  the runs are then the caller's again.  The engine owns whatever background work it
  needs; nothing it depends on lives in a scope a caller can cancel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.io.arena import ArenaRun


@dataclass(frozen=True, slots=True)
class IoOp:
    """Transfer ``run`` (its whole length) to/from ``fd`` at byte ``offset``."""

    fd: int
    offset: int
    run: ArenaRun


@runtime_checkable
class IOEngine(Protocol):
    name: str
    """Short name shown by ``stats()``: ``io_uring``, ``threads`` or ``simulated``."""
    direct: bool
    """Whether files are opened with O_DIRECT (reads then always come from the device)."""

    async def start(self) -> None:
        """Called once on the event loop that will use the engine, before any I/O."""
        ...

    def open_file(self, path: str) -> int:
        """Open an existing file for aligned I/O and return its descriptor (the store
        makes its files and checks them first: kvstore/disk/extents.py)."""
        ...

    async def initialise(self, fd: int, nbytes: int, header: bytes) -> None:
        """Make a new file ``nbytes`` long, preallocated from offset 0 (``posix_fallocate``:
        no hole a later write could fail to fill), with ``header`` (a few bytes, written
        as they are) at offset 0, all durable when it returns.  An ``OSError`` with the
        kernel's errno (ENOSPC: no room)."""
        ...

    def close_file(self, fd: int) -> None: ...

    async def write(self, ops: Sequence[IoOp]) -> None: ...

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]: ...

    async def datasync(self, fds: Sequence[int]) -> None: ...

    async def aclose(self) -> None: ...


class EngineWrapper:
    """An engine that forwards every call to ``inner``: subclass it to change some calls
    (the I/O scheduler; the tests' gated engine) and keep the rest."""

    def __init__(self, inner: IOEngine) -> None:
        self.inner = inner
        self.name, self.direct = inner.name, inner.direct

    async def start(self) -> None:
        await self.inner.start()

    def open_file(self, path: str) -> int:
        return self.inner.open_file(path)

    async def initialise(self, fd: int, nbytes: int, header: bytes) -> None:
        await self.inner.initialise(fd, nbytes, header)

    def close_file(self, fd: int) -> None:
        self.inner.close_file(fd)

    async def write(self, ops: Sequence[IoOp]) -> None:
        await self.inner.write(ops)

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        return await self.inner.read(ops)

    async def datasync(self, fds: Sequence[int]) -> None:
        await self.inner.datasync(fds)

    async def aclose(self) -> None:
        await self.inner.aclose()
