"""Which blocks an eviction takes: least-recently-used leaves of the chains, never a
pinned (``Store.pin``) or protected block, never a block with stored children (so a chain
loses its tail before its head and never gets a hole).

A read of the index's tables inside the caller's write transaction; the caller
(:meth:`kvstore.index.index.Index.evict`) unindexes what this chose, in the same transaction.
:func:`evictable_bytes` says how much evicting could ever free (a store opened with a
smaller capacity checks it before evicting anything).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvstore.disk.format import IndexEntry, lru_key, unpack_count

Txn = Any  # lmdb.Transaction (untyped module)


@dataclass(frozen=True)
class ChainTables:
    """The index's tables an eviction reads (LMDB database handles)."""

    blocks: Any
    children: Any
    pins: Any
    lru: Any


def lru_leaves(txn: Txn, tables: ChainTables, need: int, protect: set[bytes],
               scan_limit: int = 1 << 20) -> dict[bytes, IndexEntry]:
    """Least-recently-used blocks that have no stored children and are not pinned or
    protected, until ``need`` bytes (slot lengths) are chosen or nothing more
    qualifies: at most one block more than needed.

    Strict LRU order among leaves: choosing a block can make its parent a leaf; if the
    scan has already passed the parent's LRU row, it joins a heap that is merged with
    the scan, so a chain is cut from its tail before a newer leaf is taken."""
    chosen: dict[bytes, IndexEntry] = {}
    freed = 0
    gone: Counter[bytes] = Counter()  # children of a key chosen in this pass
    behind: list[tuple[bytes, bytes]] = []  # (lru row, key) of leaves the scan passed

    def is_leaf(key: bytes) -> bool:
        raw = txn.get(key, db=tables.children)
        return (0 if raw is None else unpack_count(raw)) <= gone[key]

    with txn.cursor(tables.lru) as cur:
        more, scanned = cur.first(), 0
        while freed < need:
            ahead = bytes(cur.key()) if more and scanned < scan_limit else None
            if behind and (ahead is None or behind[0][0] < ahead):
                key = heapq.heappop(behind)[1]
            elif ahead is not None:
                key = ahead[8:]
                more, scanned = cur.next(), scanned + 1
            else:
                break
            if key in protect or key in chosen or not is_leaf(key) \
                    or txn.get(key, db=tables.pins) is not None:
                continue
            raw = txn.get(key, db=tables.blocks)
            if raw is None:
                continue
            entry = chosen[key] = IndexEntry.decode(raw)
            freed += entry.slot_len
            parent = entry.parent
            if parent is None:
                continue
            gone[parent] += 1
            raw = txn.get(parent, db=tables.blocks)
            if raw is not None and is_leaf(parent):
                row = lru_key(IndexEntry.decode(raw).last_use, parent)
                if not more or row < bytes(cur.key()):  # else the scan still reaches it
                    heapq.heappush(behind, (row, parent))
    return chosen


def evictable_bytes(txn: Txn, tables: ChainTables, lost_extents: Iterable[int] = ()) -> int:
    """Bytes that evicting every block it may take would free, with no put in flight:
    the slots of stored blocks that are neither pinned nor an ancestor of a stored
    pinned block (:func:`lru_leaves` takes a block once its children are gone, so every
    other block becomes a leaf in turn), in an extent whose file is not missing (that
    space is never free again: fsck --repair drops such extents).  One pass over the
    ``blocks`` table."""
    kept: set[bytes] = set()
    with txn.cursor(tables.pins) as pins:
        for raw_key, _ in pins:
            key: bytes | None = bytes(raw_key)
            while key is not None and key not in kept:
                raw = txn.get(key, db=tables.blocks)
                if raw is None:
                    break
                kept.add(key)
                key = IndexEntry.decode(raw).parent
    lost = frozenset(lost_extents)
    total = 0
    with txn.cursor(tables.blocks) as cur:
        for raw_key, raw in cur:
            entry = IndexEntry.decode(raw)
            if entry.extent not in lost and bytes(raw_key) not in kept:
                total += entry.slot_len
    return total
