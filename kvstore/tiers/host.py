"""What a tier may ask of the store that owns it: :class:`TierHost`, handed to the
tier at construction.  A tier never reaches into the store otherwise, so the store and
its tiers do not import each other (the store imports the tiers; a tier imports this).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvstore.codecs.pipeline import CodecSpec
    from kvstore.core.deletes import DeleteWatch, DeleteWatches
    from kvstore.core.operations import Health, Operations
    from kvstore.core.puts import PutPath
    from kvstore.core.reads import VerifiedReads
    from kvstore.disk.format import IndexEntry, SlotHeader
    from kvstore.index.index import Index
    from kvstore.io.aligned import AlignedBuffer
    from kvstore.stats import PutResult

__all__ = ["TierHost"]


class TierHost:
    """The store's side of a tier: look blocks up, read a verified slot, promote blocks
    into the store (a local durable put), respect deletes, run background work in the
    store's task group as one of its calls (``aclose`` waits for it)."""

    def __init__(self, *, index: Index, reads: VerifiedReads, puts: PutPath,
                 deletes: DeleteWatches, ops: Operations, health: Health,
                 task_group: Callable[[], TaskGroup | None]) -> None:
        self._index, self._reads, self._puts, self._deletes = index, reads, puts, deletes
        self._ops, self._health, self._task_group = ops, health, task_group

    def lookup(self, keys: Sequence[bytes]) -> list[IndexEntry | None]:
        return self._index.get_entries(keys)

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
