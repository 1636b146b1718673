"""A worker's reports of its store's content for vLLM's KV events
(:mod:`kvstore.integrations.vllm.rank_reports`), returned each step by the connector's
``get_kv_connector_kv_cache_events``.

The worker subscribes to its rank's store (``BlockingStore.subscribe``: a bounded
buffer the store fills after each commit and never waits for) and, each step, turns the
events of its key scope (the tag's prefix, :mod:`kvstore.integrations.vllm.block_tags`)
into reports: ``stored`` and ``restored`` into ``STORED``; ``evicted``, ``deleted`` and
``quarantined`` into ``REMOVED``.  With ``replay`` it then lists what the store already
holds of the scope (``snapshot(tag_prefix=scope, order="parents_first")``, subscribed
first so nothing falls between), one page per step, each block after its parent, so that a restarted engine announces its disk.  A gap
(the buffer overflowed) subscribes and replays again, after a ``RESYNC``.

``BUSY`` / ``SETTLED`` say whether more is to come (saves in flight, a replay
unfinished), so the scheduler keeps the engine stepping until it is out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from kvstore import BlockEvent, BlockingStore, EventGap, KVStoreError, StoredBlock, Subscription
from kvstore.integrations.vllm.block_tags import body_in_scope
from kvstore.integrations.vllm.rank_reports import BUSY, REMOVED, RESYNC, SETTLED, STORED, Report

__all__ = ["REPLAY_PAGE_BLOCKS", "WorkerEvents"]

# Blocks replayed per step: one short read transaction, and a report small enough to
# travel with the step's output (about 200 bytes a block).
REPLAY_PAGE_BLOCKS = 1024

_ADDS = ("stored", "restored")

logger = logging.getLogger("kvstore.integrations.vllm")


class WorkerEvents:
    """One rank's subscription and replay (module docstring).  ``busy()`` says whether
    the rank's saves are still in flight."""

    def __init__(self, store: BlockingStore, rank: int, busy: Callable[[], bool], *,
                 replay: bool, max_events: int = 65536,
                 page_blocks: int = REPLAY_PAGE_BLOCKS) -> None:
        self._store, self._rank, self._puts_busy = store, rank, busy
        self._replay, self._max_events, self._page = replay, max_events, page_blocks
        self._scope = b""
        self._epoch = 0
        self._sub: Subscription | None = None
        self._pages: Iterator[list[StoredBlock]] | None = None
        self._reported_busy: bool | None = None  # None: report the state next time

    def start(self, scope: bytes, epoch: int) -> None:
        """Follow ``scope`` (the rank's namespace digest) from now on, in the scheduler's
        key-scope ``epoch``: subscribe, then replay what the store holds of it."""
        self.close()
        self._scope, self._epoch = scope, epoch
        self._sub = self._store.subscribe(max_events=self._max_events)
        if self._replay:
            # Parents first: routers (Dynamo's) drop a block whose parent they do not
            # know.  It reads the scope's listing once (about 300 bytes a block).
            self._pages = self._store.snapshot(page_blocks=self._page, tag_prefix=scope,
                                               order="parents_first")
        self._reported_busy = None

    def take(self) -> list[Report]:
        """The step's reports (empty when nothing changed)."""
        if self._sub is None:
            return []
        # Saves in flight first: a put that is over has its events in the buffer
        # already (the store publishes before the call returns), so none is missed by
        # reading the buffer after.
        busy = self._puts_busy()
        reports: list[Report] = []
        while (item := self._sub.next_nowait()) is not None:
            if isinstance(item, EventGap):
                reports.append(self._report(RESYNC, b""))
                self.start(self._scope, self._epoch)
                return [*reports, *self.take()]
            self._event(item, reports)
        if self._pages is not None:
            try:
                page = next(self._pages, None)
            except (KVStoreError, RuntimeError) as e:  # the store closing or failing
                logger.warning("kvstore connector: replaying the store for KV events "
                               "stopped: %s", e)
                page = None
            if page is None or len(page) < self._page:  # (only the last page is short)
                self._pages = None
            reports.extend(self._report(STORED, body) for b in page or ()
                           if (body := body_in_scope(b.tag, self._scope)) is not None)
        busy = busy or self._pages is not None
        if busy is not self._reported_busy:
            reports.append(self._report(BUSY if busy else SETTLED, b""))
            self._reported_busy = busy
        return reports

    def _event(self, event: BlockEvent, reports: list[Report]) -> None:
        body = body_in_scope(event.tag, self._scope)
        if body is not None:
            reports.append(self._report(STORED if event.kind in _ADDS else REMOVED, body))

    def _report(self, kind: int, body: bytes) -> Report:
        return (self._rank, self._epoch, kind, body)

    def close(self) -> None:
        self._pages = None
        if self._sub is not None:
            self._sub.close()
            self._sub = None
