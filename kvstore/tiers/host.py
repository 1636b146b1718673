"""What a tier may ask of the store that owns it: :class:`TierHost`, handed to the
tier at construction.  A tier never reaches into the store otherwise, so the store and
its tiers do not import each other (the store imports the tiers; a tier imports this).
The store's call paths reach the tiers the other way, through the Protocols of
:mod:`kvstore.core.tier_ports`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvstore.codecs.pipeline import CodecSpec
    from kvstore.core.deletes import DeleteWatch, DeleteWatches
    from kvstore.core.latency import Latency
    from kvstore.core.operations import Health, Operations
    from kvstore.core.puts import PutPath
    from kvstore.core.reads import VerifiedReads
    from kvstore.core.tier_ports import Tiers
    from kvstore.disk.format import IndexEntry, SlotHeader
    from kvstore.index.index import Index
    from kvstore.io.aligned import AlignedBuffer
    from kvstore.io.scheduler import IoScheduler
    from kvstore.stats import PutResult

__all__ = ["TierHost"]


class TierHost:
    """The store's side of a tier: look blocks up, read verified blocks and slots,
    promote blocks into the store (a local durable put), respect deletes, run background
    work in the store's task group as one of its calls (``aclose`` waits for it), count
    and time it, and reach the tier behind the store (a prefetch's remote fetch)."""

    def __init__(self, *, index: Index, reads: VerifiedReads, puts: PutPath,
                 deletes: DeleteWatches, ops: Operations, health: Health,
                 task_group: Callable[[], TaskGroup | None], counters: dict[str, int],
                 latency: Latency, scheduler: IoScheduler | None, tiers: Tiers) -> None:
        self._index, self._reads, self._puts, self._deletes = index, reads, puts, deletes
        self._ops, self._health, self._task_group = ops, health, task_group
        self._counters, self._latency, self._scheduler = counters, latency, scheduler
        self._tiers = tiers

    def lookup(self, keys: Sequence[bytes]) -> list[IndexEntry | None]:
        return self._index.get_entries(keys)

    def read_mark(self) -> AbstractContextManager[None]:
        """Around a :meth:`lookup` and the :meth:`read_blocks` of what it found (the
        store's read mark: no owner of the store reuses those slots meanwhile)."""
        return self._reads.marked()

    def pinned(self, keys: Sequence[bytes]) -> set[bytes]:
        """Which of ``keys`` are pinned (never evicted, from any tier)."""
        return self._index.pinned(keys)

    async def read_blocks(self, keys: Sequence[bytes], entries: Sequence[IndexEntry | None],
                          results: list[torch.Tensor | None]) -> None:
        """A prefetch's read of stored blocks into new tensors, verified (what fails is
        quarantined and left None), behind the reads a caller awaits."""
        await self._reads.read(keys, entries, [None] * len(keys), results, prefetch=True)

    def prefetch_awaited(self) -> AbstractContextManager[None]:
        """A caller waiting for a prefetch: the scheduler lets prefetch reads go meanwhile."""
        return (self._scheduler.prefetch_awaited() if self._scheduler is not None
                else nullcontext())

    def count(self, counter: str, n: int = 1) -> None:
        """Add to one of the store's counters (:data:`kvstore.stats.COUNTERS`)."""
        self._counters[counter] += n

    def timed(self, op: str) -> AbstractContextManager[None]:
        """One call of ``op`` in the store's latency histograms."""
        return self._latency.time(op)

    @property
    def has_remote(self) -> bool:
        """A tier behind the store (:meth:`fetch_missing` fetches from it)."""
        return self._tiers.remote is not None

    async def fetch_missing(self, keys: Sequence[bytes], since: DeleteWatch) -> None:
        """Blocks absent locally, fetched from the tier behind the store and stored
        (nothing without one); ``since``: the watch of deletes taken when it was asked."""
        if self._tiers.remote is not None:
            await self._tiers.remote.fetch_missing(keys, since)

    async def read_slot(self, key: bytes, buffer: AlignedBuffer
                        ) -> tuple[memoryview, SlotHeader] | None:
        """A stored block's verified slot bytes (:meth:`VerifiedReads.read_slot`)."""
        return await self._reads.read_slot(key, buffer)

    @property
    def accepts_writes(self) -> bool:
        return not self._ops.closed and not self._health.read_only

    async def promote(self, keys: Sequence[bytes], values: Sequence[torch.Tensor],
                      parents: Sequence[bytes | None], codec: CodecSpec, *,
                      background: bool, skip_deleted: DeleteWatch | None) -> PutResult:
        """Store blocks through the put path (``put_many``'s, with its dedup, backlog and
        durability); keys deleted since ``skip_deleted`` began are not stored."""
        return await self._puts.put_many(keys, values, parents, codec, background,
                                         skip_deleted)

    def watch_deletes(self, keys: Sequence[bytes], since: DeleteWatch | None = None
                      ) -> DeleteWatch:
        """Register keys about to be fetched for a promotion: pass the watch to
        :meth:`promote`, end it with :meth:`unwatch_deletes`.  ``since``: the watch the
        call took when it started (deletes since then count too)."""
        return self._deletes.watch(keys, since)

    def unwatch_deletes(self, watch: DeleteWatch) -> None:
        self._deletes.unwatch(watch)

    def spawn(self, work: Callable[[], Awaitable[None]]) -> bool:
        """Run ``work`` in the store's background task group, counted as a call in
        flight; False (not started) for a store not opened through ``kvstore.open()``."""
        group = self._task_group()
        if group is None:
            return False
        ops = self._ops

        async def tracked() -> None:
            with ops.track():
                await work()

        group.start_soon(tracked)
        return True
