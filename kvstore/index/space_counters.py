"""The space counters of format 2 (FORMAT.md, "Meta records" and "Allocation"; issue 43)
and the upgrade of a version-1 store.

``free_bytes``, ``claimed_bytes`` and ``pending_bytes`` are the sums of the lengths in
the ``free``, ``claims`` and ``pending`` tables, changed in the same transaction as
their table (the free map reports every change: :class:`~kvstore.index.free_map.FreeMap`).
So the space a store uses, ``extents x (extent_bytes - 4096) - free_bytes``, is one read
in any transaction of any process, instead of a walk of the free map; it is what one
capacity shared by every process sharing the store is checked against.

``claims``: owner u32 BE || extent u32 BE || offset u64 BE -> run length u64 LE: space an
owner took from the free pool to allocate in alone.  ``pending``: txnid u64 BE || extent
u32 BE || offset u64 BE -> run length u64 LE: space freed by that transaction, not
reusable while a reader may still copy it.  An owner's claims go back to the pool when
it closes or when another owner finds it dead (kvstore/core/owners.py).  The store's
allocator places slots only inside its owner's claims (kvstore/core/claiming.py), and a
put's commit takes them out of them (:meth:`SpaceCounters.owned`).  Every range a running store unindexes goes to ``pending``
(:meth:`SpaceCounters.hold`); the owner that freed it moves it back to the pool once
none of its reads can still copy it (:meth:`SpaceCounters.ripen`, in its next commit),
and every pending run ripens when no owner is left (:meth:`SpaceCounters.ripen_all`:
the last close, a registration or fsck finding only dead owners).  fsck counts both
tables' rows as used space and checks their counters.

Upgrade (:meth:`SpaceCounters.upgrade`): one write transaction that re-reads the version
(another opener may have upgraded first: LMDB serializes writers) and, for version 1,
counts ``free_bytes`` from the ``free`` table, writes the other two as 0 and the new
version.  No data moves.  It runs under ``PATH/LOCK`` held shared: a version-1 build
takes ``LOCK`` exclusively, so none can be using the store meanwhile.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from kvstore.disk.format import pack_u64, unpack_u64
from kvstore.errors import IndexCorruptionError
from kvstore.index.free_map import FreeMap
from kvstore.index.meta import (
    META_CLAIMED_BYTES,
    META_FREE_BYTES,
    META_PENDING_BYTES,
    SPACE_COUNTERS,
    UPGRADABLE,
    MetaRecords,
)

__all__ = ["COUNTERS", "SpaceCounters", "claim_row", "pending_row"]

Txn = Any  # lmdb.Transaction (untyped module)

FREE, CLAIMED, PENDING = META_FREE_BYTES, META_CLAIMED_BYTES, META_PENDING_BYTES
COUNTERS = SPACE_COUNTERS

_CLAIM = struct.Struct(">IIQ")
_PENDING = struct.Struct(">QIQ")


def claim_row(key: bytes) -> tuple[int, int, int]:
    """(owner, extent, offset) of a ``claims`` key."""
    if len(key) != _CLAIM.size:
        raise IndexCorruptionError(f"a claims key has {len(key)} bytes, not {_CLAIM.size}")
    owner, extent, offset = _CLAIM.unpack(key)
    return int(owner), int(extent), int(offset)


def pending_row(key: bytes) -> tuple[int, int, int]:
    """(txnid, extent, offset) of a ``pending`` key."""
    if len(key) != _PENDING.size:
        raise IndexCorruptionError(f"a pending key has {len(key)} bytes, not {_PENDING.size}")
    txnid, extent, offset = _PENDING.unpack(key)
    return int(txnid), int(extent), int(offset)


class SpaceCounters:
    """The counters and the tables they sum (LMDB database handles of one index)."""

    def __init__(self, meta: Any, records: MetaRecords, free: Any, claims: Any,
                 pending: Any) -> None:
        self._meta, self._records = meta, records
        self._tables = {FREE: free, CLAIMED: claims, PENDING: pending}
        self.claims, self.pending = claims, pending

    def read(self, txn: Txn) -> dict[bytes, int | None]:
        """Each counter as recorded (None: absent or not 8 bytes)."""
        out: dict[bytes, int | None] = {}
        for name in COUNTERS:
            raw = txn.get(name, db=self._meta)
            out[name] = unpack_u64(bytes(raw)) if raw is not None and len(raw) == 8 else None
        return out

    def actual(self, txn: Txn) -> dict[bytes, int]:
        """What each counter must be: the sum of its table's run lengths."""
        out = {}
        for name, table in self._tables.items():
            with txn.cursor(table) as cur:
                out[name] = sum(unpack_u64(bytes(v)) for v in cur.iternext(keys=False))
        return out

    def add(self, txn: Txn, name: bytes, delta: int) -> None:
        """``delta`` bytes more (or fewer) in ``name``'s table, in ``txn``."""
        raw = txn.get(name, db=self._meta)
        value = (unpack_u64(bytes(raw)) if raw is not None and len(raw) == 8 else 0) + delta
        if value < 0:
            raise IndexCorruptionError(
                f"the {name.decode()} counter would drop below zero; run `python -m kvstore "
                "fsck --repair` on the store")
        txn.put(name, pack_u64(value), db=self._meta)

    def free_changed(self, txn: Txn, delta: int) -> None:
        self.add(txn, FREE, delta)

    def recount(self, txn: Txn) -> None:
        """Every counter set to its table's sum (a new store, an upgrade, fsck's repair)."""
        for name, value in self.actual(txn).items():
            txn.put(name, pack_u64(value), db=self._meta)

    def upgrade(self, txn: Txn) -> bool:
        """A version-1 store to this build's format (the module docstring); False if it
        needed none (another opener upgraded it first)."""
        if self._records.format_in(txn) not in UPGRADABLE:
            return False
        self.recount(txn)
        self._records.set_format(txn)
        return True

    # ------------------------------------------------------------------ claims

    def claim(self, txn: Txn, pool: FreeMap, owner: int, extent: int, offset: int,
              length: int) -> None:
        """Take ``[offset, offset + length)`` of ``extent`` from the pool (it must be
        free) into ``owner``'s claims, counters with it."""
        pool.take(txn, extent, offset, length)
        self.owned(owner).give(txn, extent, offset, length)

    def owned(self, owner: int) -> FreeMap:
        """``owner``'s claims as a free map of its own (runs kept maximal, the
        ``claimed_bytes`` counter with them): its put commits take their slots from it."""
        return FreeMap(self.claims, lambda txn, delta: self.add(txn, CLAIMED, delta),
                       prefix=_CLAIM.pack(owner, 0, 0)[:4])

    def claims_of(self, txn: Txn, owner: int) -> list[tuple[int, int, int]]:
        """``owner``'s claims: (extent, offset, length)."""
        prefix = _CLAIM.pack(owner, 0, 0)[:4]
        out = []
        with txn.cursor(self.claims) as cur:
            if cur.set_range(prefix):
                for k, v in cur:
                    if bytes(k[:4]) != prefix:
                        break
                    out.append((*claim_row(bytes(k))[1:], unpack_u64(bytes(v))))
        return out

    def return_claims(self, txn: Txn, pool: FreeMap, owner: int) -> int:
        """Every claim of ``owner`` back to the pool, merged with its neighbours (it
        closes, or it died: whatever it wrote there and did not commit is unreachable);
        returns the bytes returned."""
        runs = self.claims_of(txn, owner)
        for extent, offset, length in runs:
            txn.delete(_CLAIM.pack(owner, extent, offset), db=self.claims)
            pool.give(txn, extent, offset, length)
        returned = sum(length for _, _, length in runs)
        self.add(txn, CLAIMED, -returned)
        return returned

    # ------------------------------------------------------------------ pending

    def hold(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Space unindexed by ``txn`` (a delete, an eviction, a redundant quarantined
        copy): a ``pending`` row under its txnid, not reusable until it ripens."""
        txn.put(_PENDING.pack(txn.id(), extent, offset), pack_u64(length), db=self.pending)
        self.add(txn, PENDING, length)

    def ripen(self, txn: Txn, pool: FreeMap, runs: Iterable[tuple[int, int, int]]) -> None:
        """Pending ``runs`` (extent, offset, length) that no reader can still copy (the
        owner that held them says so) back to the pool, merged with their neighbours."""
        wanted = {(extent, offset): length for extent, offset, length in runs}
        if not wanted:
            return
        found = []
        with txn.cursor(self.pending) as cur:
            for k, v in cur:
                _, extent, offset = pending_row(bytes(k))
                if wanted.get((extent, offset)) == unpack_u64(bytes(v)):
                    found.append((bytes(k), extent, offset, wanted.pop((extent, offset))))
        if wanted:
            (extent, offset), length = next(iter(wanted.items()))
            raise IndexCorruptionError(
                f"no pending run at extent {extent} offset {offset} length {length}; run "
                "`python -m kvstore fsck` on the store")
        self._to_pool(txn, pool, found)

    def ripen_all(self, txn: Txn, pool: FreeMap) -> int:
        """Every pending run back to the pool (no owner is left that could be reading
        one: the last one closed, or died); returns the bytes."""
        with txn.cursor(self.pending) as cur:
            rows = [(bytes(k), *pending_row(bytes(k))[1:], unpack_u64(bytes(v)))
                    for k, v in cur]
        self._to_pool(txn, pool, rows)
        return sum(row[3] for row in rows)

    def _to_pool(self, txn: Txn, pool: FreeMap, rows: list[tuple[bytes, int, int, int]]
                 ) -> None:
        for key, extent, offset, length in rows:
            txn.delete(key, db=self.pending)
            pool.give(txn, extent, offset, length)
        if rows:
            self.add(txn, PENDING, -sum(row[3] for row in rows))

    # ------------------------------------------------------------------ fsck

    def claim_runs(self, txn: Txn) -> list[tuple[int, int, int, int]]:
        """Every ``claims`` row: (owner, extent, offset, length)."""
        with txn.cursor(self.claims) as cur:
            return [(*claim_row(bytes(k)), unpack_u64(bytes(v))) for k, v in cur]

    def pending_runs(self, txn: Txn) -> list[tuple[int, int, int, int]]:
        """Every ``pending`` row: (txnid, extent, offset, length)."""
        with txn.cursor(self.pending) as cur:
            return [(*pending_row(bytes(k)), unpack_u64(bytes(v))) for k, v in cur]

    def drop_run(self, txn: Txn, *, claimed: bool, first: int, extent: int,
                 offset: int) -> None:
        """Delete one ``claims`` (``first``: owner) or ``pending`` (``first``: txnid)
        row (fsck's repair of space owned twice; the counters are recounted after)."""
        key = (_CLAIM if claimed else _PENDING).pack(first, extent, offset)
        txn.delete(key, db=self.claims if claimed else self.pending)
