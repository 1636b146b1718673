"""Read-first I/O scheduling in front of an engine: the reads a caller is waiting for go
before background writes, flushes and prefetches.

An io_uring (or thread pool) hands the device whatever it is given, in order: a put
stream that keeps 64 MiB of writes queued makes every get wait behind them.  This layer
admits transfers per *class* with a bound on the bytes each class may have in flight:

``read``      gets (someone awaits them): always admitted at once;
``write``     puts: up to ``write_bytes`` in flight, only ``write_bytes_busy`` while
              reads are being served; a write call is cut into pieces of that size, so
              the bound holds for a call of any size (the pieces of a call that fit
              together still go to the engine as one call);
``prefetch``  background reads: up to ``prefetch_bytes``, and none while reads are
              being served, unless a caller awaits a prefetch
              (:meth:`IoScheduler.prefetch_awaited`: a get of a key being prefetched);
              then they go at their bound, so that the get is not held back for as
              long as other gets keep coming.

"Reads are being served" means: a read on the device or waiting, a get in progress
(:meth:`IoScheduler.foreground`, from its start to its end, so the CPU phases of a get
count too), or less than ``read_grace_s`` since either ended.  The grace is for the
next get of an engine's load, a few hundred microseconds later: without it the writes
waiting meanwhile filled the device first (measured: a 16 MiB get under a put stream
then found 8-16 MiB of writes ahead of it).

Flushes.  A device cache flush (fdatasync) makes later reads wait while it writes back
what is dirty, about a millisecond per MiB on the disks measured here, so a put's flush
of a whole 16 MiB batch stalled a get by tens of ms.  Delaying flushes until the reads
stop only moved the stall (and starved puts under a long run of gets).  Instead, while
reads are served, the scheduler flushes itself whenever ``dirty_bytes_busy`` have been
written since the last flush, before it admits the next write: each flush is then small
(a few ms), and the put's own flush later finds little to do.  A failed flush is kept
and raised by every later flush: Linux reports a lost writeback once per file, and a put
must never be acknowledged after its bytes were lost.

Waiting transfers are admitted read-first, in arrival order within a class.  One call
is always admitted when its class has nothing in flight, so a transfer larger than its
bound still goes (alone).  Which class a call belongs to is a context variable
(:data:`io_class`) that the store sets around a prefetch; reads default to ``read`` and
writes to ``write``.

Measured (``benchmarks/tiers.py``, benchmarks/results/tiers.md): a foreground get's p99
under two durable put streams: 2.6-4.1x its idle p99 with scheduling off, 1.25-1.62x on.
"""

from __future__ import annotations

import errno
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import anyio

from kvstore.disk.format import PAGE
from kvstore.errors import StoreIOError
from kvstore.io.arena import ArenaRun
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


