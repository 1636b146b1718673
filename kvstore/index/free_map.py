"""The durable free map: the index's ``free`` table (FORMAT.md, "Index"), one row per
free run, ``(u32 BE extent, u64 BE offset) -> u64 LE length``.

Runs are kept maximal: giving a range back merges it with the runs it touches, and
taking a range splits the run that holds it.  A range that is not wholly free when
taken, or that overlaps a free run when given back, means the allocation map and the
index disagree: :class:`~kvstore.errors.IndexCorruptionError` (fsck repairs it).  Every
change runs in the caller's write transaction (:class:`kvstore.index.index.Index` owns it), in
the same one as the index change it belongs to, and is reported to ``changed`` with the
bytes it added or removed (the ``free_bytes`` counter: kvstore/index/space_counters.py).

The same runs with a key ``prefix`` are one owner's claims (the ``claims`` table: owner
u32 BE before the same key, kvstore/index/claims.py): a table of several owners' runs,
each owner's kept maximal among its own rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.disk.format import IndexEntry, decode_free_key, free_key, pack_u64, unpack_u64
from kvstore.errors import IndexCorruptionError, KVStoreError

Txn = Any  # lmdb.Transaction (untyped module)
Run = tuple[int, int, int]  # (extent, offset, length)


class FreeMap:
    """The free runs in ``table`` (an LMDB database handle of the index's environment)."""

    def __init__(self, table: Any,
                 changed: Callable[[Txn, int], None] = lambda txn, delta: None,
                 prefix: bytes = b"") -> None:
        self.table = table
        self._changed = changed
        self._prefix = prefix

    def _key(self, extent: int, offset: int) -> bytes:
        return self._prefix + free_key(extent, offset)

    def _run(self, cur: Any) -> Run | None:
        """The run at the cursor, if it is one of this map's (its key has the prefix)."""
        if not self._prefix:  # (the pool: every row is one)
            return (*decode_free_key(cur.key()), unpack_u64(cur.value()))
        key, n = bytes(cur.key()), len(self._prefix)
        if key[:n] != self._prefix:
            return None
        return (*decode_free_key(key[n:]), unpack_u64(cur.value()))

    def runs(self, txn: Txn) -> list[Run]:
        with txn.cursor(self.table) as cur:
            if not self._prefix:
                return [(*decode_free_key(k), unpack_u64(v)) for k, v in cur]
            out: list[Run] = []
            if cur.set_range(self._prefix):
                while (run := self._run(cur)) is not None:
                    out.append(run)
                    if not cur.next():
                        break
            return out

    def _neighbours(self, txn: Txn, extent: int, offset: int) -> tuple[Run | None, Run | None]:
        """Free runs (extent, offset, length) at-or-after and before ``(extent, offset)``."""
        cur = txn.cursor(self.table)
        at_or_after = before = None
        if cur.set_range(self._key(extent, offset)):
            at_or_after = self._run(cur)
            moved = cur.prev()
        else:
            moved = cur.last()
        if moved:
            before = self._run(cur)
        return at_or_after, before

    def holds(self, txn: Txn, extent: int, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` of ``extent`` lies within one run."""
        at_or_after, before = self._neighbours(txn, extent, offset)
        run = at_or_after if at_or_after is not None and at_or_after[:2] == (extent, offset) \
            else before
        return run is not None and run[0] == extent and \
            run[1] <= offset < offset + length <= run[1] + run[2]

    def take(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Remove [offset, offset+length) from the free map (it must be free)."""
        at_or_after, before = self._neighbours(txn, extent, offset)
        run = at_or_after if at_or_after is not None and at_or_after[:2] == (extent, offset) \
            else before
        if run is None or run[0] != extent or not \
                run[1] <= offset < offset + length <= run[1] + run[2]:
            raise drift(extent, offset, length)
        _, run_offset, run_len = run
        txn.delete(self._key(extent, run_offset), db=self.table)
        if run_offset < offset:
            txn.put(self._key(extent, run_offset), pack_u64(offset - run_offset), db=self.table)
        end, run_end = offset + length, run_offset + run_len
        if end < run_end:
            txn.put(self._key(extent, end), pack_u64(run_end - end), db=self.table)
        self._changed(txn, -length)

    def take_slots(self, txn: Txn, entries: Sequence[tuple[bytes, IndexEntry]]) -> None:
        """Take the slots of ``entries`` (a put's batch): touching slots as one range."""
        for extent, offset, length, slots in adjacent_ranges_merged(entries):
            try:
                self.take(txn, extent, offset, length)
            except IndexCorruptionError:  # not one free run (runs are kept maximal, but if not):
                for slot_offset, slot_len in slots:  # slot by slot, as before
                    self.take(txn, extent, slot_offset, slot_len)

    def give(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Add [offset, offset+length) to the free map, merging neighbours."""
        nxt, prev = self._neighbours(txn, extent, offset)
        end = offset + length
        self._changed(txn, length)
        if nxt is not None and nxt[0] == extent:
            if nxt[1] < end:
                raise drift(extent, offset, length)
            if nxt[1] == end:
                txn.delete(self._key(extent, end), db=self.table)
                length += nxt[2]
        if prev is not None and prev[0] == extent:
            if prev[1] + prev[2] > offset:
                raise drift(extent, offset, length)
            if prev[1] + prev[2] == offset:
                txn.delete(self._key(extent, prev[1]), db=self.table)
                offset, length = prev[1], length + prev[2]
        txn.put(self._key(extent, offset), pack_u64(length), db=self.table)

    def put_run(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Record a run as it is, no merging (fsck's ``--rebuild-index``)."""
        txn.put(self._key(extent, offset), pack_u64(length), db=self.table)
        self._changed(txn, length)

    def delete_run(self, txn: Txn, extent: int, offset: int) -> None:
        raw = txn.pop(self._key(extent, offset), db=self.table)
        if raw is not None:
            self._changed(txn, -unpack_u64(bytes(raw)))

    def drop_extent(self, txn: Txn, extent_key: bytes) -> None:
        """Forget every run of the extent whose key prefix is ``extent_key``."""
        doomed = [(bytes(k), unpack_u64(bytes(v))) for k, v in txn.cursor(self.table)
                  if k[:4] == extent_key]
        for k, _ in doomed:
            txn.delete(k, db=self.table)
        self._changed(txn, -sum(length for _, length in doomed))


def adjacent_ranges_merged(entries: Sequence[tuple[bytes, IndexEntry]]
                           ) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
    """The entries' slots as runs (extent, offset, length, its slots), touching slots joined.

    A batch's slots are usually allocated back to back: one ``take`` for the run
    instead of one free-map update per slot (a cursor seek, a delete and a put each).
    Only slots that exactly touch are joined; overlapping ones stay apart, so
    ``take`` still refuses the second as drift."""
    runs: list[tuple[int, int, int, list[tuple[int, int]]]] = []
    for entry in sorted((e for _, e in entries), key=lambda e: (e.extent, e.offset)):
        if runs and runs[-1][0] == entry.extent and runs[-1][1] + runs[-1][2] == entry.offset:
            extent, offset, length, slots = runs[-1]
            runs[-1] = (extent, offset, length + entry.slot_len, slots)
        else:
            runs.append((entry.extent, entry.offset, entry.slot_len, []))
        runs[-1][3].append((entry.offset, entry.slot_len))
    return runs


def drift(extent: int, offset: int, length: int) -> KVStoreError:
    return IndexCorruptionError(
        f"allocation map disagrees with the index at extent {extent} offset {offset} "
        f"length {length}; run `python -m kvstore fsck` on the store")
