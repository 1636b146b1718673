"""io_uring engine: O_DIRECT reads and writes from the staging arena, batched submission,
completions delivered through an eventfd that the event loop waits on.

Uses the PyPI ``liburing`` package, release 2024.5.3 (see pyproject.toml for why not
2026.x).  How its traps are avoided:

* Buffers: every op points into the page-aligned arena (never a ``bytearray``, whose
  address is not 4 KiB-aligned and fails O_DIRECT with EINVAL); the op and its
  :class:`ArenaRun` stay referenced in ``_pending`` until the kernel's completion is reaped,
  and a cancelled caller waits (shielded) for its ops before the runs are released.
* The engine owns reaping; no caller's scope can stop it.  There is no reaper task that
  a cancelled task group could take down while ops are in the kernel (that hung shutdown
  for good).  Instead the callers waiting for completions reap: one of them at a time
  (the leader) awaits ``anyio.wait_readable(eventfd)`` and reaps every completion ready,
  the others wait for its round to end and then check their own ops.  Every wait is
  shielded, so ops in the kernel are always reaped before their buffers are reused, and
  as long as any op is in flight some caller is reaping it.
* No blocking waits: ``io_uring_wait_cqe`` would hold the GIL and the loop; reaping uses
  ``io_uring_peek_cqe``.  ``io_uring_peek_batch_cqe`` is not used: this binding writes
  its pointer array into a one-pointer field.
* Negative ``res`` is an errno, turned into ``OSError`` per op.
* Durability order: ``datasync`` is only called after the writes it covers completed,
  so fdatasync cannot overtake them (io_uring runs ops of one submission in any order;
  IOSQE_IO_DRAIN would also stall every read queued behind it).
* User data 0 is never used: the binding treats a CQE with user_data 0 as empty.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from typing import Any

import anyio

from kvstore.errors import StoreIOError
from kvstore.io.coalesce import Merged, coalesce, spread
from kvstore.io.liburing_import import import_liburing
from kvstore.io.protocol import IoOp
from kvstore.io.threads import initialise_file, open_flags, raise_write_errors

try:  # pragma: no cover - exercised through the probe
    _lu: Any = import_liburing()
except ImportError:  # pragma: no cover
    _lu = None

IORING_FSYNC_DATASYNC = 1


def _prep_write(op: Merged, sqe: Any) -> None:
    _lu.io_uring_prep_write(sqe, op.fd, op.view, op.length, op.offset)


def _prep_read(op: Merged, sqe: Any) -> None:
    _lu.io_uring_prep_read(sqe, op.fd, op.view, op.length, op.offset)


def _prep_datasync(fd: int, sqe: Any) -> None:
    _lu.io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC)


class _Pending:
    __slots__ = ("done", "res", "keep")

    def __init__(self, keep: object) -> None:
        self.done = False
        self.res = 0
        self.keep = keep  # what the kernel is pointing into, alive until reaped


class UringEngine:
    name = "io_uring"

    def __init__(self, *, direct: bool = True, queue_depth: int = 64) -> None:
        if _lu is None or not hasattr(_lu, "io_uring"):
            raise RuntimeError("the liburing==2024.5.3 package is not installed")
        self.direct = direct
        self.queue_depth = queue_depth
        self._ring = _lu.io_uring()
        _lu.io_uring_queue_init(queue_depth, self._ring, 0)
        self._cqe = _lu.io_uring_cqe()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        _lu.io_uring_register_eventfd(self._ring, self._efd)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        # CQ ring has 2x queue_depth entries; bounding in-flight ops by queue_depth means
        # the completion queue can never overflow.
        self._free_slots = queue_depth
        self._leading = False  # a caller is waiting on the eventfd and reaping
        self._reaped: anyio.Event | None = None  # set after each reaping round
        self._closed = False

    async def start(self) -> None:
        return None

    async def _until(self, done: Callable[[], bool]) -> None:
        """Reap (as the leader) or wait for the leader's next round until ``done()``.
        Callers shield this: ops in flight must be reaped before anything moves on."""
        while not done():
            if self._leading:
                if self._reaped is None:
                    self._reaped = anyio.Event()
                await self._reaped.wait()
                continue
            self._leading = True
            try:
                await anyio.wait_readable(self._efd)
                with suppress(BlockingIOError):  # the counter was already drained
                    os.eventfd_read(self._efd)
                self._reap()
            finally:
                self._leading = False
                if self._reaped is not None:  # followers look at their ops (or lead)
                    self._reaped.set()
                    self._reaped = None

    def _reap(self) -> None:
        ring, cqe = self._ring, self._cqe
        for _ in range(_lu.io_uring_cq_ready(ring)):
            _lu.io_uring_peek_cqe(ring, cqe)
            ud, res = cqe.user_data, cqe.res
            _lu.io_uring_cqe_seen(ring, cqe)
            pending = self._pending.pop(ud, None)
            if pending is not None:
                pending.res = res
                pending.keep = None
                pending.done = True
                self._free_slots += 1

    def open_file(self, path: str) -> int:
        return os.open(path, open_flags(self.direct))

    async def initialise(self, fd: int, nbytes: int, header: bytes) -> None:
        # Rare (one extent file per GiB or so): a worker thread, not a ring operation.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(initialise_file, fd, nbytes, header)

    def close_file(self, fd: int) -> None:
        os.close(fd)

    async def _submit(self, preps: Sequence[tuple[Callable[[Any], None], object]]) -> list[int | OSError]:
        """Queue one SQE per (prep, keep) pair, submit, and wait for all completions."""
        if self._closed:
            raise StoreIOError(9, "I/O engine is closed")
        ring = self._ring
        waits: list[_Pending] = []
        with anyio.CancelScope(shield=True):
            for prep, keep in preps:
                if not self._free_slots:
                    _lu.io_uring_submit(ring)  # never wait on queued-but-unsubmitted SQEs
                    await self._until(lambda: self._free_slots > 0)
                sqe = _lu.io_uring_get_sqe(ring)
                if not sqe:
                    _lu.io_uring_submit(ring)
                    sqe = _lu.io_uring_get_sqe(ring)
                prep(sqe)
                ud = next(self._ids)
                sqe.user_data = ud
                pending = _Pending(keep)
                self._pending[ud] = pending
                self._free_slots -= 1
                waits.append(pending)
            _lu.io_uring_submit(ring)
            await self._until(lambda: all(w.done for w in waits))
        return [w.res if w.res >= 0 else OSError(-w.res, os.strerror(-w.res)) for w in waits]

    async def write(self, ops: Sequence[IoOp]) -> None:
        merged = coalesce(ops)  # adjacent slots go out as one operation
        results = await self._submit([(partial(_prep_write, m), m) for m in merged])
        raise_write_errors(spread(merged, results), ops, "write")

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        merged = coalesce(ops)
        return spread(merged, await self._submit([(partial(_prep_read, m), m) for m in merged]))

    async def datasync(self, fds: Sequence[int]) -> None:
        results = await self._submit([(partial(_prep_datasync, fd), None) for fd in fds])
        for res in results:
            if isinstance(res, OSError):
                raise StoreIOError(res.errno, f"fdatasync failed: {res.strerror}")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):  # ops the kernel still holds
            await self._until(lambda: not self._pending)
        _lu.io_uring_unregister_eventfd(self._ring)
        _lu.io_uring_queue_exit(self._ring)
        os.close(self._efd)
