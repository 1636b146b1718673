"""A put that stores nothing of its own is acknowledged only once what it found is durable
(issue 43; docs/multiprocess.md, "Commits and durability across processes").

LMDB makes a commit visible to readers in every process when it writes the meta page,
before that page's fdatasync returns.  A put whose every block another owner stored
(it deduplicates them all, so it commits no transaction of its own) could otherwise be
acknowledged on a commit that a power cut still loses: G1 would not hold for it.  So on
a store opened with ``sync=True``, such a put first syncs the index (``env.sync``: an
fdatasync of ``data.mdb``, which makes every commit written so far durable) unless no
transaction committed since the last such sync.  A put that commits writes through the
same file and fdatasyncs it in its commit, so only the all-deduplicated put needs this.

Cost (``python benchmarks/dedup_barrier.py``: a put of 32 stored 64 KiB blocks,
io_uring, 600 of each kind, barrier on and off in one process): after a commit 309 us
p50 with the barrier (one sync, on a worker thread) against 170 us without; with no
commit since the last sync 157 against 188 us (no sync: the same within noise).  A put
that writes pays nothing.  Not built: the shared ``durable_txnid`` of
``owners/marks``, which would let it skip the sync when the committing process already
published that commit as durable (its own commits included: today any commit, even
this process's, makes the next all-deduplicated put sync).
"""

from __future__ import annotations

import anyio
import lmdb

from kvstore.index.index import Index
from kvstore.index.writer import lmdb_error

__all__ = ["DurableDedup"]


class DurableDedup:
    """The sync before an all-deduplicated put's acknowledgement (the module docstring)."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self.synced = 0  # every transaction up to this id is durable (a sync of ours)
        self.syncs = 0  # syncs made (tests)

    async def barrier(self) -> None:
        """Before acknowledging: every commit this owner could have looked up is durable."""
        newest = int(self._index.env.info()["last_txnid"])  # (read after the lookup)
        if newest <= self.synced:
            return
        await anyio.to_thread.run_sync(self._sync)  # (an fdatasync may wait on the device)
        self.synced = max(self.synced, newest)
        self.syncs += 1

    def _sync(self) -> None:
        try:
            self._index.env.sync(True)
        except lmdb.Error as e:
            raise lmdb_error(e, "syncing the index before acknowledging a put of blocks "
                             "stored by another owner failed", self._index.path) from e
