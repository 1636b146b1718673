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

The store's allocator does not call it yet (one process allocates: the interim guard
of kvstore/core/owners.py); tests hold it to the bound with several owners of one index.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.disk.format import PAGE, round_up

if TYPE_CHECKING:
    from kvstore.index.index import Index

__all__ = ["Claimed", "claim_space", "used_bytes"]

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
