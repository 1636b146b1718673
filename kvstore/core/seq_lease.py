"""Sequence numbers across the processes sharing a store (issue 43; DESIGN.md 8.3).

Every slot a put writes gets a store-wide sequence number (FORMAT.md, "Index": it tells
two writes of one key apart).  An owner counted on from the ``seq`` meta record: two
processes would have handed out the same numbers.  Now each owner *leases* a range
(:data:`SEQ_LEASE` numbers) in a write transaction, raising ``seq`` past it (the first
lease in its registration, the next ones when one runs out), and numbers its slots
from its lease alone: numbers are unique among all owners' slots, committed or not.
Numbers of a lease its owner did not use (it closed, or was killed) are skipped.
"""

from __future__ import annotations

from typing import Any

import anyio

from kvstore.index.index import Index, IndexWriter

__all__ = ["SEQ_LEASE", "SeqLease"]

Txn = Any  # lmdb.Transaction (untyped module)

SEQ_LEASE = 1 << 16
"""Numbers one lease holds: one write transaction per 65,536 slots written."""


class SeqLease:
    """An owner's sequence numbers: ``[next, end)``, renewed when they run out."""

    def __init__(self, first: int, *, size: int | None = None) -> None:
        self.size = SEQ_LEASE if size is None else size
        self.next, self.end = first, first + self.size
        self._renewing: anyio.Lock | None = None  # made on the event loop

    @staticmethod
    def lease_in(txn: Txn, index: Index, size: int | None = None) -> int:
        """Lease ``size`` numbers (:data:`SEQ_LEASE`) in ``txn`` (writer thread); returns
        the first."""
        return index.meta_records.lease_seq(txn, SEQ_LEASE if size is None else size)

    def take(self, n: int) -> list[int]:
        """``n`` numbers of the lease (there must be enough: :meth:`ensure`)."""
        assert self.next + n <= self.end, "SeqLease.ensure was not awaited"
        first, self.next = self.next, self.next + n
        return list(range(first, first + n))

    async def ensure(self, n: int, index: Index, writer: IndexWriter) -> None:
        """Make sure ``n`` numbers are left, leasing a new range (of at least ``n``) if
        not; the rest of the old one is skipped."""
        if self.next + n <= self.end:
            return
        if self._renewing is None:
            self._renewing = anyio.Lock()
        async with self._renewing:
            if self.next + n <= self.end:
                return  # another put renewed it meanwhile
            size = max(self.size, n)
            first = await writer.run(lambda txn: self.lease_in(txn, index, size))
            self.next, self.end = first, first + size
