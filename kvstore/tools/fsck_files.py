"""fsck's reads and writes of extent files (kvstore/tools/fsck.py checks, fsck_rebuild.py
rebuilds).

Reads are aligned and, where the file system allows, ``O_DIRECT`` (what the device
holds, not the page cache).  An operator's tool reports what it cannot read instead of
stopping at it, so :meth:`ExtentReader.read_pages` narrows a failed read to the pages
that fail, each read alone (as the store's own reads are retried alone,
:func:`kvstore.io.coalesce.reread_failed`), and hands back what it could read with
those pages zeroed and listed (:class:`Unreadable`, with the kernel's errno).  What
could not be read is never repaired by writing over it: callers report it and leave it.
No path is followed through a link (``O_NOFOLLOW``: store_files.py).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstore.disk.extents import fsync_dir
from kvstore.disk.format import PAGE, SLOT_HEADER_BYTES, IndexEntry, SlotHeader, round_up
from kvstore.errors import CorruptionError, KVStoreError
from kvstore.io.slots import check_payload, check_slot

__all__ = ["SCAN_CHUNK", "ExtentReader", "Unreadable", "extend",
           "remove_file", "rewrite", "verified_slots", "verify_slot", "zero_page"]

SCAN_CHUNK = 8 << 20
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC  # extent files are never reached through a link


@dataclass(frozen=True)
class Unreadable:
    """Bytes ``[offset, offset + length)`` of a file that a read failed on."""

    offset: int
    length: int
    error: OSError

    def describe(self) -> str:
        return f"{self.length} bytes at {self.offset} cannot be read ({self.error.strerror})"


class ExtentReader:
    """Aligned reads of extent files, one descriptor per file, one buffer."""

    def __init__(self) -> None:
        self._buf = mmap.mmap(-1, SCAN_CHUNK)
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT | _NOFOLLOW)
            except OSError:
                self._fds[path] = os.open(path, os.O_RDONLY | _NOFOLLOW)
        return self._fds[path]

    def read(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (page-aligned); short at end of file; an
        ``OSError`` if any of it cannot be read."""
        out = bytearray()
        fd = self.fd(path)
        while len(out) < length:
            n = min(round_up(length - len(out)), SCAN_CHUNK)
            got = os.preadv(fd, [memoryview(self._buf)[:n]], offset + len(out))
            if got <= 0:
                break
            out += self._buf[:min(got, length - len(out))]
            if got < n:
                break
        return bytes(out)

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
        for fd in self._fds.values():
            os.close(fd)
        self._buf.close()


def verify_slot(raw: bytes, key: bytes | None, entry: IndexEntry | None,
                deep: bool) -> SlotHeader:
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
