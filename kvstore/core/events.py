"""The store's event stream: what changes its content, to every subscriber, never waited for.

Events come from the index writer (:mod:`kvstore.index.journal`): after each commit that
changed content, :meth:`EventHub.publish` numbers the transaction's records (one ``seq``
per store open, from 1, in commit order) and offers them to every subscription, on the
writer thread.  An offer takes a lock for the length of one deque append (the
transaction's records, shared, not copied) and never waits for a consumer: each
:class:`Subscription` keeps at most ``max_events`` items, and what does not fit is
dropped, counted, and delivered in its place as one :class:`EventGap` naming the
``seq`` range lost, so the consumer knows to resynchronise (``Store.snapshot``).  A consumer that is slow, blocked, cancelled or gone costs the
store one bounded buffer, never a wait.

A subscription is registered by a job on the writer thread, so every transaction that
commits after ``Store.subscribe`` returned is journaled for it, and whatever committed
before is in any snapshot taken after: subscribe, then snapshot, then fold the events
(stored: add, the other kinds: remove; the later wins) reaches the store's state exactly.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from types import TracebackType

import anyio

from kvstore.index.journal import RESTORED, STORED, Record
from kvstore.index.writer import IndexWriter, loop_callback

__all__ = ["DEFAULT_MAX_EVENTS", "BlockEvent", "EventGap", "EventHub", "Subscription"]

DEFAULT_MAX_EVENTS = 65536
"""Items a subscription holds for its consumer before it drops (about 100 bytes each,
plus the block's tag, which is shared with the index writer's record, not copied)."""


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A change of the store's content, after the commit that made it durable.

    ``kind`` is one of ``"stored"``, ``"evicted"``, ``"deleted"``, ``"quarantined"``,
    ``"restored"``; ``key`` the block's key, ``parent`` its parent's key (None: the
    block starts a chain), ``tag`` the caller's tag of the block (``put_many(tags=)``;
    None: it has none).  ``seq`` numbers events in commit order, from 1 for each open
    of the store; within one transaction, in the order its changes were made."""

    seq: int
    kind: str
    key: bytes
    parent: bytes | None
    tag: bytes | None = None


@dataclass(frozen=True, slots=True)
class EventGap:
    """Events ``first_seq`` .. ``last_seq`` (``dropped`` of them) did not fit the
    subscription's buffer and are lost: what the consumer knows of the store is stale
    from here; take a snapshot to resynchronise."""

    first_seq: int
    last_seq: int
    dropped: int


