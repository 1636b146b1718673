"""The store's event calls, ``subscribe`` and ``snapshot`` (docs/events.md).

Base classes of :class:`kvstore.Store` (:class:`StoreEvents`) and of
:class:`kvstore.BlockingStore` (:class:`BlockingEvents`), apart so that both stay
small; the work is in :mod:`kvstore.core.events` (the stream) and
:mod:`kvstore.core.snapshot` (the listing).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

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

__all__ = ["BlockingEvents", "StoreEvents"]

T = TypeVar("T")


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

    def snapshot(self, *, page_blocks: int = DEFAULT_PAGE_BLOCKS, order: str = KEY_ORDER,
                 tag_prefix: bytes | None = None) -> AsyncIterator[list[StoredBlock]]:
        """Every stored block, as pages of :class:`~kvstore.StoredBlock` (with its tag),
        each page one short read transaction (:mod:`kvstore.core.snapshot`).
        ``order="key"`` streams in key order; ``order="parents_first"`` lists each block
        after its parent when the parent is stored (it reads every page before the first
        is returned).  ``tag_prefix``: only the blocks whose tag starts with these bytes
        (an engine's scope; untagged blocks are left out).  Taken after
        :meth:`subscribe`, it and that subscription's events give the exact content
        (docs/events.md)."""
        self._ops.check_open()
        check_snapshot(page_blocks, order, tag_prefix)
        return snapshot_pages(self._snapshot_page, page_blocks, order, tag_prefix)

    async def _snapshot_page(self, after: bytes | None, limit: int) -> list[StoredBlock]:
        self._ops.check_open()
        with self._ops.track():  # aclose waits for a page being read
            return await anyio.to_thread.run_sync(read_page, self._parts.index.tags, after,
                                                  limit)


class _Facade(Protocol):
    """What :class:`BlockingEvents` needs of ``BlockingStore``."""

    @property
    def store(self) -> StoreEvents: ...  # the Store behind the facade

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...


class BlockingEvents:
    """``subscribe`` and ``snapshot`` for synchronous callers (``BlockingStore``)."""

    def subscribe(self: _Facade, *, max_events: int = DEFAULT_MAX_EVENTS) -> Subscription:
        """:meth:`Store.subscribe <kvstore.Store.subscribe>`, opened on the store's loop.
        Read it from any thread with ``next_nowait()``, which never waits; ``close()`` it
        from any thread."""
        async def opened() -> Subscription:
            return await self.store.subscribe(max_events=max_events).__aenter__()

        return self.call(opened)

    def snapshot(self: _Facade, *, page_blocks: int = DEFAULT_PAGE_BLOCKS,
                 order: str = KEY_ORDER, tag_prefix: bytes | None = None
                 ) -> Iterator[list[StoredBlock]]:
        """:meth:`Store.snapshot <kvstore.Store.snapshot>`: an iterator of pages, each
        read by one call on the store's loop."""
        check_snapshot(page_blocks, order, tag_prefix)
        facade = self

        async def start() -> AsyncIterator[list[StoredBlock]]:
            return facade.store.snapshot(page_blocks=page_blocks, order=order,
                                         tag_prefix=tag_prefix)

        async def next_page(pages: AsyncIterator[list[StoredBlock]]) -> list[StoredBlock] | None:
            return await anext(pages, None)

        source = self.call(start)  # a closed store refuses here, not at the first page

        def pages() -> Iterator[list[StoredBlock]]:
            while (page := facade.call(next_page, source)) is not None:
                yield page

        return pages()
