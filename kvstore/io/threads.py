"""Portable I/O engine: ``os.preadv``/``os.pwritev`` on a bounded pool of worker threads.

Used where io_uring is missing or forbidden (old kernels, seccomp profiles that block
``io_uring_setup`` as Docker's default does, gVisor) and where O_DIRECT is refused
(tmpfs, some network and overlay file systems): then files are opened buffered and
``fdatasync`` alone makes writes durable.  The syscalls release the GIL, so the pool
gives real parallelism; ``queue_depth`` bounds the threads, like an io_uring queue depth.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from functools import partial

import anyio

from kvstore.disk.format import round_up
from kvstore.errors import StoreIOError
from kvstore.io.coalesce import coalesce, spread
from kvstore.io.protocol import IoOp


def open_flags(direct: bool, read_only: bool = False) -> int:
    return (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)


def initialise_file(fd: int, nbytes: int, header: bytes) -> None:
    """``posix_fallocate`` of ``nbytes`` from 0, ``header`` (whole pages) written at 0,
    then ``fsync``: size, allocation and header durable (blocking: a worker thread's)."""
    os.posix_fallocate(fd, 0, nbytes)
    with mmap.mmap(-1, round_up(len(header))) as page:  # aligned, as O_DIRECT needs
        page[:len(header)] = header
        with memoryview(page) as view:
            written = os.pwritev(fd, [view[:len(header)]], 0)
    if written != len(header):
        raise OSError(errno.EIO, "short write of the header")
    os.fsync(fd)


def raise_write_errors(results: Sequence[int | OSError], ops: Sequence[IoOp], what: str) -> None:
    """Turn per-op write results into one StoreIOError naming the first failure."""
    for res, op in zip(results, ops):
        if isinstance(res, OSError):
            raise StoreIOError(res.errno, f"{what} at offset {op.offset} failed: {res.strerror}")
        if res != op.run.length:
            raise StoreIOError(5, f"short {what} at offset {op.offset}: {res} of {op.run.length} bytes")


class ThreadPoolEngine:
    name = "threads"

    def __init__(self, *, direct: bool, queue_depth: int = 16, read_only: bool = False) -> None:
        """``read_only``: files are opened ``O_RDONLY`` (fsck's reads, which must work on
        files it may not write, e.g. an immutable one); ``write`` then fails (EBADF)."""
        self.direct, self._read_only = direct, read_only
        self._depth = queue_depth
        self._limiter = anyio.CapacityLimiter(queue_depth)

    async def start(self) -> None:
        return None

    def open_file(self, path: str) -> int:
        return os.open(path, open_flags(self.direct, self._read_only))

    def close_file(self, fd: int) -> None:
        os.close(fd)

    async def _each(self, ops: Sequence[IoOp], write: bool) -> list[int | OSError]:
        merged = coalesce(ops)  # adjacent slots go out as one operation
        results: list[int | OSError] = [0] * len(merged)

        def one(i: int) -> None:
            op = merged[i]
            try:
                if write:
                    results[i] = os.pwritev(op.fd, [op.view], op.offset)
                else:
                    results[i] = os.preadv(op.fd, [op.view], op.offset)
            except OSError as e:
                results[i] = e

        # Up to queue_depth workers, each taking the next op until none is left (the
        # shared iterator's next() is atomic under the GIL): one hand-off to a worker
        # thread per worker, not per op (~100 us each: a batch of 256 page reads cost
        # 2-4x the reads themselves).  The limiter is FIFO, so a later call waits for
        # this one's ops as it did when each op queued alone.
        todo = iter(range(len(merged)))

        def work() -> None:
            for i in todo:
                one(i)

        # Shielded: a cancelled caller must not get its buffers back while a worker
        # thread still copies into them.
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for _ in range(min(len(merged), self._depth)):
                    tg.start_soon(partial(anyio.to_thread.run_sync, work, limiter=self._limiter))
        return spread(merged, results)

    async def write(self, ops: Sequence[IoOp]) -> None:
        raise_write_errors(await self._each(ops, True), ops, "write")

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        return await self._each(ops, False)

    async def initialise(self, fd: int, nbytes: int, header: bytes) -> None:
        with anyio.CancelScope(shield=True):  # the descriptor stays in use until it ends
            await anyio.to_thread.run_sync(initialise_file, fd, nbytes, header,
                                           limiter=self._limiter)

    async def datasync(self, fds: Sequence[int]) -> None:
        def sync_all() -> None:
            for fd in fds:
                os.fdatasync(fd)

        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(sync_all, limiter=self._limiter)
        except OSError as e:
            raise StoreIOError(e.errno, f"fdatasync failed: {e.strerror}") from e

    async def aclose(self) -> None:
        return None
