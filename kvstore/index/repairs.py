"""The index's side of fsck: the rows fsck reads as they are stored, and every repair
it makes, each a method named for what it does (``Index.repairs`` of an open index).

fsck (kvstore/tools/fsck.py) decides what to repair; these methods are the only
transactions it runs on the tables, so no caller builds one over raw tables.  Repairs
run in one transaction of the index writer, and leave the derived tables (child
counts, LRU rows) to :meth:`Repairs.rewrite_chain_tables`, fsck's last step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvstore.disk.format import IndexEntry, extent_key, pack_count, pack_u64, unpack_count
from kvstore.index.free_map import FreeMap

__all__ = ["Repairs"]

Txn = Any  # lmdb.Transaction (untyped module)


class Repairs:
    """fsck's reads and repairs of one open index's tables."""

    def __init__(self, begin: Callable[[], AbstractContextManager[Txn]], *, blocks: Any,
                 quarantine: Any, extents: Any, children: Any, lru: Any,
                 free_map: FreeMap) -> None:
        self._begin = begin
        self._blocks, self._quarantine, self._extents = blocks, quarantine, extents
        self._children, self._lru, self._free_map = children, lru, free_map

    def _entries(self, quarantined: bool) -> Any:
        return self._quarantine if quarantined else self._blocks

    # ------------------------------------------------------------------ reads

    def entry_rows(self, *, quarantined: bool) -> list[tuple[bytes, bytes]]:
        """Every (key, entry) of the blocks (or quarantine) table, undecoded: fsck
        reports rows that do not decode instead of failing on them."""
        with self._begin() as txn, txn.cursor(self._entries(quarantined)) as cur:
            return [(bytes(k), bytes(v)) for k, v in cur]

    def chain_tables(self) -> tuple[dict[bytes, int], set[bytes]]:
        """The derived tables as stored: parent -> child count, and the LRU rows."""
        with self._begin() as txn:
            children = {bytes(k): unpack_count(v) for k, v in txn.cursor(self._children)}
            lru = {bytes(k) for k, _ in txn.cursor(self._lru)}
        return children, lru

    def stored_blocks(self, txn: Txn) -> list[tuple[bytes, IndexEntry]]:
        """The blocks table as it stands in ``txn`` (after the repairs before it)."""
        return [(bytes(k), IndexEntry.decode(v)) for k, v in txn.cursor(self._blocks)]

    # ------------------------------------------------------------------ repairs

    def drop_entry(self, txn: Txn, key: bytes, *, quarantined: bool | None = None) -> None:
        """Drop ``key``'s row from the blocks (``quarantined=False``), quarantine
        (``True``) or both (None) tables; its space is not freed (a row that does not
        decode, or the later owner of space owned twice)."""
        for q in (False, True) if quarantined is None else (quarantined,):
            txn.delete(key, db=self._entries(q))

    def free_slot(self, txn: Txn, key: bytes, entry: IndexEntry, *, quarantined: bool) -> None:
        """Drop a damaged block's row and give its slot back to the free map."""
        txn.delete(key, db=self._entries(quarantined))
        self._free_map.give(txn, entry.extent, entry.offset, entry.slot_len)

    def drop_extent(self, txn: Txn, extent_id: int) -> None:
        """Forget an extent whose file is gone: its record, its blocks (stored and
        quarantined) and its free runs."""
        txn.delete(extent_key(extent_id), db=self._extents)
        for table in (self._blocks, self._quarantine):
            doomed = [k for k, v in txn.cursor(table) if IndexEntry.decode(v).extent == extent_id]
            for k in doomed:
                txn.delete(k, db=table)
        self._free_map.drop_extent(txn, extent_key(extent_id))

    def delete_free_run(self, txn: Txn, extent: int, offset: int) -> None:
        self._free_map.delete_run(txn, extent, offset)

    def rewrite_chain_tables(self, txn: Txn, children: dict[bytes, int],
                             lru: set[bytes]) -> None:
        """Replace the derived tables (child counts, LRU rows) with these."""
        for table in (self._children, self._lru):
            txn.drop(table, delete=False)
        for k, n in children.items():
            txn.put(k, pack_count(n), db=self._children)
        for row in lru:
            txn.put(row, b"", db=self._lru)

    def record_extent(self, txn: Txn, extent_id: int, extent_bytes: int,
                      free: Sequence[tuple[int, int]]) -> None:
        """Record an extent found on disk (``--rebuild-index``) and its free runs
        (offset, length), as they are: no merging, no next-extent counter."""
        txn.put(extent_key(extent_id), pack_u64(extent_bytes), db=self._extents)
        for offset, length in free:
            self._free_map.put_run(txn, extent_id, offset, length)
