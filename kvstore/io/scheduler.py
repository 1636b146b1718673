"""Read-first I/O scheduling in front of an engine: the reads a caller is waiting for go
before background writes and prefetches.

An io_uring (or thread pool) hands the device whatever it is given, in order: a put
stream that keeps 64 MiB of writes queued makes every get wait behind them (the mixed
benchmark measured a foreground get's p99 at 2.2x its idle value).  This layer admits
transfers per *class* with a bound on the bytes each class may have in flight:

``read``      gets (someone awaits them): always admitted at once;
``write``     puts: up to ``write_bytes`` in flight, only ``write_bytes_busy`` while a
              read is in flight or waiting (a read then queues behind at most that much);
``prefetch``  background reads: up to ``prefetch_bytes``, and none while a foreground
              read is in flight or waiting.

Not scheduled: fdatasync and the index's fsync.  A device cache flush makes every later
request wait behind it, reads included, and cannot be reordered from up here; letting a
flush wait for the reads already on the device was tried and cost the put stream a third
of its throughput for no gain in get p99 (benchmarks/results/tiers.md).

Waiting transfers are admitted read-first, in arrival order within a class.  One call
is always admitted when its class has nothing in flight, so a transfer larger than its
bound still goes (alone).  Which class a call belongs to is a context variable
(:data:`io_class`) that the store sets around a prefetch; reads default to ``read`` and
writes to ``write``.  fdatasync is not scheduled (it orders after writes by contract).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import anyio

from kvstore.io.protocol import EngineWrapper, IOEngine, IoOp

READ, WRITE, PREFETCH = "read", "write", "prefetch"
io_class: ContextVar[str | None] = ContextVar("kvstore_io_class", default=None)


@contextmanager
def as_class(name: str) -> Iterator[None]:
    """Run the enclosed transfers (and the tasks they start) as class ``name``."""
    token = io_class.set(name)
    try:
        yield
    finally:
        io_class.reset(token)


class IoScheduler(EngineWrapper):
    """An :class:`~kvstore.io.protocol.IOEngine` that schedules another one's reads and
    writes by class; see the module docstring."""

    def __init__(self, inner: IOEngine, *, write_bytes: int = 64 << 20,
                 write_bytes_busy: int = 8 << 20, prefetch_bytes: int = 16 << 20) -> None:
        super().__init__(inner)
        self._limits = {WRITE: write_bytes, PREFETCH: prefetch_bytes}
        self._write_busy = write_bytes_busy
        self.inflight = {READ: 0, WRITE: 0, PREFETCH: 0}  # bytes
        self.waiting = {READ: 0, WRITE: 0, PREFETCH: 0}  # calls
        self._queues: dict[str, deque[anyio.Event]] = {WRITE: deque(), PREFETCH: deque()}
        self.admitted = {READ: 0, WRITE: 0, PREFETCH: 0}  # calls, for stats
        self.deferred = {READ: 0, WRITE: 0, PREFETCH: 0}  # calls that had to wait

    # ------------------------------------------------------------------ admission

    def _reading(self) -> bool:
        return bool(self.inflight[READ] or self.waiting[READ])

    def _fits(self, cls: str, nbytes: int) -> bool:
        if cls == READ:
            return True
        if cls == PREFETCH and self._reading():
            return False
        if not self.inflight[cls]:
            return True  # one call always goes when its class is idle
        limit = self._write_busy if cls == WRITE and self._reading() else self._limits[cls]
        return self.inflight[cls] + nbytes <= limit

    async def _admit(self, cls: str, nbytes: int) -> None:
        if cls == READ:
            self.inflight[READ] += nbytes
            self.admitted[READ] += 1
            return
        queue = self._queues[cls]
        if not queue and self._fits(cls, nbytes):
            self.inflight[cls] += nbytes
            self.admitted[cls] += 1
            return
        self.deferred[cls] += 1
        self.waiting[cls] += 1
        turn = anyio.Event()
        queue.append(turn)
        try:
            while True:
                if queue[0] is turn and self._fits(cls, nbytes):
                    break
                await turn.wait()
                turn = self._rearm(queue, turn)
        except BaseException:
            queue.remove(turn)
            self._wake()
            raise
        finally:
            self.waiting[cls] -= 1
        queue.popleft()
        self.inflight[cls] += nbytes
        self.admitted[cls] += 1
        self._wake()  # the next in line may fit too

    @staticmethod
    def _rearm(queue: deque[anyio.Event], turn: anyio.Event) -> anyio.Event:
        """A set event cannot be waited on again: swap in a fresh one, same position."""
        fresh = anyio.Event()
        queue[queue.index(turn)] = fresh
        return fresh

    def _done(self, cls: str, nbytes: int) -> None:
        self.inflight[cls] -= nbytes
        self._wake()

    def _wake(self) -> None:
        """Let the head of each queue look again (reads never queue)."""
        for queue in self._queues.values():
            if queue:
                queue[0].set()

    # ------------------------------------------------------------------ the engine API

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        cls = io_class.get() or READ
        nbytes = sum(op.run.length for op in ops)
        await self._admit(cls, nbytes)
        try:
            return await self.inner.read(ops)
        finally:
            self._done(cls, nbytes)

    async def write(self, ops: Sequence[IoOp]) -> None:
        nbytes = sum(op.run.length for op in ops)
        await self._admit(WRITE, nbytes)
        try:
            await self.inner.write(ops)
        finally:
            self._done(WRITE, nbytes)



__all__ = ["IoScheduler", "PREFETCH", "READ", "WRITE", "as_class", "io_class"]
