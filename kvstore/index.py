"""The LMDB index: block entries, the durable free map, extents, metadata, quarantine.

Tables (FORMAT.md, "Index"):

``meta``        format version, store uuid, extent size, namespaces, counters
``blocks``      16-byte key -> IndexEntry
``extents``     u32 BE extent id -> u64 LE extent size
``free``        (u32 BE extent, u64 BE offset) -> u64 LE length of a free run
``quarantine``  16-byte key -> IndexEntry of a block that failed its checksum

Every change of allocation happens in the same write transaction as the index change
it belongs to, so space is never both free and referenced after a crash.

LMDB allows one write transaction at a time, bound to the thread that began it
(py-lmdb ChangeLog 2.3.0).  All of kvstore's write transactions run on one dedicated
thread (:class:`IndexWriter`), which also does group commit: jobs that queue up while
a commit is being fsynced are applied together in the next transaction, each in a
nested transaction so one failing job cannot undo the others.  Reads use short
read-only transactions on the calling thread; LMDB reads never block on the writer.

Every transaction the store needs is a method here (``commit_puts``, ``delete_blocks``,
``evict``, ``quarantine``, ``pin``, ``add_extent``), so no caller builds one over raw
tables.  LMDB errors are translated per job: a job that fills the memory map is retried
after the map grows (``set_mapsize``, between transactions, while no reader is inside
one) up to the store's ``index_map_bytes``; past that it fails with
:class:`~kvstore.errors.StoreFullError`, other LMDB errors with ``StoreIOError``.  Nothing
LMDB raises leaves this module untranslated.
"""

from __future__ import annotations

import heapq
import json
import operator
import os
import queue
import struct
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from itertools import compress, count
from typing import Any, TypeVar

import anyio
import lmdb

from kvstore import permissions
from kvstore.errors import (
    FormatVersionError,
    IndexCorruptionError,
    KVStoreError,
    StoreClosedError,
    StoreFullError,
    StoreIOError,
)
from kvstore.format import (
    FORMAT_VERSION,
    PAGE,
    IndexEntry,
    decode_extent_key,
    decode_free_key,
    extent_key,
    free_key,
    lru_key,
    pack_count,
    pack_u64,
    unpack_count,
    unpack_u64,
)

T = TypeVar("T")
Txn = Any  # lmdb.Transaction (untyped module)
Touched = dict[bytes, int]  # key -> last use (us) of recent gets, written lazily

INITIAL_MAP_BYTES = 1 << 30
"""The LMDB map starts at this size (or ``index_map_bytes`` if smaller) and doubles when
full, up to ``index_map_bytes``.  A map is address space, not disk: the data file only
grows as the index does."""

_DBS = (b"meta", b"blocks", b"extents", b"free", b"quarantine", b"children", b"pins", b"lru")

META_FORMAT = b"format_version"
META_UUID = b"store_uuid"
META_EXTENT_BYTES = b"extent_bytes"
META_NEXT_EXTENT = b"next_extent"
META_SEQ = b"seq"
META_NAMESPACE_PREFIX = b"namespace:"


