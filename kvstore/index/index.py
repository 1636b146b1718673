"""The LMDB index: block entries, the durable free map, extents, metadata, quarantine.

Tables (FORMAT.md, "Index"):

``meta``        format version, store uuid, extent size, namespaces, counters
``blocks``      16-byte key -> IndexEntry
``extents``     u32 BE extent id -> u64 LE extent size
``free``        (u32 BE extent, u64 BE offset) -> u64 LE length of a free run
``quarantine``  16-byte key -> IndexEntry of a block that failed verification or could
                not be read (flagged ENTRY_FLAG_UNREADABLE), kept to be read again
``tags``        16-byte key -> a caller's opaque tag (optional: kvstore/index/tags.py)

Every change of allocation happens in the same write transaction as the index change
it belongs to, so space is never both free and referenced after a crash.

LMDB allows one write transaction at a time, bound to the thread that began it
(py-lmdb ChangeLog 2.3.0).  All of kvstore's write transactions run on one dedicated
thread with group commit (:class:`~kvstore.index.writer.IndexWriter`, re-exported
here), which translates LMDB's errors and grows the memory map (``set_mapsize``, between
transactions, while no reader is inside one) up to the store's ``index_map_bytes``.
Reads use short read-only transactions on the calling thread; LMDB reads never block on
the writer.

Every transaction the store and fsck run is a method named for what it does, here
(``commit_puts``, ``delete_blocks``, ``evict``, ``pin``, ``add_extent``) or on one of
the index's record classes: ``meta_records`` (kvstore/index/meta.py: every meta record,
the totals and the scrub's place included), ``quarantine_records``
(kvstore/index/quarantine.py) and ``repairs`` (kvstore/index/repairs.py: what fsck reads
as stored and every repair it makes).  No caller builds a transaction over raw tables or
names a table.  Two parts have a module of their own: the free table's runs
(:mod:`kvstore.index.free_map`, ``take_range`` / ``give_range`` here) and the choice of
eviction victims (:mod:`kvstore.index.eviction`, ``evict`` here, over ``chains``).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import cached_property
from itertools import compress, count, islice
from typing import Any

import lmdb

from kvstore.disk import permissions
from kvstore.disk.format import (
    PAGE,
    IndexEntry,
    decode_extent_key,
    extent_key,
    lru_key,
    pack_count,
    pack_u64,
    unpack_count,
    unpack_u64,
)
from kvstore.errors import IndexCorruptionError
from kvstore.index.eviction import ChainTables, lru_leaves
from kvstore.index.file import open_environment
from kvstore.index.free_map import FreeMap
from kvstore.index.journal import DELETED, EVICTED, QUARANTINED, RESTORED, STORED, Journal
from kvstore.index.meta import (
    META_EXTENT_BYTES,
    META_FORMAT,
    META_NAMESPACE_PREFIX,
    META_NEXT_EXTENT,
    META_SCRUB_COMPLETED,
    META_SCRUB_CURSOR,
    META_SEQ,
    META_UUID,
    MetaRecords,
    namespace_key,
)
from kvstore.index.quarantine import QuarantineTable
from kvstore.index.repairs import Repairs
from kvstore.index.tags import TagTable
from kvstore.index.writer import IndexWriter, lmdb_error

__all__ = ["INITIAL_MAP_BYTES", "MAP_LIMIT_BYTES", "META_EXTENT_BYTES", "META_FORMAT", "META_NAMESPACE_PREFIX",
           "META_NEXT_EXTENT", "META_SCRUB_COMPLETED", "META_SCRUB_CURSOR", "META_SEQ",
           "META_UUID", "ChainCut", "Index", "IndexWriter", "Touched", "Txn",
           "init_meta", "namespace_key", "record_namespace"]

Txn = Any  # lmdb.Transaction (untyped module)
Touched = dict[bytes, int]  # key -> last use (us) of recent gets, written lazily

INITIAL_MAP_BYTES = 1 << 30
"""The LMDB map starts at this size (or ``index_map_bytes`` if smaller) and doubles when
full, up to ``index_map_bytes``.  A map is address space, not disk: the data file only
grows as the index does."""

MAP_LIMIT_BYTES = 64 << 30
"""The most the map may grow to unless a store is opened with another
``index_map_bytes`` (the option's default); fsck and ``--rebuild-index`` open an index
with this."""

_DBS = (b"meta", b"blocks", b"extents", b"free", b"quarantine", b"children", b"pins", b"lru")
_TAGS = b"tags"  # optional and additive (FORMAT.md): older builds do not open it


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
                 file_mode: int = permissions.FILE_MODE, verify: bool = False) -> None:
        """Open (or create) the index at ``path`` (``PATH/index``).  The directory and
        LMDB's two files must be the store's own, not links (:mod:`kvstore.disk.store_files`),
        and ``data.mdb`` is checked before LMDB maps it (:mod:`kvstore.index.file`;
        ``verify=True``, fsck's, walks every page).  Damage is
        :class:`~kvstore.errors.IndexCorruptionError`; nothing LMDB raises escapes."""
        self.path = path
        self.map_limit = map_size
        self._gate = _ResizeGate()
        self.env, dbs = open_environment(
            path, map_size=min(map_size, INITIAL_MAP_BYTES), sync=sync, file_mode=file_mode,
            tables=(*_DBS, _TAGS), verify=verify)
        (self.meta, self.blocks, self.extents, self.free, self.quarantine, self.children,
         self.pins, self.lru, tags) = dbs
        self.tags = TagTable(self.begin, tags, self.blocks, self.quarantine)
        self.free_map = FreeMap(self.free)
        self.chains = ChainTables(self.blocks, self.children, self.pins, self.lru)
        # The writer's transaction's record of content changes, while an event sink has
        # subscribers (kvstore/index/journal.py); writer thread only.
        self.journal: Journal | None = None

    def close(self) -> None:
        self.env.close()

    @contextmanager
    def begin(self, *, buffers: bool = False) -> Iterator[Txn]:
        """A read-only transaction (the map is not resized while one is open).  An LMDB
        error inside it (a damaged page) leaves as a KVStoreError."""
        with self._gate.reading():
            try:
                txn: Txn = self.env.begin(buffers=True) if buffers else self.env.begin()
                with txn:
                    yield txn
            except lmdb.Error as e:
                raise lmdb_error(e, "cannot read the index", self.path) from e

    def grow_map(self) -> bool:
        """Double the memory map up to ``map_limit`` (writer thread, between transactions);
        False if it is at the limit already.  LMDB's errors leave as KVStoreErrors."""
        try:
            size = self.env.info()["map_size"]
            if size >= self.map_limit:
                return False
            with self._gate.exclusive():
                self.env.set_mapsize(min(self.map_limit, 2 * size))
        except lmdb.Error as e:
            raise lmdb_error(e, "cannot grow the index's memory map", self.path) from e
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

    def iter_entries(self) -> Iterator[tuple[bytes, IndexEntry]]:
        """Every stored block, in key order."""
        with self.begin() as txn, txn.cursor(self.blocks) as cur:
            for k, v in cur:
                yield k, IndexEntry.decode(v)

    def extents_list(self) -> dict[int, int]:
        with self.begin() as txn, txn.cursor(self.extents) as cur:
            return {decode_extent_key(k): unpack_u64(v) for k, v in cur}

    def free_runs(self) -> list[tuple[int, int, int]]:
        with self.begin() as txn:
            return self.free_map.runs(txn)

    def next_extent(self) -> int:
        return self.meta_records.next_extent()

    def namespaces(self) -> dict[bytes, str]:
        return self.meta_records.namespaces()

    def check_format(self) -> None:
        self.meta_records.check_format()

    # ------------------------------------------------------------------ writes (writer thread)

    def take_range(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Remove [offset, offset+length) from the durable free map (it must be free)."""
        self.free_map.take(txn, extent, offset, length)

    def give_range(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Add [offset, offset+length) to the durable free map, merging neighbours."""
        self.free_map.give(txn, extent, offset, length)

    # ------------------------------------------------------------------ chains, LRU, pins

    def add_block(self, txn: Txn, key: bytes, entry: IndexEntry, *,
                  restored: bool = False, tag: bytes | None = None) -> None:
        """Index a block: entry, LRU row, one more stored child for its parent, and its
        ``tag`` if it has one (else a tag the key kept keeps); ``restored``: a
        quarantined copy that verified, for the event stream."""
        txn.put(key, entry.encode(), db=self.blocks)
        txn.put(lru_key(entry.last_use, key), b"", db=self.lru)
        if entry.parent is not None:
            self.bump(txn, self.children, entry.parent, +1)
        if tag is not None:
            self.tags.put(txn, key, tag)
        if self.journal is not None:
            self.journal.add(RESTORED if restored else STORED, key, entry.parent,
                             tag if tag is not None else self.tags.get(txn, key))

    def remove_block(self, txn: Txn, key: bytes, entry: IndexEntry, *, quarantine: bool,
                     evicted: bool = False) -> None:
        """Unindex a block; its space returns to the free map unless it is quarantined
        (kept allocated so fsck can look at it), and so does its tag (kept while it is
        quarantined).  ``evicted``: for room, not deleted."""
        if not quarantine:
            tag = self.tags.drop(txn, key)
        else:  # (read only for the event: it stays)
            tag = self.tags.get(txn, key) if self.journal is not None else None
        if self.journal is not None:
            self.journal.add(QUARANTINED if quarantine else EVICTED if evicted else DELETED,
                             key, entry.parent, tag)
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
        at most one block more than needed (:func:`kvstore.index.eviction.lru_leaves` chooses
        them).  Recent gets' last use is applied first."""
        if touched:
            self.apply_touched(txn, touched)
        chosen = lru_leaves(txn, self.chains, need, protect, scan_limit)
        for key, entry in chosen.items():
            self.remove_block(txn, key, entry, quarantine=False, evicted=True)
        return list(chosen.items())

    # ------------------------------------------------------------------ the store's transactions

    def commit_puts(self, txn: Txn, entries: Sequence[tuple[bytes, IndexEntry]],
                    touched: Touched, seq: int, relies_on: Sequence[bytes] = (),
                    tags: Mapping[bytes, bytes] | None = None) -> None:
        """Index written blocks: their ranges leave the free map in the same transaction,
        and their ``tags`` (key -> tag, for the keys that have one) go in with them.

        ``relies_on`` are the stored blocks the put deduplicated against; if one of them
        was unindexed since the put decided (an eviction that chose it before the put
        protected it, or a delete), nothing is applied and :class:`ChainCut` names them.
        So it is if a block the put writes was indexed since it decided: a quarantined
        copy that a re-read verified went back (indexing it again would leave its LRU
        row, its parent's child count and its slot behind)."""
        with txn.cursor(self.blocks) as cur:
            gone = [k for k in relies_on if not cur.set_key(k)]
            back = [k for k, _ in entries if cur.set_key(k)]
        if gone or back:
            raise ChainCut(gone + back)
        self.apply_touched(txn, touched)
        self.free_map.take_slots(txn, entries)
        for key, entry in entries:
            self.add_block(txn, key, entry, tag=tags.get(key) if tags else None)
        self.meta_records.raise_seq(txn, seq)

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

    # ------------------------------------------------------------------ quarantine, scrub
    # A quarantine record is a suspicion, not a verdict: its slot keeps its space and goes
    # back into the index when a re-read verifies it (kvstore/index/quarantine.py).

    @cached_property
    def quarantine_records(self) -> QuarantineTable:
        return QuarantineTable(self)

    def block_rows_after(self, after: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` undecoded rows of the blocks table after key ``after`` (None:
        from the first), in key order: the scrub's walk."""
        return self._rows_after(self.blocks, after, limit)

    def quarantine_rows_after(self, after: bytes | None, limit: int
                              ) -> list[tuple[bytes, bytes]]:
        """:meth:`block_rows_after` of the quarantine table: its re-reads."""
        return self._rows_after(self.quarantine, after, limit)

    def _rows_after(self, table: Any, after: bytes | None, limit: int
                    ) -> list[tuple[bytes, bytes]]:
        with self.begin() as txn, txn.cursor(table) as cur:
            if not (cur.set_range(after) if after is not None else cur.first()):
                return []
            return list(islice(((bytes(k), bytes(v)) for k, v in cur if k != after), limit))

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
        self.meta_records.set_next_extent(txn, extent_id + 1)

    # ------------------------------------------------------------------ the other records
    # Meta records (kvstore/index/meta.py) and fsck's reads and repairs
    # (kvstore/index/repairs.py) have a class of their own, each method named for one thing.

    @cached_property
    def meta_records(self) -> MetaRecords:
        return MetaRecords(self.begin, self.meta)

    @cached_property
    def repairs(self) -> Repairs:
        return Repairs(self.begin, blocks=self.blocks, quarantine=self.quarantine,
                       extents=self.extents, children=self.children, lru=self.lru,
                       free_map=self.free_map)

class ChainCut(Exception):
    """A put's commit found blocks it deduplicated against unindexed meanwhile, or
    blocks it writes indexed meanwhile (restored from quarantine); the put is redone
    (it writes the first itself, deduplicates the second).  Internal: never reaches a
    caller."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        super().__init__(f"{len(keys)} block(s) the put decided on were unindexed or "
                         "indexed again before the commit")
        self.keys = list(keys)


def init_meta(txn: Txn, index: Index, *, store_uuid: bytes, extent_bytes: int) -> None:
    index.meta_records.init(txn, store_uuid=store_uuid, extent_bytes=extent_bytes)


def record_namespace(txn: Txn, index: Index, digest: bytes, canonical_json: str) -> None:
    index.meta_records.record_namespace(txn, digest, canonical_json)
