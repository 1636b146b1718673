"""The claim transaction (issue 43's DESIGN.md, section 6.4, steps 2 and 4): an owner
takes space from the shared free pool into its ``claims`` rows, within the one capacity
every process sharing the store applies.

``used = extents x (extent_bytes - 4096) - free_bytes + lost`` (``lost``: free runs of
extents whose file is missing, which nobody can claim), read from the counters in the
claim's own write transaction (kvstore/index/space_counters.py).  Only a claim raises
``used`` (a commit moves bytes from claims to blocks, a delete or eviction from blocks to
pending, ripening from pending to free, a return from claims to free, a new extent adds
to both sides), so checking ``used + claim <= capacity`` here bounds ``used`` at every
commit, in every process.

:func:`claim_space` runs inside a write transaction of the index writer:

1. ``room = capacity - used``; less than ``want``: nothing is claimed, the answer says
   how much is short (the caller evicts ``short - pending_bytes``: space already coming
   back is not evicted for, as the allocator does in one process);
2. else the smallest pool run that holds ``largest`` (the batch's largest slot), then the
   largest runs, until ``want`` is covered (the last one split at a page); no run holds
   ``largest``: nothing is claimed, and the answer says ``grow``, as it does when the
   pool held less than ``want`` (a new extent's id is reserved in a transaction, its
   file made outside any: kvstore/index/index.py).

The other transactions on an owner's claims (the allocator runs them through
kvstore/core/claiming.py): :func:`ripen_into` (pending runs its reads no longer hold
join its claims: they are in its runtime free space already), :func:`return_runs`
(unreserved claimed runs back to the pool), :func:`claim_new_extent` (a new extent
recorded and claimed from in one transaction) and :func:`top_up` (riding along in a put's
commit: never short, never a new extent).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.disk.format import PAGE, round_up

if TYPE_CHECKING:
    from kvstore.index.index import Index

__all__ = ["Claimed", "claim_new_extent", "claim_space", "return_runs", "ripen_into",
           "top_up", "used_bytes"]

Txn = Any  # lmdb.Transaction (untyped module)


@dataclass
class Claimed:
    """What a claim transaction did: ``runs`` (extent, offset, length) now the owner's;
    ``short`` bytes the capacity lacked (nothing claimed); ``grow``: the capacity has
    room but the pool does not hold it (no run for the largest slot: nothing claimed; or
    fewer bytes than wanted: what it held is claimed), a new extent is needed;
    ``pending``: bytes of pending runs (coming back once ripe: not to be evicted for)."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)
    short: int = 0
    grow: bool = False
    pending: int = 0


def used_bytes(txn: Txn, index: Index, lost: Iterable[int] = ()) -> int:
    """The space the store uses, as of ``txn`` (the module docstring's formula)."""
    counters = index.space.read(txn)
    extents = txn.stat(index.extents)["entries"]
    extent_bytes = index.meta_records.extent_bytes_in(txn)
    gone = frozenset(lost)
    unclaimable = sum(length for extent, _, length in index.free_map.runs(txn)
                      if extent in gone) if gone else 0
    return int(extents) * (extent_bytes - PAGE) - (counters[b"free_bytes"] or 0) + unclaimable


def claim_space(txn: Txn, index: Index, owner: int, *, want: int, largest: int,
                capacity: int, lost: Iterable[int] = ()) -> Claimed:
    """Claim at least ``want`` bytes for ``owner`` (the module docstring's steps)."""
    pending = index.space.read(txn)[b"pending_bytes"] or 0
    want = round_up(max(want, largest), PAGE)
    room = capacity - used_bytes(txn, index, lost)
    if room < want:
        return Claimed(short=want - room, pending=pending)
    gone = frozenset(lost)
    runs = sorted((r for r in index.free_map.runs(txn) if r[0] not in gone),
                  key=lambda r: (r[2], r[0], r[1]))
    first = next((r for r in runs if r[2] >= largest), None)
    if first is None:
        return Claimed(grow=True, pending=pending)
    order = [first, *sorted((r for r in runs if r is not first),
                            key=lambda r: (-r[2], r[0], r[1]))]
    claimed: list[tuple[int, int, int]] = []
    left = want
    for extent, offset, length in order:
        if left <= 0:
            break
        take = min(length, left)
        index.space.claim(txn, index.free_map, owner, extent, offset, take)
        claimed.append((extent, offset, take))
        left -= take
    return Claimed(runs=claimed, grow=left > 0, pending=pending)


def ripen_into(txn: Txn, index: Index, owner: int, runs: list[tuple[int, int, int]]) -> None:
    """Pending ``runs`` no read of ``owner`` can still copy, into its claims
    (:meth:`~kvstore.index.space_counters.SpaceCounters.ripen` into the owner's claims
    as the map it gives them to); ``used`` is unchanged (pending and claimed both
    count)."""
    index.space.ripen(txn, index.space.owned(owner), runs)


def return_runs(txn: Txn, index: Index, owner: int, runs: Iterable[tuple[int, int, int]]
                ) -> list[tuple[int, int, int]]:
    """``owner``'s unreserved ``runs`` back to the pool; returns those not wholly in its
    claims (left as they are: a range still pending, its ripening not committed)."""
    mine, kept = index.space.owned(owner), []
    for run in runs:
        if mine.holds(txn, *run):
            mine.take(txn, *run)
            index.free_map.give(txn, *run)
        else:
            kept.append(run)
    return kept


def _room(txn: Txn, index: Index, capacity: int, lost: Iterable[int]) -> int:
    return (capacity - used_bytes(txn, index, lost)) // PAGE * PAGE


def claim_new_extent(txn: Txn, index: Index, owner: int, extent_id: int, extent_bytes: int,
                     *, want: int, capacity: int, lost: Iterable[int] = ()
                     ) -> tuple[int, int, int] | None:
    """Record the new extent (its file durable, its id reserved) and claim up to
    ``want`` bytes from its start, as far as the capacity has room: the run claimed."""
    index.add_extent(txn, extent_id, extent_bytes)
    take = min(round_up(want, PAGE), extent_bytes - PAGE, _room(txn, index, capacity, lost))
    if take <= 0:
        return None
    index.space.claim(txn, index.free_map, owner, extent_id, PAGE, take)
    return extent_id, PAGE, take


def top_up(txn: Txn, index: Index, owner: int, *, want: int, capacity: int,
           lost: Iterable[int] = ()) -> list[tuple[int, int, int]]:
    """Claim up to ``want`` bytes from the pool as far as the capacity has room (nothing
    evicted, no extent added): the runs claimed."""
    want = min(want, _room(txn, index, capacity, lost))
    if want < PAGE:
        return []
    return claim_space(txn, index, owner, want=want, largest=PAGE, capacity=capacity,
                       lost=lost).runs