class _ResizeGate:
    """Readers on any thread vs. the writer growing the map: LMDB allows ``set_mapsize``
    only while no transaction of this process is open."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._resizing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class Index:
    """An open LMDB environment and its tables.  ``map_size`` is the most the memory map
    may grow to (``open(index_map_bytes=...)``)."""

    def __init__(self, path: str, *, map_size: int, sync: bool,
                 file_mode: int = permissions.FILE_MODE) -> None:
        permissions.make_dirs(path, file_mode)
        self.map_limit = map_size
        self._gate = _ResizeGate()
        # py-lmdb creates data.mdb and lock.mdb with ``mode & ~0o111`` (less the umask):
        # never more open than file_mode; fix_created restores what a umask took away.
        fix_modes = permissions.fix_created(
            [os.path.join(path, "data.mdb"), os.path.join(path, "lock.mdb")], file_mode)
        try:
            self.env = lmdb.open(
                path, map_size=min(map_size, INITIAL_MAP_BYTES), subdir=True, max_dbs=len(_DBS),
                sync=sync, metasync=sync, readahead=False, meminit=False, max_readers=256,
                lock=True, mode=permissions.dir_mode(file_mode))
        except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                lmdb.VersionMismatchError) as e:
            raise IndexCorruptionError(
                f"the LMDB index at {path} is damaged ({e}); run `python -m kvstore fsck "
                f"{os.path.dirname(path)} --rebuild-index` to rebuild it from the extents"
            ) from e
        except lmdb.Error as e:
            raise StoreIOError(getattr(e, "errno", 5) or 5,
                               f"cannot open the LMDB index at {path}: {e}") from e
        fix_modes()
        (self.meta, self.blocks, self.extents, self.free, self.quarantine, self.children,
         self.pins, self.lru) = (self.env.open_db(name) for name in _DBS)

    def close(self) -> None:
        self.env.close()

    @contextmanager
    def begin(self, *, buffers: bool = False) -> Iterator[Txn]:
        """A read-only transaction (the map is not resized while one is open)."""
        with self._gate.reading():
            txn: Txn = self.env.begin(buffers=True) if buffers else self.env.begin()
            with txn:
                yield txn

    def grow_map(self) -> bool:
        """Double the memory map up to ``map_limit`` (writer thread, between transactions);
        False if it is at the limit already."""
        size = self.env.info()["map_size"]
        if size >= self.map_limit:
            return False
        with self._gate.exclusive():
            self.env.set_mapsize(min(self.map_limit, 2 * size))
        return True

    # ------------------------------------------------------------------ reads

    def get_entries(self, keys: Sequence[bytes]) -> list[IndexEntry | None]:
        """Index entries for ``keys`` in order (None where absent), one C-level batch."""
        with self.begin() as txn, txn.cursor(self.blocks) as cur:
            found = dict(cur.getmulti(keys))
        return [IndexEntry.decode(found[k]) if k in found else None for k in keys]

    def present(self, keys: Sequence[bytes]) -> set[bytes]:
        # Cursor.set_key only positions the cursor: unlike getmulti it copies no value
        # (an IndexEntry per key), which made lookups of long chains 3-5x slower.
        with self.begin(buffers=True) as txn, txn.cursor(self.blocks) as cur:
            find = cur.set_key
            return {k for k in keys if find(k)}

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are indexed; stops at the first miss."""
        with self.begin(buffers=True) as txn, txn.cursor(self.blocks) as cur:
            # lazy C-level iterators: stops at the first miss, no Python frame per key
            misses = compress(count(), map(operator.not_, map(cur.set_key, keys)))
            return next(misses, len(keys))

    def pinned(self, keys: Sequence[bytes]) -> set[bytes]:
        """Which of ``keys`` are pinned."""
        with self.begin(buffers=True) as txn, txn.cursor(self.pins) as cur:
            find = cur.set_key
            return {k for k in keys if find(k)}

    def count_blocks(self) -> int:
        return self.counts()["blocks"]

    def counts(self) -> dict[str, int]:
        """Entries in the blocks, quarantine and pins tables."""
        with self.begin() as txn:
            return {name: int(txn.stat(table)["entries"]) for name, table in
                    (("blocks", self.blocks), ("quarantine", self.quarantine),
                     ("pins", self.pins))}

    def iter_entries(self, table: Any = None) -> Iterator[tuple[bytes, IndexEntry]]:
        with self.begin() as txn, txn.cursor(table or self.blocks) as cur:
            for k, v in cur:
                yield k, IndexEntry.decode(v)

    def extents_list(self) -> dict[int, int]:
        with self.begin() as txn, txn.cursor(self.extents) as cur:
            return {decode_extent_key(k): unpack_u64(v) for k, v in cur}

    def free_runs(self) -> list[tuple[int, int, int]]:
        with self.begin() as txn, txn.cursor(self.free) as cur:
            return [(*decode_free_key(k), unpack_u64(v)) for k, v in cur]

    def meta_get(self, key: bytes) -> bytes | None:
        with self.begin() as txn:
            value = txn.get(key, db=self.meta)
            return None if value is None else bytes(value)

    def next_extent(self) -> int:
        return unpack_u64(self.meta_get(META_NEXT_EXTENT) or b"")

    def namespaces(self) -> dict[bytes, str]:
        with self.begin() as txn, txn.cursor(self.meta) as cur:
            out = {}
            if cur.set_range(META_NAMESPACE_PREFIX):
                for k, v in cur:
                    if not k.startswith(META_NAMESPACE_PREFIX):
                        break
                    try:
                        out[bytes.fromhex(k[len(META_NAMESPACE_PREFIX):].decode())] = v.decode()
                    except (UnicodeDecodeError, ValueError):
                        raise IndexCorruptionError(
                            f"namespace record {bytes(k)!r} is damaged; run `python -m kvstore "
                            "fsck --repair` to drop it") from None
            return out

    def check_format(self) -> None:
        raw = self.meta_get(META_FORMAT)
        if raw is None:
            raise IndexCorruptionError("index has no format_version record")
        if len(raw) != 4:
            raise IndexCorruptionError(f"format_version record of {len(raw)} bytes")
        version = struct.unpack("<I", raw)[0]
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"store has on-disk format version {version}; this kvstore reads version "
                f"{FORMAT_VERSION}. Use a kvstore release that supports it; nothing was changed.")

    # ------------------------------------------------------------------ writes (writer thread)

    def _neighbours(self, txn: Txn, extent: int, offset: int) -> tuple[
            tuple[int, int, int] | None, tuple[int, int, int] | None]:
        """Free runs (extent, offset, length) at-or-after and before ``(extent, offset)``."""
        cur = txn.cursor(self.free)
        at_or_after = before = None
        if cur.set_range(free_key(extent, offset)):
            at_or_after = (*decode_free_key(cur.key()), unpack_u64(cur.value()))
            moved = cur.prev()
        else:
            moved = cur.last()
        if moved:
            before = (*decode_free_key(cur.key()), unpack_u64(cur.value()))
        return at_or_after, before

    def take_range(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Remove [offset, offset+length) from the durable free map (it must be free)."""
        at_or_after, before = self._neighbours(txn, extent, offset)
        run = at_or_after if at_or_after is not None and at_or_after[:2] == (extent, offset) \
            else before
        if run is None or run[0] != extent or not \
                run[1] <= offset < offset + length <= run[1] + run[2]:
            raise _drift(extent, offset, length)
        _, run_offset, run_len = run
        txn.delete(free_key(extent, run_offset), db=self.free)
        if run_offset < offset:
            txn.put(free_key(extent, run_offset), pack_u64(offset - run_offset), db=self.free)
        end, run_end = offset + length, run_offset + run_len
        if end < run_end:
            txn.put(free_key(extent, end), pack_u64(run_end - end), db=self.free)

    # ------------------------------------------------------------------ chains, LRU, pins

    def add_block(self, txn: Txn, key: bytes, entry: IndexEntry) -> None:
        """Index a block: entry, LRU row, and one more stored child for its parent."""
        txn.put(key, entry.encode(), db=self.blocks)
        txn.put(lru_key(entry.last_use, key), b"", db=self.lru)
        if entry.parent is not None:
            self.bump(txn, self.children, entry.parent, +1)

    def remove_block(self, txn: Txn, key: bytes, entry: IndexEntry, *, quarantine: bool) -> None:
        """Unindex a block; its space returns to the free map unless it is quarantined
        (kept allocated so fsck can look at it)."""
        txn.delete(key, db=self.blocks)
        txn.delete(lru_key(entry.last_use, key), db=self.lru)
        if entry.parent is not None:
            self.bump(txn, self.children, entry.parent, -1)
        if quarantine:
            txn.put(key, entry.encode(), db=self.quarantine)
        else:
            self.give_range(txn, entry.extent, entry.offset, entry.slot_len)

    def touch(self, txn: Txn, key: bytes, last_use: int) -> None:
        raw = txn.get(key, db=self.blocks)
        if raw is None:
            return
        entry = IndexEntry.decode(raw)
        if last_use <= entry.last_use:
            return
        txn.delete(lru_key(entry.last_use, key), db=self.lru)
        txn.put(lru_key(last_use, key), b"", db=self.lru)
        txn.put(key, replace(entry, last_use=last_use).encode(), db=self.blocks)

    def bump(self, txn: Txn, table: Any, key: bytes, delta: int) -> int:
        raw = txn.get(key, db=table)
        n = (unpack_count(raw) if raw is not None else 0) + delta
        if n < 0:
            raise IndexCorruptionError(f"count of {key.hex()} would drop below zero; run "
                                       "`python -m kvstore fsck` on the store")
        if n:
            txn.put(key, pack_count(n), db=table)
        else:
            txn.delete(key, db=table)
        return n

    def apply_touched(self, txn: Txn, touched: Touched) -> None:
        for key, when in touched.items():
            self.touch(txn, key, when)

    def evict(self, txn: Txn, need: int, protect: set[bytes], touched: Touched | None = None,
              scan_limit: int = 1 << 20) -> list[tuple[bytes, IndexEntry]]:
        """Unindex least-recently-used blocks that have no stored children and are not
        pinned or protected, until ``need`` bytes are freed (or nothing more qualifies):
        at most one block more than needed.  Recent gets' last use is applied first.

        Strict LRU order among leaves: evicting a block can make its parent a leaf; if
        the scan has already passed the parent's LRU row, it joins a heap that is merged
        with the scan, so a chain is cut from its tail before a newer leaf is taken."""
        if touched:
            self.apply_touched(txn, touched)
        chosen: dict[bytes, IndexEntry] = {}
        freed = 0
        gone: Counter[bytes] = Counter()  # children of a key chosen in this pass
        behind: list[tuple[bytes, bytes]] = []  # (lru row, key) of leaves the scan passed

        def is_leaf(key: bytes) -> bool:
            raw = txn.get(key, db=self.children)
            return (0 if raw is None else unpack_count(raw)) <= gone[key]

        with txn.cursor(self.lru) as cur:
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
                        or txn.get(key, db=self.pins) is not None:
                    continue
                raw = txn.get(key, db=self.blocks)
                if raw is None:
                    continue
                entry = chosen[key] = IndexEntry.decode(raw)
                freed += entry.slot_len
                parent = entry.parent
                if parent is None:
                    continue
                gone[parent] += 1
                raw = txn.get(parent, db=self.blocks)
                if raw is not None and is_leaf(parent):
                    row = lru_key(IndexEntry.decode(raw).last_use, parent)
                    if not more or row < bytes(cur.key()):  # else the scan still reaches it
                        heapq.heappush(behind, (row, parent))
        for key, entry in chosen.items():
            self.remove_block(txn, key, entry, quarantine=False)
        return list(chosen.items())

    # ------------------------------------------------------------------ the store's transactions

    def commit_puts(self, txn: Txn, entries: Sequence[tuple[bytes, IndexEntry]],
                    touched: Touched, seq: int, relies_on: Sequence[bytes] = ()) -> None:
        """Index written blocks: their ranges leave the free map in the same transaction.

        ``relies_on`` are the stored blocks the put deduplicated against; if one of them
        was unindexed since the put decided (an eviction that chose it before the put
        protected it, or a delete), nothing is applied and :class:`ChainCut` names them."""
        with txn.cursor(self.blocks) as cur:
            gone = [k for k in relies_on if not cur.set_key(k)]
        if gone:
            raise ChainCut(gone)
        self.apply_touched(txn, touched)
        for extent, offset, length, slots in _adjacent_ranges_merged(entries):
            try:
                self.take_range(txn, extent, offset, length)
            except IndexCorruptionError:  # not one free run (runs are kept maximal, but if not):
                for slot_offset, slot_len in slots:  # slot by slot, as before
                    self.take_range(txn, extent, slot_offset, slot_len)
        for key, entry in entries:
            self.add_block(txn, key, entry)
        prev = unpack_u64(txn.get(META_SEQ, db=self.meta))
        txn.put(META_SEQ, pack_u64(max(prev, seq)), db=self.meta)

    def delete_blocks(self, txn: Txn, keys: Sequence[bytes]) -> list[IndexEntry]:
        """Unindex ``keys`` (those stored); returns their entries, whose space is free."""
        freed = []
        for key in dict.fromkeys(keys):
            raw = txn.get(key, db=self.blocks)
            if raw is not None:
                entry = IndexEntry.decode(raw)
                self.remove_block(txn, key, entry, quarantine=False)
                freed.append(entry)
        return freed

    def quarantine_blocks(self, txn: Txn, bad: Sequence[tuple[bytes, IndexEntry]]) -> None:
        """Move blocks that failed verification out of the index, if the entry is still
        the one that was read (a newer put of the key is left alone); their space stays
        allocated so fsck can look at it."""
        for key, entry in bad:
            raw = txn.get(key, db=self.blocks)
            current = None if raw is None else IndexEntry.decode(raw)
            if current is not None and (current.extent, current.offset, current.seq) == \
                    (entry.extent, entry.offset, entry.seq):
                self.remove_block(txn, key, current, quarantine=True)

    def pin(self, txn: Txn, keys: Sequence[bytes], delta: int) -> None:
        """Add ``delta`` (+1 or -1) to each key's pin count; unpinning an unpinned key is
        a no-op."""
        for key in keys:
            if delta > 0 or txn.get(key, db=self.pins) is not None:
                self.bump(txn, self.pins, key, delta)

    def add_extent(self, txn: Txn, extent_id: int, extent_bytes: int) -> None:
        """Record a new (already durable) extent file and its free run."""
        txn.put(extent_key(extent_id), pack_u64(extent_bytes), db=self.extents)
        self.give_range(txn, extent_id, PAGE, extent_bytes - PAGE)
        txn.put(META_NEXT_EXTENT, pack_u64(extent_id + 1), db=self.meta)

    # ---------------------------------------------------------------- fsck's repairs
    # Every transaction fsck runs on these tables is one of these methods: the index
    # owns its tables, fsck decides what to repair.

    def raw_rows(self, table: Any) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of ``table``, undecoded (fsck reports rows that do not
        decode instead of failing on them)."""
        with self.begin() as txn, txn.cursor(table) as cur:
            return [(bytes(k), bytes(v)) for k, v in cur]

    def delete_row(self, txn: Txn, table: Any, key: bytes) -> None:
        txn.delete(key, db=table)

    def set_meta(self, txn: Txn, key: bytes, value: bytes) -> None:
        txn.put(key, value, db=self.meta)

    def meta_rows(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The meta table's rows whose key starts with ``prefix``."""
        rows = []
        with self.begin() as txn, txn.cursor(self.meta) as cur:
            if cur.set_range(prefix):
                for k, v in cur:
                    if not bytes(k).startswith(prefix):
                        break
                    rows.append((bytes(k), bytes(v)))
        return rows

    def drop_extent(self, txn: Txn, extent_id: int) -> None:
        """Forget an extent whose file is gone: its record, its blocks (stored and
        quarantined) and its free runs."""
        txn.delete(extent_key(extent_id), db=self.extents)
        for table in (self.blocks, self.quarantine):
            doomed = [k for k, v in txn.cursor(table) if IndexEntry.decode(v).extent == extent_id]
            for k in doomed:
                txn.delete(k, db=table)
        doomed = [k for k, _ in txn.cursor(self.free) if k[:4] == extent_key(extent_id)]
        for k in doomed:
            txn.delete(k, db=self.free)

    def chain_tables(self) -> tuple[dict[bytes, int], set[bytes]]:
        """The derived tables as stored: parent -> child count, and the LRU rows."""
        with self.begin() as txn:
            children = {bytes(k): unpack_count(v) for k, v in txn.cursor(self.children)}
            lru = {bytes(k) for k, _ in txn.cursor(self.lru)}
        return children, lru

    def stored_blocks(self, txn: Txn) -> list[tuple[bytes, IndexEntry]]:
        return [(bytes(k), IndexEntry.decode(v)) for k, v in txn.cursor(self.blocks)]

    def rewrite_chain_tables(self, txn: Txn, children: dict[bytes, int],
                             lru: set[bytes]) -> None:
        """Replace the derived tables (child counts, LRU rows) with these."""
        for table in (self.children, self.lru):
            txn.drop(table, delete=False)
        for k, n in children.items():
            txn.put(k, pack_count(n), db=self.children)
        for row in lru:
            txn.put(row, b"", db=self.lru)

    def record_extent(self, txn: Txn, extent_id: int, extent_bytes: int,
                      free: Sequence[tuple[int, int]]) -> None:
        """Record an extent found on disk (``--rebuild-index``) and its free runs
        (offset, length), as they are: no merging, no next-extent counter."""
        txn.put(extent_key(extent_id), pack_u64(extent_bytes), db=self.extents)
        for offset, length in free:
            txn.put(free_key(extent_id, offset), pack_u64(length), db=self.free)

    def delete_free_run(self, txn: Txn, extent: int, offset: int) -> None:
        txn.delete(free_key(extent, offset), db=self.free)

    def give_range(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Add [offset, offset+length) to the durable free map, merging neighbours."""
        nxt, prev = self._neighbours(txn, extent, offset)
        end = offset + length
        if nxt is not None and nxt[0] == extent:
            if nxt[1] < end:
                raise _drift(extent, offset, length)
            if nxt[1] == end:
                txn.delete(free_key(extent, end), db=self.free)
                length += nxt[2]
        if prev is not None and prev[0] == extent:
            if prev[1] + prev[2] > offset:
                raise _drift(extent, offset, length)
            if prev[1] + prev[2] == offset:
                txn.delete(free_key(extent, prev[1]), db=self.free)
                offset, length = prev[1], length + prev[2]
        txn.put(free_key(extent, offset), pack_u64(length), db=self.free)


def _adjacent_ranges_merged(entries: Sequence[tuple[bytes, IndexEntry]]
                            ) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
    """The entries' slots as runs (extent, offset, length, its slots), touching slots joined.

    A batch's slots are usually allocated back to back: one ``take_range`` for the run
    instead of one free-map update per slot (a cursor seek, a delete and a put each).
    Only slots that exactly touch are joined; overlapping ones stay apart, so
    ``take_range`` still refuses the second as drift."""
    runs: list[tuple[int, int, int, list[tuple[int, int]]]] = []
    for entry in sorted((e for _, e in entries), key=lambda e: (e.extent, e.offset)):
        if runs and runs[-1][0] == entry.extent and runs[-1][1] + runs[-1][2] == entry.offset:
            extent, offset, length, slots = runs[-1]
            runs[-1] = (extent, offset, length + entry.slot_len, slots)
        else:
            runs.append((entry.extent, entry.offset, entry.slot_len, []))
        runs[-1][3].append((entry.offset, entry.slot_len))
    return runs


class ChainCut(Exception):
    """A put's commit found blocks it deduplicated against unindexed meanwhile; the put
    is redone (it writes them itself).  Internal: never reaches a caller."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        super().__init__(f"{len(keys)} deduplicated block(s) were unindexed before the commit")
        self.keys = list(keys)


def _drift(extent: int, offset: int, length: int) -> KVStoreError:
    return IndexCorruptionError(
        f"allocation map disagrees with the index at extent {extent} offset {offset} "
        f"length {length}; run `python -m kvstore fsck` on the store")


class IndexWriter:
    """The one thread that runs LMDB write transactions, with group commit."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._jobs: queue.SimpleQueue[tuple[Callable[[Txn], Any], Future[Any]] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-lmdb-writer", daemon=True)
        self._thread.start()
        self.commits = 0

    def _run(self) -> None:
        retry: list[tuple[Callable[[Txn], Any], Future[Any]]] = []
        while True:
            if retry:
                batch, retry = retry, []
            else:
                first = self._jobs.get()
                if first is None:
                    return
                batch = [first]
            while True:  # group commit: take everything that queued meanwhile
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)
                    break
                batch.append(nxt)
            done, full = self._commit(batch)
            if full:
                if self._index.grow_map():
                    retry = full  # applied first in the next transaction, on a larger map
                else:
                    err = StoreFullError(
                        28, f"the LMDB index reached its limit, index_map_bytes="
                        f"{self._index.map_limit}; reopen the store with a larger "
                        "index_map_bytes (it is address space: the index file only grows "
                        "as it fills), or delete blocks")
                    done += [(fut, None, err) for _, fut in full]
            for fut, value, exc in done:
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(value)

    def _commit(self, batch: list[tuple[Callable[[Txn], Any], Future[Any]]]) -> tuple[
            list[tuple[Future[Any], Any, BaseException | None]],
            list[tuple[Callable[[Txn], Any], Future[Any]]]]:
        """Apply every job in one transaction, each in a nested one; returns the results
        and the jobs that found the map full (to run again after it grows)."""
        env = self._index.env
        results: list[tuple[Future[Any], Any, BaseException | None]] = []
        full: list[tuple[Callable[[Txn], Any], Future[Any]]] = []
        try:
            with env.begin(write=True) as txn:
                for fn, fut in batch:
                    child = env.begin(write=True, parent=txn)
                    try:
                        value = fn(child)
                    except lmdb.MapFullError:
                        child.abort()
                        full.append((fn, fut))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        child.abort()
                        results.append((fut, None, _translate(e)))
                    else:
                        child.commit()
                        results.append((fut, value, None))
            self.commits += 1
        except lmdb.MapFullError:  # the commit itself needed pages: run the whole batch again
            return [], batch
        except lmdb.Error as e:
            err = StoreIOError(5, f"LMDB commit failed: {e}")
            return [(fut, None, err) for _, fut in batch], []
        return results, full

    def submit(self, fn: Callable[[Txn], T]) -> Future[T]:
        if self._closed:
            raise StoreClosedError("the index writer is closed (the store was closed)")
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def queued(self) -> int:
        """Jobs waiting for the writer thread (not counting the batch being committed)."""
        return self._jobs.qsize()

    def run_sync(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a write transaction and wait (for use off the event loop)."""
        return self.submit(fn).result()

    async def run(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a write transaction; returns after it is durably committed.

        Not cancellable midway: a commit that has started is waited for, so the caller
        never mistakes an applied change for an absent one.  The result comes back through
        the event loop's thread-safe callback, so no worker thread waits per job.
        """
        fut = self.submit(fn)
        done = anyio.Event()
        call_soon = _loop_callback()
        fut.add_done_callback(lambda _: call_soon(done.set))
        with anyio.CancelScope(shield=True):
            await done.wait()
        return fut.result()

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._thread.join()


def _translate(e: BaseException) -> BaseException:
    """What a job raised, as the caller should see it: LMDB's errors become KVStoreErrors."""
    if isinstance(e, lmdb.Error) and not isinstance(e, KVStoreError):
        if isinstance(e, (lmdb.CorruptedError, lmdb.PageNotFoundError)):
            return IndexCorruptionError(f"the LMDB index is damaged ({e}); run "
                                        "`python -m kvstore fsck` on the store")
        return StoreIOError(getattr(e, "errno", 5) or 5, f"LMDB write failed: {e}")
    return e


def _loop_callback() -> Callable[[Callable[[], object]], object]:
    """The running event loop's thread-safe "call this soon" (asyncio or trio)."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token().run_sync_soon  # type: ignore[no-any-return]
        except RuntimeError:  # not inside trio: asyncio runs this task
            pass
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe


def namespace_key(digest: bytes) -> bytes:
    return META_NAMESPACE_PREFIX + digest.hex().encode()


def init_meta(txn: Txn, index: Index, *, store_uuid: bytes, extent_bytes: int) -> None:
    txn.put(META_FORMAT, struct.pack("<I", FORMAT_VERSION), db=index.meta)
    txn.put(META_UUID, store_uuid, db=index.meta)
    txn.put(META_EXTENT_BYTES, pack_u64(extent_bytes), db=index.meta)
    txn.put(META_NEXT_EXTENT, pack_u64(1), db=index.meta)
    txn.put(META_SEQ, pack_u64(0), db=index.meta)


def record_namespace(txn: Txn, index: Index, digest: bytes, canonical_json: str) -> None:
    json.loads(canonical_json)  # only ever store valid JSON
    txn.put(namespace_key(digest), canonical_json.encode(), db=index.meta)
