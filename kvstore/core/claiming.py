"""This owner's claims (issue 43): the space its allocator places slots in, taken from the
pool every process sharing the store draws on (kvstore/index/claims.py, FORMAT.md
"Allocation").

The allocator's runtime free space (:class:`~kvstore.core.free_space.FreeSpace`) is this
owner's claims minus its reservations, plus the pending ranges its reads released and a
commit has not yet moved into its claims; it is empty at open (an owner's claims go back
to the pool when it closes or dies).  Placing a slot there needs no transaction.  When a
batch does not fit it:

- :meth:`OwnClaims.claim`: one transaction on the writer thread: ripened ranges into the
  claims, then (when the capacity lacks room for the batch beside what this owner holds)
  every unreserved claimed run back to the pool, then a claim of a quantum ``Q``
  (``claim_space``: capacity checked against the counters, in the transaction);
- :meth:`OwnClaims.grow`: no pool run holds the batch: an extent id reserved, the file
  made outside any transaction, then one transaction records it and claims from it.

Top-up and returns ride along in the put's commit (:class:`CommitSpace`): a claim of
``Q`` when the unreserved claimed space fell below ``Q/2`` (within the room the capacity
has: never an eviction, never an extent), the largest runs beyond ``Q`` back to the pool
when it exceeds ``2Q``.  ``Q`` = clamp(4 x the largest batch, 16 MiB, 256 MiB), at most
a quarter of the capacity shared by the owners counted in its last claim transaction
(capacity / (4 x owners); at least the batch): idle claims of the owners cannot hold
the room another one needs (they count as used, DESIGN 6.3; and they come back when
asked: kvstore/core/claim_requests.py).

``used`` for the capacity is the counters' (claims count as used, whoever holds them);
what this owner reports (:attr:`Allocator.used_bytes
<kvstore.core.allocator.Allocator.used_bytes>`) leaves out its own unreserved claimed
space, so one owner's numbers are what they were before claims.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from kvstore.disk.extents import remove_new_extent_file
from kvstore.disk.format import PAGE, round_up
from kvstore.index.claims import (
    Claimed,
    claim_new_extent,
    claim_space,
    return_runs,
    ripen_into,
    top_up,
    used_bytes,
)
from kvstore.io.extent_files import create_extent_file

if TYPE_CHECKING:
    from kvstore.core.free_space import FreeSpace, ReadEpochs
    from kvstore.index.free_map import FreeMap
    from kvstore.index.index import Index, IndexWriter, Txn
    from kvstore.io.protocol import IOEngine

__all__ = ["CommitSpace", "OwnClaims"]

QUANTUM_MIN, QUANTUM_MAX = 16 << 20, 256 << 20
Run = tuple[int, int, int]


@dataclass
class CommitSpace:
    """What a put's commit transaction does to its owner's claims, before and after it
    indexes the blocks (:meth:`OwnClaims.for_commit`); :meth:`done` or :meth:`failed`
    on the event loop once it is known whether the transaction committed."""

    claims: OwnClaims
    ripe: list[Run]
    want: int  # top-up (0: none)
    returning: list[Run]  # unreserved runs going back to the pool
    owned: FreeMap
    claimed: list[Run] = field(default_factory=list)
    kept: list[Run] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.want or self.returning:
            self.claims.busy += 1  # (its claims change: see OwnClaims.busy)

    def before(self, txn: Txn) -> None:
        """Ranges no read of this owner holds any more join its claims first: a slot
        this commit indexes may lie in one."""
        ripen_into(txn, self.claims.index, self.claims.owner, self.ripe)

    def after(self, txn: Txn) -> None:
        c = self.claims
        self.kept = return_runs(txn, c.index, c.owner, self.returning)
        self.claimed = top_up(txn, c.index, c.owner, want=self.want, capacity=c.capacity(),
                              lost=c.space.lost) if self.want else []

    def done(self) -> None:
        self.claims.give([*self.claimed, *self.kept])
        self._settled()

    def failed(self) -> None:
        self.claims.epochs.unripe(self.ripe)  # still pending
        self.claims.give(self.returning)
        self._settled()

    def _settled(self) -> None:
        if self.want or self.returning:
            self.claims.settled()


class OwnClaims:
    """The claims of owner ``owner`` and the transactions that change them (the module
    docstring).  ``capacity``: the allocator's capacity, read when needed;
    ``on_extent``: told of each extent the first time space in it becomes this owner's
    (before any of it can be placed: its owner opens the file, see
    :class:`~kvstore.core.allocator.Changes`); ``on_change``: told when a change of
    the claims settled.

    ``busy``: transactions in flight that change this owner's claims.  Meanwhile the
    counters and the runtime free space disagree (runs claimed and committed, not yet
    free here; runs taken out to return, not yet returned), so a reserve that would
    decide from them (evict, refuse) waits for them to settle instead."""

    def __init__(self, *, path: str, index: Index, writer: IndexWriter, engine: IOEngine,
                 owner: int, space: FreeSpace, epochs: ReadEpochs, extent_bytes: int,
                 store_uuid: bytes, file_mode: int, capacity: Callable[[], int],
                 on_extent: Callable[[int], None], on_change: Callable[[], None]) -> None:
        self._path, self.index, self._writer, self._engine = path, index, writer, engine
        self.owner, self.space, self.epochs, self.capacity = owner, space, epochs, capacity
        self._extent_bytes, self._uuid, self._file_mode = extent_bytes, store_uuid, file_mode
        self.withdrawn = 0  # claimed bytes of added extents that could not be opened
        self._largest = 0  # the largest batch seen (bytes)
        self.grown = 0  # extents this owner added
        self._grow_lock: anyio.Lock | None = None
        self._on_extent, self._reported = on_extent, set[int]()
        self._seen: int | None = None  # the store's used bytes, last read
        self.busy, self._on_change = 0, on_change
        self.gave_back = False  # it answered a request since it last claimed (no top-up)
        self.owners = 1  # owners of the store, counted in its last claim transaction

    def start(self) -> None:
        self._grow_lock = anyio.Lock()

    def used(self) -> int:
        """The store's used bytes, every owner's claims included (the counters)."""
        with self.index.begin() as txn:
            self._seen = used_bytes(txn, self.index, self.space.lost)
        return self._seen

    def seen_used(self) -> int:
        """:meth:`used` as last read, unless this owner's claims changed since (other
        owners' claims may have: a statistic's value, no capacity decision)."""
        return self.used() if self._seen is None else self._seen

    def changed(self) -> None:
        self._seen = None  # (this owner claimed or returned space)

    def settled(self) -> None:
        """A change of the claims counted in ``busy`` is over (done or not)."""
        self.busy -= 1
        self.changed()
        self._on_change()

    def pool_free(self) -> int:
        with self.index.begin() as txn:
            return self.index.space.read(txn)[b"free_bytes"] or 0

    def quantum(self, total: int = 0) -> int:
        """``Q`` (the module docstring), for a batch of ``total`` bytes."""
        self._largest = max(self._largest, total)
        share = self.capacity() // (4 * max(1, self.owners))  # (the owners seen last)
        q = min(max(4 * self._largest, QUANTUM_MIN), QUANTUM_MAX, share)
        return round_up(max(q, total, PAGE), PAGE)

    async def more(self, total: int, largest: int, room: int, *, grow: bool
                   ) -> tuple[int, bool]:
        """This owner's space cannot place a batch of ``total`` bytes: claim from the
        pool, or (``grow``: a claim did not help) add an extent and claim from it.
        Returns the bytes the capacity lacked (a claim that found less room than
        ``room``, the last look: other owners claimed it; evicted for as any shortfall)
        and whether the next try adds an extent."""
        if not grow:
            got = await self.claim(total, largest, room)
            if got.short:
                return got.short, False
            if got.runs or not got.grow:
                return 0, True
        await self.grow(total, room)
        return 0, False

    async def claim(self, total: int, largest: int, room: int) -> Claimed:
        """Claim room for a batch of ``total`` bytes (largest slot ``largest``) that
        does not fit this owner's free space; ``room``: the capacity's room as last
        read.  What is claimed is free space of this owner's on return."""
        spare = self.space.take_runs() if room < total else []
        want = self.quantum(total)
        ripe = self.epochs.take_ripe()
        self.busy += 1
        self.gave_back = False  # (its own reserve needs space: top-ups again)
        index, owner, capacity, lost = self.index, self.owner, self.capacity(), self.space.lost

        def job(txn: Txn) -> tuple[Claimed, list[Run]]:
            self.owners = index.owner_records.count(txn)  # (sizes the next quanta)
            ripen_into(txn, index, owner, ripe)
            kept = return_runs(txn, index, owner, spare)
            room_now = capacity - used_bytes(txn, index, lost)
            claimed = claim_space(txn, index, owner, want=want if room_now >= want else total,
                                  largest=largest, capacity=capacity, lost=lost)
            return claimed, kept

        try:
            claimed, kept = await self._writer.run(job)
        except BaseException:
            self.epochs.unripe(ripe)
            self.give(spare)
            raise
        else:
            self.give([*claimed.runs, *kept])
        finally:
            self.settled()
        return claimed

    async def give_back_all(self) -> int:
        """Every unreserved claimed run back to the pool, in one transaction (another
        owner asked: kvstore/core/claim_requests.py); returns the bytes returned.  Ranges
        its reads released join the claims first in the same transaction, so they go
        back too."""
        spare = self.space.take_runs()
        self.gave_back = True
        if not spare:
            return 0
        ripe = self.epochs.take_ripe()
        self.busy += 1
        index, owner = self.index, self.owner

        def job(txn: Txn) -> list[Run]:
            ripen_into(txn, index, owner, ripe)
            return return_runs(txn, index, owner, spare)

        try:
            kept = await self._writer.run(job)
        except BaseException:
            self.epochs.unripe(ripe)
            self.give(spare)
            raise
        else:
            self.give(kept)
        finally:
            self.settled()
        return sum(run[2] for run in spare) - sum(run[2] for run in kept)

    async def grow(self, total: int, room: int) -> int | None:
        """Add one extent file (durably), record it and claim from it; returns its id
        (None: another task of this owner added one meanwhile: look again)."""
        assert self._grow_lock is not None, "Allocator.start() was not called"
        before = self.grown
        async with self._grow_lock:
            if self.grown != before:
                return None
            index, owner = self.index, self.owner
            # Reserved in a transaction first: another process sharing the store may
            # grow it at the same moment, and must get another id.
            extent_id = await self._writer.run(
                lambda txn: index.reserve_extent_id(txn, owner))
            await create_extent_file(self._engine, self._path, extent_id, self._extent_bytes,
                                     self._uuid, self._file_mode)
            spare = self.space.take_runs() if room < total else []
            want, capacity, lost = self.quantum(total), self.capacity(), self.space.lost
            extent_bytes = self._extent_bytes

            def job(txn: Txn) -> tuple[Run | None, list[Run]]:
                kept = return_runs(txn, index, owner, spare)
                return claim_new_extent(txn, index, owner, extent_id, extent_bytes,
                                        want=want, capacity=capacity, lost=lost), kept

            self.busy += 1
            try:
                run, kept = await self._writer.run(job)
            except BaseException:
                # Not indexed (the commit failed: e.g. no room for the index on a full
                # disk): the file goes, and with it the space it took from the index.
                self.give(spare)
                self.settled()
                await anyio.to_thread.run_sync(remove_new_extent_file, self._path, extent_id)
                raise
            self.give([*kept, *([run] if run else [])])
            self.settled()
            self.grown += 1
            return extent_id

    def withdraw_extent(self, extent_id: int, *, missing: bool = False) -> None:
        """An added extent its owner could not open: its claimed space goes out of use
        (still claimed: it goes back to the pool when this owner closes).  ``missing``:
        its file is gone (deleted while the store was open), so, as for an extent found
        missing at open, none of its space is claimed or handed out again (the pool's
        runs of it included)."""
        for run in [r for r in self.space.runs() if r[0] == extent_id]:
            self.space.withdraw(*run)
            self.withdrawn += run[2]
        if missing:
            self.space.lose(extent_id)

    def for_commit(self) -> CommitSpace:
        """What the next put commit does to the claims (top-up, returns: the module
        docstring); take it in the step that submits the commit."""
        q, free = self.quantum(), self.space.free_bytes
        returning = self.space.take_runs(free - q) if free > 2 * q else []
        # (no top-up while the capacity had no room at the last look: a full store
        # would try in every commit; the claim a reserve runs when it must stays)
        room = self.capacity() - self.seen_used()
        # (nor after it gave its claims back to another owner's request: that owner
        # needs them; this one claims again when one of its own reserves must)
        want = min(q, room) if free < q // 2 and room >= PAGE and not self.gave_back else 0
        return CommitSpace(self, self.epochs.take_ripe(), want, returning,
                           self.index.space.owned(self.owner))

    def give(self, runs: Sequence[Run]) -> None:
        """``runs`` are this owner's free space (again)."""
        for run in runs:
            self.note(run[0])
            self.space.free(*run)

    def note(self, extent_id: int) -> None:
        """Space of ``extent_id`` becomes this owner's (claimed, or freed by it: it may
        have been another owner's extent).  An extent whose file is missing is never
        reported: none of its space is handed out, and the open a report asks of the put
        path would fail that put (a freed slot of it: a delete, a displaced quarantine)."""
        if extent_id not in self._reported and extent_id not in self.space.lost:
            self._reported.add(extent_id)
            self._on_extent(extent_id)
