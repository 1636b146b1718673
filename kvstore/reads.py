"""Every read of stored slots goes through :class:`VerifiedReads`.

A read runs inside a read epoch of the allocator (a block deleted or evicted after
its index lookup keeps its space until the read ended: no later put can overwrite
the slot mid-read), checks each slot's header against its index entry and its
payload CRC32C before a byte reaches the caller (G2), and moves a block that failed
either way out of the index in the same pass (quarantine), so that no lookup
promises it again.  Two forms:

* :meth:`VerifiedReads.read`: blocks decoded into tensors (a get, a prefetch),
  through the I/O engine and the staging arena;
* :meth:`VerifiedReads.read_slot`: one slot's verified bytes into a caller's aligned
  buffer (the remote tier's upload), on a worker thread with its own file descriptor,
  not through the arena nor the page cache.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from contextlib import nullcontext, suppress
from typing import TYPE_CHECKING

import anyio
import torch

from kvstore.errors import CorruptionError, KVStoreError
from kvstore.extents import extent_path
from kvstore.format import SLOT_HEADER_BYTES, IndexEntry, SlotHeader
from kvstore.io.scheduler import PREFETCH, as_class
from kvstore.slots import check_payload, check_slot

if TYPE_CHECKING:
    from kvstore.io.aligned import AlignedBuffer
    from kvstore.opening import StoreParts

__all__ = ["Failed", "VerifiedReads"]

logger = logging.getLogger("kvstore.store")

Failed = list[tuple[bytes, IndexEntry, str]]  # key, its entry, why


class VerifiedReads:
    """The reads of one open store (see the module docstring)."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        self._counters = parts.counters

    async def read(self, keys: Sequence[bytes], entries: Sequence[IndexEntry | None],
                   outs: Sequence[torch.Tensor | None], results: list[torch.Tensor | None],
                   *, prefetch: bool = False) -> None:
        """Read the blocks of ``entries`` (None: skipped) into ``results`` (into
        ``outs[i]`` where given).  A block that fails verification or cannot be read
        stays None and is quarantined before this returns.

        The epoch begins before this coroutine's first await: call it in the same step
        as the index lookup that produced ``entries``.  ``prefetch``: the reads queue
        behind gets and (mostly) behind puts."""
        corrupt: Failed = []
        unreadable: Failed = []
        allocator = self._parts.allocator
        epoch = allocator.begin_read()
        try:
            with as_class(PREFETCH) if prefetch else nullcontext():
                errors, nbytes = await self._parts.transfers.read(
                    list(keys), list(entries), list(outs), results, corrupt, unreadable)
            self._counters["read_errors"] += errors
            self._counters["prefetch_read_bytes" if prefetch else "read_bytes"] += nbytes
        finally:
            allocator.end_read(epoch)
        if corrupt or unreadable:
            await self.quarantine(corrupt, unreadable)

    async def quarantine(self, corrupt: Sequence[tuple[bytes, IndexEntry, str]],
                         unreadable: Sequence[tuple[bytes, IndexEntry, str]] = ()) -> None:
        """Move blocks that failed verification (``corrupt``) or could not be read at all
        (``unreadable``: I/O error, short read, missing extent) out of the index, in the
        same pass that found them, so that no lookup promises them again (a lookup that
        promised what a load cannot deliver made vLLM retry the load for ever).  Their
        space stays allocated for fsck, which reports them.  One warning per pass names
        the store and the first cause."""
        parts = self._parts
        bad = [*corrupt, *unreadable]
        self._counters["corrupt_blocks"] += len(corrupt)
        self._counters["quarantined_blocks"] += len(bad)
        if parts.memory is not None:
            parts.memory.discard([key for key, _, _ in bad])
        logger.warning(
            "kvstore %s: %d block(s) failed verification and %d could not be read; "
            "quarantined (answered as misses from now on; `python -m kvstore fsck %s` "
            "lists them). First: key %s: %s", parts.path, len(corrupt), len(unreadable),
            parts.path, bad[0][0].hex()[:32], bad[0][2])
        if parts.health.read_only:
            return
        moved = list({key: entry for key, entry, _ in bad}.items())
        with suppress(KVStoreError):
            await parts.writer.run(lambda txn: parts.index.quarantine_blocks(txn, moved))

    async def read_slot(self, key: bytes, buffer: AlignedBuffer
                        ) -> tuple[memoryview, SlotHeader] | None:
        """The verified slot bytes of a stored block, in ``buffer`` (valid until its
        next use), or None if it is gone (evicted, deleted) or fails verification (then
        fsck / the next get deal with it).  O_DIRECT where the store writes so: every
        block read this way (an upload's) would otherwise be read into the page cache
        once, crowding out what the node caches."""
        parts = self._parts
        entry = parts.index.get_entries([key])[0]
        if entry is None:
            return None
        epoch = parts.allocator.begin_read()
        try:
            return await anyio.to_thread.run_sync(
                _read_slot_file, extent_path(parts.path, entry.extent), entry, key,
                parts.engine.direct, buffer)
        finally:
            parts.allocator.end_read(epoch)


def _read_slot_file(path: str, entry: IndexEntry, key: bytes, direct: bool,
                    buffer: AlignedBuffer) -> tuple[memoryview, SlotHeader] | None:
    """On a worker thread: the slot's bytes read into ``buffer``, checked against its
    index entry (the CRC32C of MBs runs off the event loop)."""
    view = buffer.view(entry.slot_len)  # slots are page-aligned and page-padded
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            got = os.preadv(fd, [view], entry.offset)
        finally:
            os.close(fd)
        if got < SLOT_HEADER_BYTES + entry.payload_len:
            return None  # the extent ends early: not this slot any more
        header = check_slot(view, key, entry)
        check_payload(view, header)
    except (OSError, CorruptionError):
        return None
    return view[:SLOT_HEADER_BYTES + header.payload_len], header