class EventHub:
    """The subscriptions of one open store (a :class:`~kvstore.index.journal.JournalSink`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: tuple[Subscription, ...] = ()
        self._seq = 0
        self._closed = False
        self.published = 0  # events numbered (made while at least one subscriber was on)
        self.dropped = 0  # events dropped, over every subscription

    def wants(self) -> bool:
        """Whether the next transaction should be journaled (writer thread)."""
        return bool(self._subs)

    def publish(self, records: Sequence[Record]) -> None:
        """Number a committed transaction's records and offer them (writer thread).

        The records are shared, not copied: each subscription keeps a reference (the
        journal is not touched after its commit) and its consumer makes the
        :class:`BlockEvent` objects as it reads them, so the writer's cost per event is
        the journal's one append."""
        with self._lock:
            first = self._seq + 1
            self._seq += len(records)
            self.published += len(records)
            for sub in self._subs:
                self.dropped += sub.offer(first, records)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def attach(self, sub: Subscription) -> None:
        with self._lock:
            if not self._closed:
                self._subs = (*self._subs, sub)
                return
        sub.end()

    def detach(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    def close(self) -> None:
        """The store closes: every subscription ends once its consumer has read what it
        holds."""
        with self._lock:
            self._closed, subs, self._subs = True, self._subs, ()
        for sub in subs:
            sub.end()


class Subscription:
    """One consumer's bounded view of the event stream (``Store.subscribe``).

    An async context manager and an async iterator of :class:`BlockEvent` and
    :class:`EventGap`.  Iteration ends when the subscription is closed or the store is.
    Cancelling a consumer while it waits loses nothing: an item leaves the buffer only
    when it is returned."""

    def __init__(self, hub: EventHub, writer: IndexWriter, max_events: int) -> None:
        if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 1:
            raise ValueError(f"max_events must be a positive int, got {max_events!r}")
        self._hub, self._writer, self.max_events = hub, writer, max_events
        self._lock = threading.Lock()
        # One entry per transaction taken, (seq of its first record, its records), or a
        # gap; _pos is the next record of the head entry, _count what the buffer holds
        # (events and gaps), bounded by max_events.
        self._chunks: deque[tuple[int, Sequence[Record]] | EventGap] = deque()
        self._pos = 0
        self._count = 0
        self._gap: tuple[int, int, int] | None = None  # dropped, not yet in the buffer
        self._waiter: anyio.Event | None = None
        self._wake: Callable[[Callable[[], object]], object] | None = None
        self._ended = False
        self.dropped = 0  # events this subscription lost (reported as gaps)

    # ------------------------------------------------------------------ the store's side

    def offer(self, first: int, records: Sequence[Record]) -> int:
        """Take what fits of one transaction's records (numbered from ``first``); returns
        how many were dropped (writer thread; never waits)."""
        n = len(records)
        with self._lock:
            room, gap = self.max_events - self._count, self._gap
            # The consumer made room: the gap goes in first, if an event fits after it
            # (else the gap grows: two gaps never touch; an empty buffer hands it out).
            if gap is not None and room > 1:
                self._chunks.append(EventGap(*gap))
                gap, room, self._count = None, room - 1, self._count + 1
            # Once a gap is open, nothing more is taken until it is in the buffer: the
            # consumer must meet the gap before any event that follows it.
            take = 0 if gap is not None else min(max(room, 0), n)
            if take:
                self._chunks.append((first, records if take == n else records[:take]))
                self._count += take
            lost = n - take
            if lost:
                last = first + n - 1
                gap = (gap[0], last, gap[2] + lost) if gap is not None else \
                    (first + take, last, lost)
                self.dropped += lost
            self._gap = gap
            self._notify()
        return lost

    def end(self) -> None:
        with self._lock:
            self._ended = True
            self._notify()

    def _notify(self) -> None:
        waiter, wake = self._waiter, self._wake
        if waiter is not None and wake is not None:
            self._waiter = None
            with suppress(RuntimeError):  # the consumer's event loop has ended
                wake(waiter.set)

    # ------------------------------------------------------------------ the consumer's side

    async def __aenter__(self) -> Subscription:
        self._wake = loop_callback()
        # On the writer thread: transactions after this one are journaled for it.
        await self._writer.run(lambda txn: self._hub.attach(self))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop receiving; what the buffer holds is still returned, then iteration ends."""
        self._hub.detach(self)
        self.end()

    def pending(self) -> int:
        """Items waiting for the consumer (a gap not yet delivered counts as one)."""
        with self._lock:
            return self._count + (self._gap is not None)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> BlockEvent | EventGap:
        while True:
            with self._lock:
                item = self._pop()
                if item is not None:
                    return item
                if self._ended:
                    raise StopAsyncIteration
                self._waiter = waiter = anyio.Event()
            await waiter.wait()

    def next_nowait(self) -> BlockEvent | EventGap | None:
        """The next item if one is waiting (None if not), without awaiting."""
        with self._lock:
            return self._pop()

    def _pop(self) -> BlockEvent | EventGap | None:  # with the lock held
        chunks = self._chunks
        if chunks:
            head = chunks[0]
            self._count -= 1
            if isinstance(head, EventGap):
                chunks.popleft()
                return head
            first, records = head
            i = self._pos
            if i + 1 == len(records):
                chunks.popleft()
                self._pos = 0
            else:
                self._pos = i + 1
            return BlockEvent(first + i, *records[i])
        if self._gap is not None:
            gap, self._gap = self._gap, None
            return EventGap(*gap)
        return None

    def __repr__(self) -> str:
        return f"<Subscription max_events={self.max_events} dropped={self.dropped}>"


def fold(state: dict[bytes, bytes | None], item: BlockEvent) -> None:
    """Apply one event to a ``key -> parent`` view of the store (stored and restored
    add, the rest remove): what a consumer does after a snapshot."""
    if item.kind in (STORED, RESTORED):
        state[item.key] = item.parent
    else:
        state.pop(item.key, None)

