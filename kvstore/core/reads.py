"""Every read of stored slots goes through :class:`VerifiedReads`.

A read runs inside a read epoch of the allocator (a block deleted or evicted after
its index lookup keeps its space until the read ended: no later put can overwrite
the slot mid-read), checks each slot's header against its index entry and its
payload CRC32C before a byte reaches the caller (G2), and moves a block that failed
either way out of the index in the same pass (quarantine), so that no lookup
promises it again.  A read that failed with an I/O error is first tried again, alone
(:func:`kvstore.io.coalesce.reread_failed`): one flaky block never costs its
neighbours in a merged read.  Quarantine is a suspicion, not a verdict
(:mod:`kvstore.index.quarantine`): :meth:`VerifiedReads.recheck` reads quarantined
slots again and puts back what verifies.  Forms:

* :meth:`VerifiedReads.read`: blocks decoded into tensors (a get, a prefetch),
  through the I/O engine and the staging arena;
* :meth:`VerifiedReads.verify`: blocks checked, nothing decoded (the scrub);
* :meth:`VerifiedReads.recheck`: quarantined slots checked again, restored if whole;
* :meth:`VerifiedReads.read_slot`: one slot's verified bytes copied into a caller's
  aligned buffer (the remote tier's upload), a background read (gets go first).

Every form reads through the I/O engine and the staging arena (the engine's
descriptors: O_DIRECT where the store writes so), so the simulated engine's faults and
crashes reach each of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from typing import TYPE_CHECKING, Protocol

import torch

from kvstore.disk.format import IndexEntry, SlotHeader
from kvstore.errors import KVStoreError
from kvstore.index.quarantine import CORRUPT, OK, UNREADABLE, Quarantined, same_slot
from kvstore.io.scheduler import PREFETCH, as_class
from kvstore.io.transfers import Failed, ReadCounts, read_slot

if TYPE_CHECKING:
    from kvstore.core.allocator import Allocator
    from kvstore.core.operations import Health
    from kvstore.core.read_marks import ReadMarks
    from kvstore.index.index import Index, IndexWriter
    from kvstore.io.aligned import AlignedBuffer
    from kvstore.io.transfers import Transfers

__all__ = ["Failed", "VerifiedReads"]

logger = logging.getLogger("kvstore.store")


class Forgets(Protocol):
    """What a read needs of the tiers (kvstore.core.tier_ports.Tiers): blocks
    quarantined leave the memory tier."""

    def forget(self, keys: Sequence[bytes]) -> None: ...


class VerifiedReads:
    """The reads of one open store (see the module docstring)."""

    def __init__(self, *, path: str, index: Index, writer: IndexWriter, allocator: Allocator,
                 transfers: Transfers, health: Health, counters: dict[str, int],
                 memory: Forgets, marks: ReadMarks) -> None:
        self._path, self._index, self._writer = path, index, writer
        self.marks = marks
        self._allocator, self._transfers, self._health = allocator, transfers, health
        self._counters, self._memory = counters, memory
        # Blocks counted as quarantined while the store could not record it (read-only):
        # they stay indexed and fail again; ``quarantined_blocks`` counts each once.
        self._counted: set[tuple[bytes, int]] = set()
        self.on_unreadable: Callable[[], None] = lambda: None  # set by the store: rechecks

    @contextmanager
    def marked(self) -> Iterator[None]:
        """Around a lookup and the reads of the slots it found: this owner's read mark
        (kvstore/core/read_marks.py) is published before the lookup and withdrawn after
        the last read, so no owner of the store reuses those slots meanwhile."""
        mark = self.marks.begin()
        try:
            yield
        finally:
            self.marks.end(mark)
            # what was freed while it was published (its own quarantine, a delete) may
            # be free now: nobody else is told that this mark moved
            self._allocator.epochs.release_ripe()

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
        allocator = self._allocator
        epoch = allocator.begin_read()
        try:
            with as_class(PREFETCH) if prefetch else nullcontext():
                counts = await self._transfers.read(
                    list(keys), list(entries), list(outs), results, corrupt, unreadable)
            self._count(counts)
            self._counters["prefetch_read_bytes" if prefetch else "read_bytes"] += counts.nbytes
        finally:
            allocator.end_read(epoch)
        if corrupt or unreadable:
            await self.quarantine(corrupt, unreadable)

    async def verify(self, keys: Sequence[bytes], entries: Sequence[IndexEntry]
                     ) -> tuple[int, int]:
        """Check stored blocks (header against entry, payload CRC32C; nothing decoded)
        as background reads, quarantining what fails; returns (slot bytes read, blocks
        that failed).  Like :meth:`read`, call it in the step of the lookup."""
        corrupt: Failed = []
        unreadable: Failed = []
        allocator = self._allocator
        epoch = allocator.begin_read()
        try:
            with as_class(PREFETCH):
                counts = await self._transfers.verify(
                    list(keys), list(entries), [False] * len(keys), corrupt, unreadable)
            self._count(counts)
        finally:
            allocator.end_read(epoch)
        failed = await self.quarantine(corrupt, unreadable) if corrupt or unreadable else 0
        return counts.nbytes, failed

    def _count(self, counts: ReadCounts) -> None:
        self._counters["read_errors"] += counts.errors
        self._counters["read_retries"] += counts.retries

    async def quarantine(self, corrupt: Sequence[tuple[bytes, IndexEntry, str]],
                         unreadable: Sequence[tuple[bytes, IndexEntry, str]] = ()) -> int:
        """Move blocks that failed verification (``corrupt``) or could not be read at all
        (``unreadable``: I/O error after retries, short read, missing extent) out of the
        index, in the same pass that found them, so that no lookup promises them again
        (a lookup that promised what a load cannot deliver made vLLM retry the load for
        ever).  Their space stays allocated: an unreadable block is read again later
        (:mod:`kvstore.core.rechecks`), every quarantined one by the scrub and fsck, and put
        back if it verifies.  A verification failure that a later change of the index
        explains is no failure (:meth:`_raced`).  ``corrupt_blocks`` and
        ``quarantined_blocks`` count the blocks moved (each once, however many reads
        failed on it), and they alone leave the memory tier.  One warning per pass names
        the store and the first cause.  Returns how many blocks failed under their
        current entry."""
        moving = {key: (entry, False) for key, entry, _ in self._raced(corrupt)}
        moving.update((key, (entry, True)) for key, entry, _ in unreadable)
        if not moving:
            return 0
        causes = {key: why for key, _, why in [*corrupt, *unreadable]}
        done = Quarantined([], [], [])
        if not self._health.read_only:
            # A key with an older copy in quarantine: read that copy now; the transaction
            # keeps whichever copy verifies (kvstore.index.quarantine).
            with self.marked():
                displaced = {k: e for k, (e, _) in
                             self._index.quarantine_records.of(list(moving)).items()
                             if not same_slot(e, moving[k][0])}
                seen = {}
                if displaced:
                    outcomes = await self._check(list(displaced.items()))
                    seen = {k: (e, outcomes[k] == OK) for k, e in displaced.items()}
            items = [(k, e, unread) for k, (e, unread) in moving.items()]
            with suppress(KVStoreError):
                done = await self._writer.run(
                    lambda txn: self._index.quarantine_records.move(txn, items, seen))
            self._settled(done)
        moved = done.moved
        if self._health.read_only:  # nothing could be recorded: count each block once
            fresh = {(k, e.seq) for k, (e, _) in moving.items()} - self._counted
            self._counted |= fresh
            moved = [k for k, _ in fresh]
        if moved:
            self._memory.forget(moved)
            corrupt_moved = sum(not moving[k][1] for k in moved)
            self._counters["corrupt_blocks"] += corrupt_moved
            self._counters["quarantined_blocks"] += len(moved)
            logger.warning(
                "kvstore %s: %d block(s) failed verification and %d could not be read; "
                "quarantined (answered as misses until a re-read verifies them; `python -m "
                "kvstore fsck %s` lists them). First: key %s: %s", self._path, corrupt_moved,
                len(moved) - corrupt_moved, self._path, moved[0].hex()[:32], causes[moved[0]])
        if any(moving[k][1] for k in done.moved):
            self.on_unreadable()
        return len(moving)

    def _raced(self, corrupt: Sequence[tuple[bytes, IndexEntry, str]]
               ) -> list[tuple[bytes, IndexEntry, str]]:
        """The backstop of slot reuse across processes (DESIGN 7.4, docs/multiprocess.md):
        of the blocks that failed verification, those whose entry still names the slot
        that was read.  The others' entry is gone or names another slot or ``seq`` in a
        fresh read transaction: the block moved after the lookup (another owner deleted
        it and reused its slot), so the read is a miss, counted ``raced_reads``, neither
        quarantined nor warned about.  A slot under a current entry is never freed (the
        free is in the transaction that unindexes it), so no race explains a failure
        under an unchanged entry: that one is damage.  A block another read of this
        store has just quarantined (its record names the slot) is neither."""
        if not corrupt:
            return []
        keys = [key for key, _, _ in corrupt]
        current = self._index.get_entries(keys)
        gone = [k for k, c in zip(keys, current) if c is None]
        records = self._index.quarantine_records.of(gone) if gone else {}
        kept, raced = [], 0
        for failed, now in zip(corrupt, current):
            key, entry, _ = failed
            if now is not None and same_slot(now, entry):
                kept.append(failed)
            elif now is not None or key not in records \
                    or not same_slot(records[key][0], entry):
                raced += 1
        self._counters["raced_reads"] += raced
        return kept

    async def recheck(self, rows: Sequence[tuple[bytes, IndexEntry]]) -> Quarantined:
        """Read quarantined slots (``rows``: key, quarantined entry) again: one that
        verifies goes back into the index (or, if its key was stored again meanwhile,
        its space is freed: the block is stored elsewhere); one that fails keeps its
        record, with the latest cause.  Call it in the step of the lookup of ``rows``
        (the read epoch begins at once)."""
        outcomes = await self._check(rows)
        if self._health.read_only:
            return Quarantined([], [], [])
        done = await self._writer.run(lambda txn: self._index.quarantine_records.settle(
            txn, [(k, e, outcomes[k]) for k, e in rows]))
        self._settled(done)
        return done

    def _settled(self, done: Quarantined) -> None:
        """After a quarantine transaction: freed slots back to the allocator, restored
        blocks counted and logged."""
        self._allocator.release(done.freed)
        if done.restored:
            self._counters["restored_blocks"] += len(done.restored)
            logger.info("kvstore %s: %d quarantined block(s) verified when read again; "
                        "restored (hits again)", self._path, len(done.restored))

    async def _check(self, rows: Sequence[tuple[bytes, IndexEntry]]) -> dict[bytes, str]:
        """Read and check slots without quarantining anything: OK, CORRUPT or UNREADABLE
        per key.  The epoch begins at once (see :meth:`recheck`)."""
        keys = [k for k, _ in rows]
        verified = [False] * len(rows)
        corrupt: Failed = []
        unreadable: Failed = []
        allocator = self._allocator
        epoch = allocator.begin_read()
        try:
            counts = await self._transfers.verify(
                keys, [e for _, e in rows], verified, corrupt, unreadable)
            self._counters["read_retries"] += counts.retries
        finally:
            allocator.end_read(epoch)
        failed = {k for k, _, _ in corrupt}
        return {k: OK if ok else CORRUPT if k in failed else UNREADABLE
                for k, ok in zip(keys, verified)}

    async def read_slot(self, key: bytes, buffer: AlignedBuffer
                        ) -> tuple[memoryview, SlotHeader] | None:
        """The verified slot bytes of a stored block, in ``buffer`` (valid until its
        next use), or None if it is gone (evicted, deleted) or fails verification (then
        fsck / the next get deal with it): :func:`kvstore.io.transfers.read_slot`
        (through the engine, O_DIRECT where the store writes so)."""
        with self.marked():
            entry = self._index.get_entries([key])[0]
            if entry is None:
                return None
            epoch = self._allocator.begin_read()
            try:
                with as_class(PREFETCH):  # a background read: gets go first
                    return await read_slot(self._transfers, key, entry, buffer)
            finally:
                self._allocator.end_read(epoch)