@dataclass(frozen=True)
class IoSchedule:
    """The read-first scheduler's bounds: ``kvstore.open(io_scheduling=IoSchedule(...))``.

    ``write_bytes``       writes in flight when no get is being served (64 MiB);
    ``write_bytes_busy``  writes in flight while one is, and the size of the pieces a
                          write call is cut into (1 MiB; a multiple of 4 KiB);
    ``dirty_bytes_busy``  while a get is served, flush after this much was written
                          (2 MiB; 0: no flushes of the scheduler's own);
    ``prefetch_bytes``    prefetch reads in flight (16 MiB; none while a get is served);
    ``read_grace_s``      how long after a get ends it still counts as served (5 ms).

    Larger busy bounds give puts more of the device while gets run, at the gets' cost
    (README, "Tiers, prefetch and scheduling", has the measured trade-off).
    """

    write_bytes: int = 64 << 20
    write_bytes_busy: int = 1 << 20
    dirty_bytes_busy: int = 2 << 20
    prefetch_bytes: int = 16 << 20
    read_grace_s: float = 0.005

    def __post_init__(self) -> None:
        for name in ("write_bytes", "write_bytes_busy", "prefetch_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < PAGE:
                raise ValueError(f"IoSchedule.{name} must be an int >= {PAGE} bytes, "
                                 f"got {value!r}")
        if self.write_bytes_busy % PAGE:
            raise ValueError(f"IoSchedule.write_bytes_busy must be a multiple of {PAGE} "
                             f"(writes go in pieces of it), got {self.write_bytes_busy}")
        if self.write_bytes_busy > self.write_bytes:
            raise ValueError(f"IoSchedule.write_bytes_busy ({self.write_bytes_busy}) must "
                             f"not exceed write_bytes ({self.write_bytes})")
        if not isinstance(self.dirty_bytes_busy, int) or self.dirty_bytes_busy < 0:
            raise ValueError(f"IoSchedule.dirty_bytes_busy must be an int >= 0 (0: no "
                             f"flushes of the scheduler's own), got {self.dirty_bytes_busy!r}")
        if not (isinstance(self.read_grace_s, (int, float)) and self.read_grace_s >= 0
                and math.isfinite(self.read_grace_s)):
            raise ValueError(f"IoSchedule.read_grace_s must be a finite number of seconds "
                             f">= 0, got {self.read_grace_s!r}")


class IoScheduler(EngineWrapper):
    """An :class:`~kvstore.io.protocol.IOEngine` that schedules another one's reads and
    writes by class; see the module docstring."""

    def __init__(self, inner: IOEngine, schedule: IoSchedule = IoSchedule()) -> None:
        super().__init__(inner)
        self.schedule = schedule
        self._limits = {WRITE: schedule.write_bytes, PREFETCH: schedule.prefetch_bytes}
        self._read_until = 0.0  # monotonic time until which the last read still counts
        self._foreground = 0  # callers inside foreground(): a get from start to finish
        self._awaited = 0  # callers inside prefetch_awaited(): a get waiting on a prefetch
        self._dirty = 0  # bytes written since the last flush
        self._dirty_fds: set[int] = set()
        self._flushing: anyio.Event | None = None
        self._flush_error: BaseException | None = None
        self.flushes = 0  # flushes the scheduler issued itself, for stats
        self.inflight = {READ: 0, WRITE: 0, PREFETCH: 0}  # bytes
        self.waiting = {READ: 0, WRITE: 0, PREFETCH: 0}  # calls
        self._queues: dict[str, deque[anyio.Event]] = {WRITE: deque(), PREFETCH: deque()}
        self.admitted = {READ: 0, WRITE: 0, PREFETCH: 0}  # calls, for stats
        self.deferred = {READ: 0, WRITE: 0, PREFETCH: 0}  # calls that had to wait

    # ------------------------------------------------------------------ admission

    def _reading(self) -> bool:
        return bool(self._foreground or self.inflight[READ] or self.waiting[READ]
                    or self._grace_left() is not None)

    def _grace_left(self) -> float | None:
        left = self._read_until - time.monotonic()
        return left if left > 0 else None

    def _start_grace(self) -> None:
        """A read or a get just ended: the next one of a load is a moment away."""
        if self.schedule.read_grace_s > 0:
            self._read_until = time.monotonic() + self.schedule.read_grace_s

    def _fits(self, cls: str, nbytes: int) -> bool:
        if cls == READ:
            return True
        if cls == PREFETCH and self._reading() and not self._awaited:
            return False
        if not self.inflight[cls]:
            return True  # one call always goes when its class is idle
        busy = cls == WRITE and self._reading()
        limit = self.schedule.write_bytes_busy if busy else self._limits[cls]
        return self.inflight[cls] + nbytes <= limit

    async def _admit(self, cls: str, nbytes: int) -> None:
        if cls == READ:
            self.inflight[READ] += nbytes
            self.admitted[READ] += 1
            return
        queue = self._queues[cls]
        if self._claim(cls, nbytes):
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
                # A write held back only by the grace after a read must look again when
                # the grace ends, whether or not anything else wakes it.
                with anyio.move_on_after(self._grace_left() or math.inf):
                    await turn.wait()
                if turn.is_set():
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
        if cls == READ:
            self._start_grace()
        self._wake()

    def _wake(self) -> None:
        """Let the head of each queue look again (reads never queue)."""
        for queue in self._queues.values():
            if queue:
                queue[0].set()

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """A caller awaits what happens inside (a get, start to finish): writes stay at
        their busy bound throughout, not only while its reads are on the device, and for
        the grace after, so that the next get of an engine's load finds the device free."""
        self._foreground += 1
        try:
            yield
        finally:
            self._foreground -= 1
            self._start_grace()
            self._wake()

    @contextmanager
    def prefetch_awaited(self) -> Iterator[None]:
        """A caller awaits a prefetch's reads (a get of a key being prefetched): for as
        long as it waits, prefetch reads go at their own bound even while gets are
        served, so that a stream of other gets cannot hold them (and the caller) back
        for ever.  The caller then waits at most for the prefetch reads queued before."""
        self._awaited += 1
        self._wake()
        try:
            yield
        finally:
            self._awaited -= 1

    # ------------------------------------------------------------------ the engine API

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        cls = io_class.get() or READ
        nbytes = sum(op.run.length for op in ops)
        await self._admit(cls, nbytes)
        try:
            return await self.inner.read(ops)
        finally:
            self._done(cls, nbytes)

    async def datasync(self, fds: Sequence[int]) -> None:
        self._check_flushes()
        self._dirty = 0  # near enough: a device flush writes back every file
        await self.inner.datasync(fds)
        self._check_flushes()  # one of ours may have failed meanwhile

    def _check_flushes(self) -> None:
        """Raise (a fresh error each time, naming the first) if one of our flushes failed."""
        if self._flush_error is not None:
            raise StoreIOError(getattr(self._flush_error, "errno", None) or errno.EIO,
                               f"an earlier fdatasync failed ({self._flush_error}): what "
                               "was written before it may be lost") from self._flush_error

    async def _flush_if_dirty(self) -> None:
        """While reads are served, flush once ``dirty_bytes_busy`` were written since the
        last flush, before the next write goes (see the module docstring)."""
        bound = self.schedule.dirty_bytes_busy
        while bound and self._dirty >= bound and self._reading():
            if self._flushing is not None:  # another writer is flushing: ride on it
                await self._flushing.wait()
                continue
            self._flushing, fds = anyio.Event(), sorted(self._dirty_fds)
            self._dirty, self._dirty_fds = 0, set()
            try:
                with anyio.CancelScope(shield=True):  # others ride on it
                    self.flushes += 1
                    await self.inner.datasync(fds)
            except BaseException as e:
                self._flush_error = e
                raise
            finally:
                self._flushing.set()
                self._flushing = None
            await anyio.lowlevel.checkpoint_if_cancelled()  # a cancelled writer stops here
        self._check_flushes()

    async def write(self, ops: Sequence[IoOp]) -> None:
        pieces = deque(self._pieces(ops))
        while pieces:
            await self._flush_if_dirty()
            first = pieces.popleft()
            await self._admit(WRITE, first.run.length)
            batch, nbytes = [first], first.run.length
            while pieces and self._claim(WRITE, pieces[0].run.length):
                nbytes += pieces[0].run.length
                batch.append(pieces.popleft())
            try:
                await self.inner.write(batch)
                self._dirty += nbytes
                self._dirty_fds.update(op.fd for op in batch)
            finally:
                self._done(WRITE, nbytes)

    def close_file(self, fd: int) -> None:
        self._dirty_fds.discard(fd)  # its number may be reused; nothing to flush there
        super().close_file(fd)

    def _claim(self, cls: str, nbytes: int) -> bool:
        """Take ``nbytes`` of ``cls``'s bound if nobody is queued before us and they fit."""
        if self._queues[cls] or not self._fits(cls, nbytes):
            return False
        self.inflight[cls] += nbytes
        return True

    def _pieces(self, ops: Sequence[IoOp]) -> Iterator[IoOp]:
        piece = self.schedule.write_bytes_busy
        for op in ops:
            run = op.run
            if run.length <= piece:
                yield op
                continue
            for lo in range(0, run.length, piece):
                n = min(piece, run.length - lo)
                yield IoOp(op.fd, op.offset + lo, ArenaRun(run.arena, run.offset + lo, n))



__all__ = ["IoSchedule", "IoScheduler", "PREFETCH", "READ", "WRITE", "as_class", "io_class"]
