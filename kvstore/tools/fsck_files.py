"""fsck's reads and writes of extent files (kvstore/tools/fsck.py checks, fsck_rebuild.py
rebuilds).

Reads go through an I/O engine (:class:`~kvstore.io.protocol.IOEngine`), the one road to
a store's bytes, so a simulated engine's faults and crashes reach fsck as they reach the
store.  fsck is synchronous and offline; the engine is async, so :class:`ExtentReader`
runs it on an event loop of its own (a blocking portal, one thread) for the duration of
the check, and reads into one page-aligned arena run.  Without an engine handed in, the
thread-pool engine reads, ``O_DIRECT`` where the file system allows (what the device
holds, not the page cache; refused, e.g. on tmpfs: buffered), files opened read-only (a
check needs no right to write).  An operator's tool reports what it cannot read instead
of stopping at it, so :meth:`ExtentReader.read_pages` narrows a failed read to the pages
that fail, each read alone (as the store's own reads are retried alone,
:func:`kvstore.io.coalesce.reread_failed`), and hands back what it could read with those
pages zeroed and listed (:class:`Unreadable`, with the kernel's errno).  What could not
be read is never repaired by writing over it: callers report it and leave it.  No path
is followed through a link: each file is checked before the engine opens it by name and
its descriptor after (store_files.py, as kvstore/core/extent_files.py does).

Repairs (``zero_page``, ``rewrite``, ``extend``, ``remove_file``) are plain file writes
(``O_NOFOLLOW``), not engine calls: the operator's tool writes offline, with the store
closed, a few pages per finding, each made durable before the index changes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TypeVar, cast

from anyio import get_cancelled_exc_class
from anyio.from_thread import start_blocking_portal

from kvstore.disk import store_files
from kvstore.disk.extents import fsync_dir
from kvstore.disk.format import PAGE, SLOT_HEADER_BYTES, IndexEntry, SlotHeader, round_up
from kvstore.errors import CorruptionError, KVStoreError
from kvstore.io.arena import Arena
from kvstore.io.protocol import IOEngine, IoOp
from kvstore.io.slots import check_payload, check_slot
from kvstore.io.threads import ThreadPoolEngine

__all__ = ["SCAN_CHUNK", "ExtentReader", "Unreadable", "extend",
           "remove_file", "rewrite", "verified_slots", "verify_slot", "zero_page"]

SCAN_CHUNK = 8 << 20
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC  # extent files are never reached through a link
T = TypeVar("T")
_BATCH_OPS = 256  # reads per engine call: a page each without --deep (1 MiB of the buffer)
_FIX = "fsck reads no file through a link; move the real file there."


@dataclass(frozen=True)
class Unreadable:
    """Bytes ``[offset, offset + length)`` of a file that a read failed on."""

    offset: int
    length: int
    error: OSError

    def describe(self) -> str:
        return f"{self.length} bytes at {self.offset} cannot be read ({self.error.strerror})"


async def _default_engines() -> list[IOEngine]:
    return [ThreadPoolEngine(direct=True, read_only=True),
            ThreadPoolEngine(direct=False, read_only=True)]


class ExtentReader:
    """Aligned reads of extent files through ``engine``, one descriptor per file, one
    buffer.  The engine is the reader's until :meth:`close`: started on the reader's
    event loop, closed with it (as ``kvstore.open`` does with an engine it is handed).
    ``None``: the thread-pool engine, ``O_DIRECT`` (a file it refuses: buffered).  An
    engine handed in is made outside any event loop (a synchronous caller's), as its
    limiters then bind to the loop that first uses them."""

    def __init__(self, engine: IOEngine | None = None) -> None:
        self._fds: dict[str, tuple[IOEngine, int]] = {}
        self._stack = ExitStack()
        try:
            self._portal = self._stack.enter_context(start_blocking_portal())
            # Tried in order at each file's open: a buffered engine takes what O_DIRECT
            # refuses.  Made on the reader's loop: an engine's limiter belongs to the
            # event loop it is made on (a caller may be inside another one, trio's).
            self._engines = [engine] if engine is not None else self._call(_default_engines)
            for e in self._engines:
                self._call(e.start)
                self._stack.callback(self._call, e.aclose)
            self._arena = Arena(SCAN_CHUNK)
            self._stack.callback(self._arena.close)
            whole = self._arena.try_acquire(SCAN_CHUNK)  # the reader's alone: never waits
            assert whole is not None
            self._whole = whole
        except BaseException:
            self._stack.close()
            raise

    def _call(self, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """``await fn(*args)`` on the reader's event loop.  A ``BaseException`` that is no
        cancellation (the simulated machine's stop) is raised here, in fsck's thread: on
        the loop it would end the portal, and the engine could not be closed."""
        stopped: list[BaseException] = []

        async def run() -> T | None:
            try:
                return await fn(*args)
            except (Exception, get_cancelled_exc_class()):
                raise
            except BaseException as e:
                stopped.append(e)
                return None

        result = self._portal.call(run)
        if stopped:
            raise stopped[0]
        return cast(T, result)  # None only with ``stopped``

    def fd(self, path: str) -> int:
        """The descriptor of ``path`` (opened on first use): an ``OSError`` if it cannot
        be opened, :class:`~kvstore.errors.UnsafePathError` if it is not a regular file."""
        if path not in self._fds:
            self._fds[path] = self._open(path)
        return self._fds[path][1]

    def _open(self, path: str) -> tuple[IOEngine, int]:
        before = store_files.check_file(path, _FIX)
        if before is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        for i, engine in enumerate(self._engines):
            try:
                fd = engine.open_file(path)
                break
            except OSError:
                if i + 1 == len(self._engines):
                    raise
        try:  # the engine opens by name: the file checked above, not one swapped in since
            store_files.check_same(path, os.fstat(fd), before, _FIX)
        except BaseException:
            engine.close_file(fd)
            raise
        return engine, fd

    def read(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (page-aligned); short at end of file; an
        ``OSError`` if any of it cannot be read."""
        self.fd(path)
        engine, fd = self._fds[path]
        out = bytearray()
        while len(out) < length:
            want = min(round_up(length - len(out)), SCAN_CHUNK)
            (run,) = self._arena.split(self._whole, [want])
            try:
                (got,) = self._call(engine.read, [IoOp(fd, offset + len(out), run)])
                if isinstance(got, OSError):
                    raise got
                out += run.view[:min(got, length - len(out))]
            finally:
                run.view.release()
            if got < run.length:
                break
        return bytes(out)

    def read_each(self, reads: Iterable[tuple[str, int, int]]) -> Iterator[bytes | OSError]:
        """:meth:`read` of each ``(path, offset, length)``, in order, or the ``OSError`` it
        raised.  Consecutive reads go to the engine as one call (up to the buffer's size):
        one round trip to the reader's loop per batch, not per read.  A read that fails
        in a batch is read again alone (the engine may have merged it with a neighbour
        whose failure it shares, as the store's reads are retried:
        :func:`kvstore.io.coalesce.reread_failed`)."""
        batch: list[tuple[str, int, int]] = []
        size = 0  # of the batch in the buffer
        for want in reads:
            if batch and (size + round_up(want[2]) > SCAN_CHUNK or len(batch) == _BATCH_OPS):
                yield from self._read_batch(batch)
                batch, size = [], 0
            batch.append(want)
            size += round_up(want[2])
        yield from self._read_batch(batch)

    def _read_batch(self, batch: list[tuple[str, int, int]]) -> list[bytes | OSError]:
        out: list[bytes | OSError | None] = [None] * len(batch)
        ops: list[tuple[int, int, IoOp]] = []  # (index in batch, length, op)
        engines: set[int] = set()
        sizes = [round_up(n) for _, _, n in batch]
        runs = self._arena.split(self._whole, sizes) if sum(sizes) <= SCAN_CHUNK else []
        for i, (path, offset, length) in enumerate(batch):
            try:
                self.fd(path)
            except OSError as e:
                out[i] = e.with_traceback(None)
                continue
            engine, fd = self._fds[path]
            if runs and (not engines or id(engine) in engines):
                engines.add(id(engine))
                ops.append((i, length, IoOp(fd, offset, runs[i])))
        if ops:
            engine = self._fds[batch[ops[0][0]][0]][0]
            results = self._call(engine.read, [op for _, _, op in ops])
            for (i, length, op), got in zip(ops, results):
                if not isinstance(got, OSError):
                    out[i] = bytes(op.run.view[:min(got, length)])
        for run in runs:
            run.view.release()
        for i, (path, offset, length) in enumerate(batch):
            if out[i] is None:  # failed in the batch, or not in it: alone
                try:
                    out[i] = self.read(path, offset, length)
                except OSError as e:
                    out[i] = e.with_traceback(None)
        return [x for x in out if x is not None]

    def read_pages(self, path: str, offset: int, length: int) -> tuple[bytes, list[Unreadable]]:
        """Like :meth:`read`, but a failed read is read again page by page: the pages
        that fail again come back zeroed (a zero page holds no slot magic) and listed,
        neighbours merged; the rest as read.  Short at end of file as :meth:`read`."""
        try:
            return self.read(path, offset, length), []
        except OSError as e:
            if path not in self._fds:  # it did not even open: all of it, one range
                return b"", [Unreadable(offset, length, e.with_traceback(None))]
        out = bytearray()
        bad: list[Unreadable] = []
        for page in range(offset, offset + length, PAGE):
            want = min(PAGE, offset + length - page)
            try:
                got = self.read(path, page, want)
            except OSError as e:
                if bad and bad[-1].offset + bad[-1].length == page:
                    bad[-1] = Unreadable(bad[-1].offset, bad[-1].length + want, bad[-1].error)
                else:  # (kept without its traceback: its frames hold views of the buffer)
                    bad.append(Unreadable(page, want, e.with_traceback(None)))
                got = bytes(want)
            out += got
            if len(got) < want:
                break
        return bytes(out), bad

    def close(self) -> None:
        for engine, fd in self._fds.values():
            engine.close_file(fd)
        self._fds.clear()
        self._stack.close()

    def __enter__(self) -> ExtentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_slot(raw: bytes | OSError, key: bytes | None, entry: IndexEntry | None,
                deep: bool) -> SlotHeader:
    """The slot's header if ``raw`` (a read of it: its error raised) verifies as the
    store's reads check it (and, ``deep``, its payload's CRC); else CorruptionError."""
    if isinstance(raw, OSError):
        raise raw
    header = check_slot(raw, key, entry)  # the store's reads check exactly this
    if header.slot_len > len(raw) and deep:
        raise CorruptionError("slot runs past the end of its extent")
    if deep:
        check_payload(raw, header)
    return header


def verified_slots(reader: ExtentReader, path: str, offset: int, length: int,
                   unreadable: Callable[[Unreadable], None]) -> Iterator[tuple[int, SlotHeader]]:
    """Offsets (and headers) in [offset, offset+length) where a whole slot (header and
    payload) verifies; ``unreadable`` is told of each range no read could get (once),
    and no slot that touches one is yielded.

    A verified slot is skipped over whole: a slot written later inside it would have
    overwritten part of its payload and failed its CRC, so nothing newer hides there.
    """
    told: set[int] = set()  # first pages of the ranges told already

    def read(at: int, n: int) -> tuple[bytes, bool]:
        data, bad = reader.read_pages(path, at, n)
        for b in bad:
            if b.offset not in told:
                told.update(range(b.offset, b.offset + b.length, PAGE))
                unreadable(b)
        return data, bool(bad)

    pos, end = offset, offset + length
    chunk_start, chunk = pos, b""
    while pos < end:
        if not chunk_start <= pos < chunk_start + len(chunk):
            chunk_start, (chunk, _) = pos, read(pos, min(SCAN_CHUNK, end - pos))
            if not chunk:
                return
        hit = chunk.find(b"KVSB", pos - chunk_start)
        if hit < 0:
            pos = chunk_start + len(chunk)
            continue
        if hit % PAGE:
            pos = chunk_start + round_up(hit)
            continue
        pos = chunk_start + hit
        try:
            header = SlotHeader.decode(chunk[hit:hit + SLOT_HEADER_BYTES])
            if header.slot_len > end - pos:
                raise CorruptionError("slot runs past the free run")
            raw, failed = read(pos, header.slot_len)
            if failed:
                raise CorruptionError("part of the slot cannot be read")
            verify_slot(raw, None, None, True)
        except KVStoreError:
            pos += PAGE
            continue
        yield pos, header
        pos += header.slot_len


def zero_page(path: str, offset: int) -> None:
    rewrite(path, offset, bytes(PAGE))


def rewrite(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | _NOFOLLOW)
    try:
        os.pwrite(fd, data, offset)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def extend(path: str, size: int) -> None:
    """A file cut short given its ``size`` back, allocated and zeroed as a new extent's
    (a put must never find a hole there on a full disk)."""
    fd = os.open(path, os.O_WRONLY | _NOFOLLOW)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_file(path: str) -> None:
    os.unlink(path)
    fsync_dir(os.path.dirname(path))
