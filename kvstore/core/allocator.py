"""Space of the extent files, owned by one object: the rules puts, gets, deletes and
eviction follow when they run at the same time live here and nowhere else.

Every byte of an extent's usable area (everything after its header page) is in exactly
one of these states:

``free``          in the runtime free map (:class:`FreeSpace`): this owner's claims
                  (kvstore/core/claiming.py), ready to allocate; or in the store's pool,
                  which any owner may claim;
``reserved``      allocated to a put in flight, not yet indexed;
``stored``        named by an index entry (or kept in quarantine for fsck);
``pending-free``  unindexed (delete, eviction) but possibly still being read by a get
                  that looked the block up before; it becomes free when every such read
                  has ended (read epochs, LevelDB's "obsolete files no live version
                  references").

``used_bytes`` is everything but ``free``; it never exceeds ``capacity_bytes``.  The
capacity is the store's, shared by every owner: the counters in the index count every
owner's claims as used, and a claim checks the capacity in its transaction; this owner's
``used_bytes`` leaves its own unreserved claims out.

Reserving (:meth:`Allocator.reserve`) is all-or-nothing per batch and never waits while
holding space, so puts cannot deadlock one another.  When a batch does not fit the
capacity it

1. counts pending-free space as already coming back (it must not evict for it);
2. evicts least-recently-used blocks that have no stored children, are not pinned and are
   not protected, until the rest of the shortfall is covered (no more: at most one block
   beyond what is needed);
3. if that is still not enough, waits for a change (a reader ends an epoch, another put
   ends or gives its reservation back) when one can come, and otherwise raises
   :class:`~kvstore.errors.CapacityError`.

Reserves that cannot be placed at once are served in arrival order (issue 31): every
``reserve`` draws a ticket as it starts; once one has to wait, or its first attempt (an
eviction, a new extent) did not place it, it is *in line*, and no reserve with a later
ticket tries until it is done (placed, refused or cancelled).  So a put waits at most for
the puts that reserved before it or during its first eviction (bounded overtaking: a put
that fits may still go while an eviction it did not need is being committed).  Without
this, a large batch was overtaken by every smaller put that fitted the space coming
back, for as long as they kept coming (and its eviction retried for ever, each pass
seeing other puts' changes).  Waiting reserves hold no space, so the puts they wait for
can always finish.

Protection is counted: every put in flight protects its own keys, its blocks' parents
and the stored blocks it deduplicated against, so eviction never cuts a chain under a
child that is being written.  An eviction that chose its blocks *before* a put protected
them can still commit after the put's decision; the put's commit therefore checks, in its
own transaction, that what it deduplicated against is still stored, and redoes the put
otherwise (:class:`~kvstore.index.index.ChainCut`).

The allocator calls nothing above it.  What it did that its owner must act on is
kept as :class:`Changes` and handed over: ``reserve`` returns it, and a reserve that
failed or was cancelled leaves it for :meth:`Allocator.take_changes` (so nothing is
lost).  The owner opens the extents it added before any of their space is written
(see :class:`Changes` for why that holds) and drops the blocks it evicted from the
memory tier.  The writes its owner wants in an eviction's transaction (the persisted
totals) are an argument of ``reserve`` and ``fit_capacity``.

The owner's rows of the LMDB ``claims`` table are the durable map of its space; this
module keeps their runtime mirror.  A batch that does not fit it claims more, or adds an
extent and claims from it (kvstore/core/claiming.py).  A reserved range leaves the
owner's claims in the transaction that indexes its block, so a crash before that commit
leaves the space claimed by a dead owner (back to the pool when it is recovered) and the
written bytes as reclaimable orphans (FORMAT.md, "Allocation").  Pending-free space is a ``pending`` row
in the index; once no read holds it, the put path's next commit moves it back to
``free`` before taking any slot (:class:`~kvstore.core.free_space.ReadEpochs`).
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import count
from typing import Protocol

import anyio

from kvstore.core.claim_requests import ClaimRequests
from kvstore.core.claiming import CommitSpace, OwnClaims
from kvstore.core.free_space import FreeSpace, ReadEpochs, wait_for_change
from kvstore.disk.format import PAGE, IndexEntry
from kvstore.errors import CapacityError
from kvstore.index.eviction import evictable_bytes
from kvstore.index.index import Index, IndexWriter, Touched, Txn
from kvstore.io.protocol import IOEngine

logger = logging.getLogger("kvstore.store")

_FIT_STEP = 256 << 20
"""Most bytes one eviction transaction frees when a store is opened with a smaller
capacity (a shrink by many GB is many commits, not one transaction of every block)."""


def _nothing(txn: Txn) -> None:
    pass


@dataclass
class Changes:
    """What the allocator did that its owner acts on (see the module docstring).

    ``new_extents``: extents added (file created, fdatasynced, indexed), or first
    claimed from (another owner added them), whose files the owner has not been told
    to open.  Their space is free from the moment they are
    added, yet no put can write there before the owner opened them: the space is handed
    out only by ``_place``, and a reserve returns in the same step as its ``_place``
    (no await between them), carrying every extent not reported yet; its caller opens
    them before its own next await.  So the first reserve that returns after a growth,
    whichever put's it is, reports the extent before any slot in it can be written.

    ``evicted``: keys of blocks evicted (unindexed, their space pending-free)."""

    new_extents: list[int] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)


class Slot(Protocol):
    """What the allocator needs of one block of a put: its size, and where it goes."""

    key: bytes
    parent: bytes | None
    slot_len: int
    extent: int
    offset: int


class Allocator:
    """Owns the extent files' space: free, reserved and pending-free; reserve, evict, grow."""

    def __init__(self, *, path: str, index: Index, writer: IndexWriter, engine: IOEngine,
                 extent_bytes: int, store_uuid: bytes, capacity_bytes: int | None,
                 lost_extents: Iterable[int] = (),
                 file_mode: int, counters: dict[str, int], owner_id: int = 0) -> None:
        self._path, self._index, self._writer = path, index, writer
        self.extent_bytes = extent_bytes
        self._counters = counters  # the store's: evicted_blocks, evicted_bytes
        self._changes = Changes()  # what its owner has not taken yet (take_changes)
        # Extents whose file is missing: their space is never handed out (a slot there
        # could not be written) and stays counted as used until fsck --repair drops them.
        self.space = FreeSpace(lost=lost_extents)  # empty: this owner claims nothing yet
        self.epochs = ReadEpochs(self.space, self._notify)
        self.claims = OwnClaims(  # owner_id: the store's (kvstore/core/owners.py)
            path=path, index=index, writer=writer, engine=engine, owner=owner_id,
            space=self.space, epochs=self.epochs, extent_bytes=extent_bytes,
            store_uuid=store_uuid, file_mode=file_mode, capacity=lambda: self.capacity_bytes,
            on_extent=self._changes_extent, on_change=self._notify)
        self.requests: ClaimRequests | None = None  # other owners' idle claims (the store's)
        self.reserved_bytes = 0
        self._protected: Counter[bytes] = Counter()
        self._touched: dict[bytes, int] = {}
        self._changed: anyio.Event | None = None
        self._generation = 0  # bumped by every change a waiting reserve could use
        self._tickets = count()  # reserves in arrival order
        self._waiting: list[int] = []  # sorted tickets of reserves that had to wait
        self.capacity_bytes = self.default_capacity() if capacity_bytes is None \
            else int(capacity_bytes)
        if self.capacity_bytes < PAGE:
            raise ValueError(f"capacity_bytes must be at least {PAGE}")
        self.peak_used_bytes = self.used_bytes

    def start(self) -> None:
        self.claims.start()  # (its lock is made on the event loop)

    # ------------------------------------------------------------------ accounting

    @property
    def used_bytes(self) -> int:
        """Stored, quarantined, reserved and pending-free bytes, and other owners'
        claims: what capacity bounds (the module docstring)."""
        return self._used(self.claims.used())

    def _used(self, store_used: int) -> int:
        return store_used - self.space.free_bytes - self.claims.withdrawn

    @property
    def free_bytes(self) -> int:
        """The pool's free bytes and this owner's unreserved claimed ones."""
        return self.claims.pool_free() + self.space.free_bytes

    def for_commit(self) -> CommitSpace:
        """What a put's commit does to this owner's claims (kvstore/core/claiming.py)."""
        return self.claims.for_commit()

    @property
    def pending_free_bytes(self) -> int:
        return self.epochs.held_bytes

    def default_capacity(self) -> int:
        """What the store already uses plus 90% of the file system's free space."""
        st = os.statvfs(self._path)
        return self.used_bytes + int(0.9 * st.f_bavail * st.f_frsize)

    def begin_read(self) -> int:
        return self.epochs.begin()

    def end_read(self, epoch: int) -> None:
        self.epochs.end(epoch)

    def release(self, entries: Iterable[IndexEntry]) -> None:
        """Space of unindexed blocks: free once no earlier reader can still be reading it."""
        for e in entries:
            self.claims.note(e.extent)  # (another owner's extent: opened before reuse)
            self.epochs.free(e.extent, e.offset, e.slot_len)

    def touch(self, keys: Iterable[bytes], when: int) -> None:
        """Remember gets' last use; written with the next transaction that evicts or commits
        (LRU order is a hint: after a crash it may lag by one transaction)."""
        for key in keys:
            self._touched[key] = when

    def take_touched(self) -> Touched:
        touched, self._touched = self._touched, {}
        return touched

    def _changes_extent(self, extent_id: int) -> None:
        self._changes.new_extents.append(extent_id)  # opened by the owner: Changes
        self._notify()  # (its space may be what a waiting reserve needs)

    def take_changes(self) -> Changes:
        """What was done since it was last taken (extents added, blocks evicted)."""
        changes, self._changes = self._changes, Changes()
        return changes

    # ------------------------------------------------------------------ puts in flight

    def protect(self, keys: Iterable[bytes]) -> None:
        """A put starts: these keys (its own, its blocks' parents and the stored blocks it
        deduplicated against) must not be evicted until :meth:`unprotect`."""
        self._protected.update(keys)

    def unprotect(self, keys: Iterable[bytes]) -> None:
        """A put ended (stored or not): its keys may be evicted now; waiters look again."""
        for key in keys:
            left = self._protected[key] - 1
            if left:
                self._protected[key] = left
            else:
                del self._protected[key]
        self._notify()

    async def reserve(self, items: Sequence[Slot], *,
                      ride_along: Callable[[Txn], None] = _nothing) -> Changes:
        """Give every item a slot within capacity, all or none, evicting and adding extents
        as needed; see the module docstring for the order of resorts.  Returns every
        change not taken yet (:class:`Changes`: the caller opens the new extents before
        its next await).  ``ride_along``: more writes in each eviction's transaction."""
        total = sum(item.slot_len for item in items)
        ticket = next(self._tickets)
        try:
            await self._reserve(items, total, ticket, ride_along)
        finally:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                self._notify()  # the next in line tries now
        return self.take_changes()  # (no await since _place: see Changes)

    async def _reserve(self, items: Sequence[Slot], total: int, ticket: int,
                       ride_along: Callable[[Txn], None]) -> None:
        first, claimed = True, False
        largest = max((item.slot_len for item in items), default=0)
        while True:
            if not first:  # its first look (and eviction) did not place it: in line
                self._wait_in_line(ticket)
            first = False
            self.epochs.release_ripe()  # (reads of other owners end unseen: look now)
            if self._waiting and self._waiting[0] < ticket:
                # An earlier reserve waits for space: after it, not around it.
                self._wait_in_line(ticket)
                await self._wait_for_change()
                continue
            # Inside its own claims a batch is within the capacity (each claim was
            # checked against it; unless the store uses more, as last seen: a smaller
            # capacity recorded meanwhile): placed with no look at the index.
            if self.claims.seen_used() <= self.capacity_bytes and self._place(items):
                return
            if self.claims.busy:  # (its claims are changing: see OwnClaims.busy)
                self._wait_in_line(ticket)  # its look did not place it: in line
                await self._wait_for_change()
                continue
            seen = self._generation
            store_used = self.claims.used()
            # (withdrawn claims count here: the claim transaction counts them as used)
            short = store_used - self.space.free_bytes + total - self.capacity_bytes
            if short <= 0:
                short, claimed = await self.claims.more(
                    total, largest, self.capacity_bytes - store_used, grow=claimed)
                if short <= 0:
                    continue
            evict = short - self.pending_free_bytes
            if evict > 0 and await self._evict(evict, ride_along):
                continue
            if seen != self._generation:
                # Puts ended or space came back while the claim or eviction ran (it saw
                # their blocks still protected): look again before concluding anything.
                continue
            if self.pending_free_bytes or self.reserved_bytes:
                # Space comes back when a reader ends its epoch or another put ends.  We
                # hold none, so the puts we wait for can always finish.
                self._wait_in_line(ticket)
                await self._wait_for_change()
                continue
            self._wait_in_line(ticket)  # (asking other owners for claims takes a while)
            if self.requests is not None and await self.requests.make_room(
                    ticket, store_used, partial(self._changed_since, seen)):
                continue
            raise _refused(total, self.capacity_bytes, self.used_bytes, self.requests)

    def _changed_since(self, generation: int) -> bool:
        return generation != self._generation

    def _place(self, items: Sequence[Slot]) -> bool:
        """Allocate every item, or none (no await in between: all-or-nothing)."""
        placed: list[Slot] = []
        for item in items:
            where = self.space.allocate(item.slot_len)
            if where is None:
                self._give_back(placed)
                return False
            item.extent, item.offset = where
            placed.append(item)
        self.reserved_bytes += sum(item.slot_len for item in items)
        self.peak_used_bytes = max(self.peak_used_bytes, self._used(self.claims.seen_used()))
        return True

    def _give_back(self, items: Sequence[Slot]) -> None:
        for item in items:
            self.space.free(item.extent, item.offset, item.slot_len)

    def unreserve(self, items: Sequence[Slot]) -> None:
        """A put failed or was cancelled before its commit: its slots are free again."""
        self._give_back(items)
        self.reserved_bytes -= sum(item.slot_len for item in items)
        if items:
            self._notify()

    def committed(self, items: Sequence[Slot]) -> None:
        """A put's reservation became stored blocks."""
        self.reserved_bytes -= sum(item.slot_len for item in items)

    # ------------------------------------------------------------------ waiting

    def _notify(self) -> None:
        self._generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _wait_in_line(self, ticket: int) -> None:
        if ticket not in self._waiting:
            bisect.insort(self._waiting, ticket)

    async def _wait_for_change(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await wait_for_change(self._changed, self.epochs,
                              self.requests.recover_dead if self.requests else None)

    # ------------------------------------------------------------------ evict, grow

    async def _evict(self, need: int, ride_along: Callable[[Txn], None]) -> int:
        """Evict least-recently-used leaf blocks (durably, like a delete) until ``need``
        bytes are unindexed; returns bytes freed.  Protected and pinned blocks are never
        chosen."""
        return self._evicted(await self._writer.run(partial(
            self._evict_in, need=need, protect=set(self._protected),
            touched=self.take_touched(), ride_along=ride_along)))

    def _evict_in(self, txn: Txn, *, need: int, protect: set[bytes], touched: Touched | None,
                  ride_along: Callable[[Txn], None]) -> list[tuple[bytes, IndexEntry]]:
        """The eviction transaction (writer thread), with the caller's ride-along writes."""
        chosen = self._index.evict(txn, need, protect, touched)
        ride_along(txn)
        return chosen

    def fit_capacity(self, *, ride_along: Callable[[Txn], None] = _nothing) -> None:
        """At open, before the store serves (open's worker thread: blocking): a store
        that uses more than ``capacity_bytes`` (reopened with a smaller one) evicts by
        the same rules as a put (least-recently-used leaves, never a pinned block or one
        whose chain a pinned block needs) until it fits, in transactions of at most
        ``_FIT_STEP`` bytes, each with ``ride_along``'s writes; what it evicted is in
        :meth:`take_changes`.  If what cannot be evicted (pinned blocks and their
        ancestors, quarantined blocks, extents whose file is missing) is over capacity
        by itself, :class:`~kvstore.errors.CapacityError` and nothing is evicted."""
        over = self.used_bytes - self.capacity_bytes
        if over <= 0:
            return
        with self._index.begin() as txn:
            freeable = evictable_bytes(txn, self._index.chains, self.space.lost)
        if freeable < over:
            raise _too_pinned_to_fit(self._path, self.used_bytes, self.capacity_bytes, freeable)
        blocks, freed = 0, 0
        while self.used_bytes > self.capacity_bytes:
            need = min(self.used_bytes - self.capacity_bytes, _FIT_STEP)

            evicted = self._writer.run_sync(partial(self._evict_in, need=need, protect=set(),
                                                    touched=None, ride_along=ride_along))
            if not evicted:  # cannot happen after the check above; never loop for ever
                raise CapacityError(28, f"store {self._path}: no more blocks to evict at open")
            self._evicted(evicted)
            blocks += len(evicted)
            freed += sum(e.slot_len for _, e in evicted)
        # No read holds what it evicted yet: to the pool, not this owner's claims.
        ripe, _ = self.epochs.take_ripe(), self.space.take_runs()
        self._writer.run_sync(lambda txn: self._index.space.ripen(txn, self._index.free_map, ripe))
        self.claims.changed()
        self.peak_used_bytes = self.used_bytes
        logger.info("kvstore %s: evicted %d blocks (%d bytes) at open to fit capacity_bytes=%d",
                    self._path, blocks, freed, self.capacity_bytes)

    def _evicted(self, evicted: list[tuple[bytes, IndexEntry]]) -> int:
        """Blocks an eviction unindexed: reported (:class:`Changes`), their space free once
        no earlier reader can still read it, counted; returns the bytes freed."""
        self._changes.evicted.extend(key for key, _ in evicted)
        self.release(e for _, e in evicted)
        freed = sum(e.slot_len for _, e in evicted)
        self._counters["evicted_blocks"] += len(evicted)
        self._counters["evicted_bytes"] += freed
        return freed

    def withdraw_extent(self, extent_id: int, *, missing: bool = False) -> None:
        """An added extent its owner could not open: its space goes out of use, as if
        it had never been added (it is indexed: the next open finds it); ``missing``:
        for good (:meth:`OwnClaims.withdraw_extent`).  Call it once every slot reserved
        in it was given back (``unreserve``)."""
        self.claims.withdraw_extent(extent_id, missing=missing)


def _refused(total: int, capacity: int, used: int, requests: ClaimRequests | None
             ) -> CapacityError:
    return CapacityError(
        28, f"a batch of {total} bytes does not fit capacity_bytes={capacity} ({used} "
        "used): every other block is pinned, has stored children or is being written"
        f"{requests.unanswered_note() if requests is not None else ''}. Unpin blocks, "
        "delete some, or raise capacity_bytes.")


def _too_pinned_to_fit(path: str, used: int, capacity: int, freeable: int) -> CapacityError:
    return CapacityError(
        28, f"store {path} uses {used} bytes, more than capacity_bytes={capacity}, and "
        f"evicting every block it may evict frees only {freeable}: the other "
        f"{used - freeable} bytes are pinned blocks (and the blocks of their chains), "
        "quarantined blocks or extents whose file is missing. Nothing was evicted. Open it "
        f"with capacity_bytes >= {used - freeable} (then unpin or delete blocks), or run "
        f"`python -m kvstore fsck {path} --repair` to reclaim quarantined and lost space.")
