"""The store's event calls, ``Store.subscribe`` and ``Store.snapshot`` (docs/events.md).

A base class of :class:`kvstore.Store`, apart so that the store's coordinator stays
small; the work is in :mod:`kvstore.core.events` (the stream) and
:mod:`kvstore.core.snapshot` (the listing).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio

from kvstore.core.events import DEFAULT_MAX_EVENTS, Subscription
from kvstore.core.opening import StoreParts
from kvstore.core.operations import Operations
from kvstore.core.snapshot import (
    DEFAULT_PAGE_BLOCKS,
    KEY_ORDER,
    StoredBlock,
    check_snapshot,
    read_page,
    snapshot_pages,
)

__all__ = ["StoreEvents"]


class StoreEvents:
    """``subscribe`` and ``snapshot``, over the parts and calls of the store."""

    _parts: StoreParts
    _ops: Operations

    def subscribe(self, *, max_events: int = DEFAULT_MAX_EVENTS) -> Subscription:
        """The store's content changes from now on, as ``async with store.subscribe() as
        events: async for item in events`` (:mod:`kvstore.core.events`).

        A :class:`~kvstore.BlockEvent` per block stored (after the commit that made it
        durable), evicted, deleted, quarantined or restored, in commit order, and an
        :class:`~kvstore.EventGap` in place of what did not fit ``max_events`` items
        waiting for the consumer (also counted in ``stats().events_dropped``).  The store
        never waits for a subscriber.  It ends when the store closes."""
        self._ops.check_open()
        return Subscription(self._parts.events, self._parts.writer, max_events)

    def snapshot(self, *, page_blocks: int = DEFAULT_PAGE_BLOCKS, order: str = KEY_ORDER
                 ) -> AsyncIterator[list[StoredBlock]]:
        """Every stored block, as pages of :class:`~kvstore.StoredBlock`, each page one
        short read transaction (:mod:`kvstore.core.snapshot`).  ``order="key"`` streams
        in key order; ``order="parents_first"`` lists each block after its parent when the
        parent is stored (it reads every page before the first is returned).  Taken
        after :meth:`subscribe`, it and that subscription's events give the exact
        content (docs/events.md)."""
        self._ops.check_open()
        check_snapshot(page_blocks, order)
        return snapshot_pages(self._snapshot_page, page_blocks, order)

    async def _snapshot_page(self, after: bytes | None, limit: int) -> list[StoredBlock]:
        self._ops.check_open()
        with self._ops.track():  # aclose waits for a page being read
            return await anyio.to_thread.run_sync(read_page, self._parts.index, after, limit)
