"""io_uring engine: O_DIRECT reads and writes from the staging arena, batched submission,
completions delivered through an eventfd that the event loop waits on.

Uses the PyPI ``liburing`` package, release 2024.5.3 (see pyproject.toml for why not
2026.x).  How its traps are avoided:

* Buffers: every op points into the page-aligned arena (never a ``bytearray``, whose
  address is not 4 KiB-aligned and fails O_DIRECT with EINVAL); the op and its
  :class:`ArenaRun` stay referenced in ``_pending`` until the kernel's completion is reaped,
  and a cancelled caller waits (shielded) for its ops before the runs are released.
* No blocking waits: ``io_uring_wait_cqe`` would hold the GIL and the loop.  A reaper
  task awaits ``anyio.wait_readable(eventfd)``, then reaps with ``io_uring_peek_cqe``.
  ``io_uring_peek_batch_cqe`` is not used: this binding writes its pointer array into a
  one-pointer field.
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
from anyio.abc import TaskGroup

from kvstore.errors import StoreIOError
from kvstore.io.coalesce import Merged, coalesce, spread
from kvstore.io.protocol import IoOp
from kvstore.io.threads import open_flags, raise_write_errors
from kvstore.permissions import FILE_MODE

try:  # pragma: no cover - exercised through the probe
    import liburing as _lu
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
    __slots__ = ("event", "res", "keep")

    def __init__(self, keep: object) -> None:
        self.event = anyio.Event()
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
        self._slots: anyio.Semaphore | None = None  # made in start(), on the event loop
        self._scope: anyio.CancelScope | None = None
        self._closed = False

    async def start(self, task_group: TaskGroup) -> None:
        self._slots = anyio.Semaphore(self.queue_depth)
        await task_group.start(self._reap_forever)

    async def _reap_forever(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope() as scope:
            self._scope = scope
            task_status.started()
            while True:
                await anyio.wait_readable(self._efd)
                with suppress(BlockingIOError):  # another wake-up already drained it
                    os.eventfd_read(self._efd)
                self._reap()

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
                pending.event.set()
                assert self._slots is not None
                self._slots.release()

    def open_file(self, path: str, *, create: bool) -> int:
        return os.open(path, open_flags(self.direct, create), FILE_MODE)

    def close_file(self, fd: int) -> None:
        os.close(fd)

    async def _submit(self, preps: Sequence[tuple[Callable[[Any], None], object]]) -> list[int | OSError]:
        """Queue one SQE per (prep, keep) pair, submit, and wait for all completions."""
        if self._closed:
            raise StoreIOError(9, "I/O engine is closed")
        ring, slots = self._ring, self._slots
        if slots is None:
            raise RuntimeError("UringEngine.start() was not called")
        waits: list[_Pending] = []
        with anyio.CancelScope(shield=True):
            for prep, keep in preps:
                try:
                    slots.acquire_nowait()
                except anyio.WouldBlock:
                    _lu.io_uring_submit(ring)  # never sleep on queued-but-unsubmitted SQEs
                    await slots.acquire()
                sqe = _lu.io_uring_get_sqe(ring)
                if not sqe:
                    _lu.io_uring_submit(ring)
                    sqe = _lu.io_uring_get_sqe(ring)
                prep(sqe)
                ud = next(self._ids)
                sqe.user_data = ud
                pending = _Pending(keep)
                self._pending[ud] = pending
                waits.append(pending)
            _lu.io_uring_submit(ring)
            for w in waits:
                await w.event.wait()
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
        with anyio.CancelScope(shield=True):
            for pending in list(self._pending.values()):  # ops the kernel still holds
                await pending.event.wait()
        if self._scope is not None:
            self._scope.cancel()
        _lu.io_uring_unregister_eventfd(self._ring)
        _lu.io_uring_queue_exit(self._ring)
        os.close(self._efd)
