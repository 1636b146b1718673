"""The ``quarantine`` table's records: blocks taken out of the index because a read of
them failed, kept with their space so that they can be read again.

Quarantine is a suspicion, not a verdict.  A record says why its block left the index
(FORMAT.md, "IndexEntry"): it *could not be read* (an I/O error after retries, a short
read, a missing extent file; flag ``ENTRY_FLAG_UNREADABLE``) or it *failed
verification* (header or payload checksum).  Either way its slot keeps its space;
re-reads (:mod:`kvstore.core.rechecks` for the unreadable ones, every scrub pass and fsck
for all) put a block that verifies back into the index, and nothing that verifies is
freed while it is the only copy of its block.

Records are keyed by block key, so a key has one at most: a block quarantined again
while an older copy of it is still quarantined (the key was stored again meanwhile)
*displaces* that record, and :meth:`QuarantineTable.move` then decides on what a re-read
of the older copy just found.

Every write here runs in a transaction of the index writer (``Index.quarantine_records``
is the table of an open index).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.disk.format import IndexEntry, encode_quarantined, quarantined_unreadable
from kvstore.errors import KVStoreError
from kvstore.index.space_counters import SpaceCounters

__all__ = ["CORRUPT", "OK", "UNREADABLE", "IndexPort", "Quarantined", "QuarantineTable",
           "same_slot"]

Txn = Any  # lmdb.Transaction (untyped module)

# What a re-read of a quarantined slot found.
OK, CORRUPT, UNREADABLE = "ok", "corrupt", "unreadable"


def same_slot(a: IndexEntry, b: IndexEntry) -> bool:
    """Two entries name the same write of a block (same place, same ``seq``)."""
    return (a.extent, a.offset, a.seq) == (b.extent, b.offset, b.seq)


@dataclass
class Quarantined:
    """What a quarantine transaction did: keys moved into quarantine, keys put back into
    the index, and slots freed (their space returns to the allocator after the commit)."""

    moved: list[bytes]
    restored: list[bytes]
    freed: list[IndexEntry]


class IndexPort(Protocol):
    """What the records need of :class:`kvstore.index.index.Index` (it passes itself)."""

    blocks: Any
    quarantine: Any

    def begin(self) -> AbstractContextManager[Txn]: ...

    def quarantine_rows_after(self, after: bytes | None, limit: int
                              ) -> list[tuple[bytes, bytes]]: ...

    space: SpaceCounters  # (a freed copy goes to ``pending``)

    def add_block(self, txn: Txn, key: bytes, entry: IndexEntry, *,
                  restored: bool = False) -> None: ...

    def remove_block(self, txn: Txn, key: bytes, entry: IndexEntry, *,
                     quarantine: bool) -> None: ...


class QuarantineTable:
    """The records of one open index (see the module docstring)."""

    def __init__(self, index: IndexPort) -> None:
        self._index = index

    def move(self, txn: Txn, bad: Sequence[tuple[bytes, IndexEntry, bool]],
             displaced: Mapping[bytes, tuple[IndexEntry, bool]] | None = None) -> Quarantined:
        """Move blocks that failed out of the index, each ``(key, entry, unreadable)``
        (``unreadable``: it could not be read, recorded as such; else it failed
        verification), if the entry is still the one that was read (a newer put of the
        key is left alone).  Their space stays allocated, so they can be read again.

        A record the key has already is *displaced*: the caller re-read its slot just
        now, and ``displaced[key]`` is what it found (that entry, whether it verified).
        An older copy that verified goes back into the index in place of the failing one
        (the block stays a hit); one that did not is freed.  A record the caller did not
        re-read (made meanwhile) leaves the key alone this time."""
        index, out = self._index, Quarantined([], [], [])
        for key, entry, unreadable in bad:
            raw = txn.get(key, db=index.blocks)
            current = None if raw is None else IndexEntry.decode(raw)
            if current is None or not same_slot(current, entry):
                continue
            restore = None
            older = txn.get(key, db=index.quarantine)
            if older is not None:
                old = IndexEntry.decode(older)
                seen = (displaced or {}).get(key)
                if seen is None or not same_slot(seen[0], old):
                    continue
                if seen[1]:
                    restore = old
                else:  # it failed its re-read just now: this copy is the one kept
                    index.space.hold(txn, old.extent, old.offset, old.slot_len)
                    out.freed.append(old)
            index.remove_block(txn, key, current, quarantine=True)
            txn.put(key, encode_quarantined(current, unreadable), db=index.quarantine)
            out.moved.append(key)
            if restore is not None:
                index.add_block(txn, key, restore, restored=True)
                out.restored.append(key)
        return out

    def of(self, keys: Sequence[bytes]) -> dict[bytes, tuple[IndexEntry, bool]]:
        """The records of ``keys`` that have one: (entry, unreadable)."""
        index = self._index
        with index.begin() as txn, txn.cursor(index.quarantine) as cur:
            found = dict(cur.getmulti(keys))
        return {bytes(k): (IndexEntry.decode(v), quarantined_unreadable(v))
                for k, v in found.items()}

    def rows(self, after: bytes | None, limit: int, *, unreadable_only: bool = False
             ) -> tuple[list[tuple[bytes, IndexEntry, bool]], bytes | None]:
        """Up to ``limit`` records after key ``after`` (None: from the first), in key
        order: (key, entry, unreadable); and the last key looked at (None: the end of
        the table).  A record that does not decode is skipped (fsck reports it)."""
        raw = self._index.quarantine_rows_after(after, limit)
        rows = []
        for key, value in raw:
            unreadable = quarantined_unreadable(value)
            if unreadable_only and not unreadable:
                continue
            try:
                rows.append((key, IndexEntry.decode(value), unreadable))
            except KVStoreError:
                continue
        return rows, raw[-1][0] if len(raw) == limit else None

    def settle(self, txn: Txn, checked: Sequence[tuple[bytes, IndexEntry, str]]) -> Quarantined:
        """Apply what re-reading records found, each ``(key, entry, outcome)`` (``OK``,
        ``CORRUPT`` or ``UNREADABLE``), to the records that still name that slot.  OK:
        the block goes back into the index (``restored``), or, if the key was stored
        again meanwhile, its slot is a redundant copy and is freed (``freed``: the block
        itself stays stored).  Otherwise the record keeps the latest cause."""
        index, out = self._index, Quarantined([], [], [])
        for key, entry, outcome in checked:
            raw = txn.get(key, db=index.quarantine)
            if raw is None or not same_slot(IndexEntry.decode(raw), entry):
                continue
            if outcome != OK:
                txn.put(key, encode_quarantined(entry, outcome == UNREADABLE),
                        db=index.quarantine)
                continue
            txn.delete(key, db=index.quarantine)
            if txn.get(key, db=index.blocks) is not None:
                index.space.hold(txn, entry.extent, entry.offset, entry.slot_len)
                out.freed.append(entry)
            else:
                index.add_block(txn, key, entry, restored=True)
                out.restored.append(key)
        return out
