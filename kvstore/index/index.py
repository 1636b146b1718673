"""The LMDB index: block entries, the durable free map, extents, metadata, quarantine.

Tables (FORMAT.md, "Index"):

``meta``        format version, store uuid, extent size, namespaces, counters
``blocks``      16-byte key -> IndexEntry
``extents``     u32 BE extent id -> u64 LE extent size
``free``        (u32 BE extent, u64 BE offset) -> u64 LE length of a free run
``quarantine``  16-byte key -> IndexEntry of a block that failed verification or could
                not be read (flagged ENTRY_FLAG_UNREADABLE), kept to be read again
``owners``      u32 BE owner id -> the open Store it is (kvstore/index/owners.py)
``creating``    u32 BE extent id -> u32 LE owner id: an extent file being made
``claims``, ``pending``  space taken by an owner, space freed not yet reusable
                (kvstore/index/space_counters.py, with the meta counters of free space)
``tags``        16-byte key -> a caller's opaque tag (optional: kvstore/index/tags.py)

Every change of allocation happens in the same write transaction as the index change
it belongs to, so space is never both free and referenced after a crash.

LMDB allows one write transaction at a time, bound to the thread that began it
(py-lmdb ChangeLog 2.3.0).  All of kvstore's write transactions run on one dedicated
thread with group commit (:class:`~kvstore.index.writer.IndexWriter`, re-exported
here), which translates LMDB's errors and grows the memory map (``set_mapsize``, between
transactions, while no reader is inside one) up to the store's ``index_map_bytes``.
Reads use short read-only transactions on the calling thread; LMDB reads never block on
the writer.  Another process on the same store that grew the map shows as LMDB's
``MapResizedError`` at this process's next begin, read or write: the size it recorded
is adopted (``set_mapsize(0)``, between transactions) and the begin retried
(:meth:`Index.adopt_map`).

Every transaction the store and fsck run is a method named for what it does, here
(``commit_puts``, ``delete_blocks``, ``evict``, ``pin``, ``add_extent``) or on one of
the index's record classes: ``meta_records`` (kvstore/index/meta.py: every meta record,
the totals and the scrub's place included), ``quarantine_records``
(kvstore/index/quarantine.py), ``owner_records`` (kvstore/index/owners.py) and ``repairs`` (kvstore/index/repairs.py: what fsck reads
as stored and every repair it makes).  No caller builds a transaction over raw tables or
names a table.  Two parts have a module of their own: the free table's runs
(:mod:`kvstore.index.free_map`, ``take_range`` / ``give_range`` here) and the choice of
eviction victims (:mod:`kvstore.index.eviction`, ``evict`` here, over ``chains``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from functools import cached_property
from itertools import compress, count, islice
from typing import Any, NamedTuple

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
from kvstore.index.map_gate import MapGate
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
from kvstore.index.owners import OwnersTable
from kvstore.index.quarantine import QuarantineTable
from kvstore.index.repairs import Repairs
from kvstore.index.space_counters import SpaceCounters
from kvstore.index.tags import TagTable
from kvstore.index.writer import IndexWriter

__all__ = ["INITIAL_MAP_BYTES", "MAP_LIMIT_BYTES", "META_EXTENT_BYTES", "META_FORMAT", "META_NAMESPACE_PREFIX",
           "META_NEXT_EXTENT", "META_SCRUB_COMPLETED", "META_SCRUB_CURSOR", "META_SEQ",
           "META_UUID", "ChainCut", "Index", "IndexWriter", "Skipped", "Touched", "Txn",
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

_DBS = (b"meta", b"blocks", b"extents", b"free", b"quarantine", b"children", b"pins", b"lru",
        b"owners", b"creating", b"claims", b"pending")
_TAGS = b"tags"  # optional and additive (FORMAT.md): older builds do not open it


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
        self._gate = MapGate()
        self.env, dbs = open_environment(
            path, map_size=min(map_size, INITIAL_MAP_BYTES), sync=sync, file_mode=file_mode,
            tables=(*_DBS, _TAGS), verify=verify)
        (self.meta, self.blocks, self.extents, self.free, self.quarantine, self.children,
         self.pins, self.lru, self.owners, self.creating, claims, pending, tags) = dbs
        self.space = SpaceCounters(self.meta, self.meta_records, self.free, claims, pending)
        self.free_map = FreeMap(self.free, self.space.free_changed)
        self.tags = TagTable(self.begin, tags, self.blocks, self.quarantine)
        self.chains = ChainTables(self.blocks, self.children, self.pins, self.lru)
        # The writer's transaction's record of content changes, while an event sink has
        # subscribers (kvstore/index/journal.py); writer thread only.
        self.journal: Journal | None = None

    def close(self) -> None:
        self.env.close()

    @contextmanager
    def begin(self, *, buffers: bool = False) -> Iterator[Txn]:
        """A read-only transaction (the map is not resized while one is open).  An LMDB
        error inside it (a damaged page) leaves as a KVStoreError.  A map another
        process grew is adopted first (:meth:`MapGate.read_transaction`)."""
        with self._gate.read_transaction(self.env, self.path, buffers=buffers) as txn:
            yield txn

    def one_snapshot(self) -> AbstractContextManager[None]:
        """Every :meth:`begin` of this thread inside is one (:meth:`MapGate.one_snapshot`)."""
        return self._gate.one_snapshot(self.env, self.path)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Held by the writer thread around each write transaction (no resize meanwhile)."""
        with self._gate.writing():
            yield

    def adopt_map(self) -> None:
        """Take the size another process grew the map to (:meth:`MapGate.adopt`)."""
        self._gate.adopt(self.env, self.path)

    def grow_map(self) -> bool:
        """Adopt or double the map up to ``map_limit`` (:meth:`MapGate.grow`)."""
        return self._gate.grow(self.env, self.map_limit, self.path)

    @property
    def map_adoptions(self) -> int:
        return self._gate.adoptions

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

    def namespaces(self) -> dict[bytes, str]:
        return self.meta_records.namespaces()

    # ------------------------------------------------------------------ writes (writer thread)

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
        """Unindex a block; its space goes to ``pending`` unless it is quarantined
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
            self.space.hold(txn, entry.extent, entry.offset, entry.slot_len)

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
                    touched: Touched, relies_on: Sequence[bytes] = (),
                    tags: Mapping[bytes, bytes] | None = None, space: FreeMap | None = None,
                    parents_seen: Collection[bytes] = ()) -> Skipped:
        """Index written blocks: their ranges leave ``space`` (the owner's claims; the
        pool if None) in the same transaction (their sequence numbers came from the
        owner's lease), and their ``tags`` (key -> tag) go in with them.

        ``relies_on`` are the stored blocks the put deduplicated against; if one of them
        was unindexed since the put decided (an eviction that chose it before the put
        protected it, or a delete), nothing is applied and :class:`ChainCut` names them.
        Not indexed (:class:`Skipped`, their slots stay the owner's): a block indexed
        since the put decided (another process, a restore from quarantine), and a block
        whose parent, one of ``parents_seen`` (outside the batch, stored when the put
        decided), is gone (another process evicted or deleted it; not quarantined), with its
        batch descendants."""
        with txn.cursor(self.blocks) as cur:
            gone = [k for k in relies_on if not cur.set_key(k)]
            late = {k for k, _ in entries if cur.set_key(k)}
        vanished = _vanished(txn, self.blocks, self.quarantine, parents_seen)
        if gone:
            raise ChainCut(gone)
        cut = _below(entries, vanished) - late if vanished else set()
        entries = [(k, e) for k, e in entries if k not in late and k not in cut]
        self.apply_touched(txn, touched)
        (space or self.free_map).take_slots(txn, entries)
        for key, entry in entries:
            self.add_block(txn, key, entry, tag=tags.get(key) if tags else None)
        return Skipped(list(late), list(cut))

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
        return _rows_after(self.begin, self.blocks, after, limit)

    def quarantine_rows_after(self, after: bytes | None, limit: int
                              ) -> list[tuple[bytes, bytes]]:
        """:meth:`block_rows_after` of the quarantine table: its re-reads."""
        return _rows_after(self.begin, self.quarantine, after, limit)

    def pin(self, txn: Txn, keys: Sequence[bytes], delta: int) -> None:
        """Add ``delta`` (+1 or -1) to each key's pin count; unpinning an unpinned key is
        a no-op."""
        for key in keys:
            if delta > 0 or txn.get(key, db=self.pins) is not None:
                self.bump(txn, self.pins, key, delta)

    def reserve_extent_id(self, txn: Txn, owner_id: int = 0) -> int:
        """A new extent's id, from ``next_extent`` in a transaction of its own before
        its file is made (unique across processes), ``creating`` its owner's until
        :meth:`add_extent` (kvstore/index/owners.py); an id never recorded is skipped."""
        extent_id = self.meta_records.take_next_extent(txn)
        self.owner_records.start_creating(txn, extent_id, owner_id)
        return extent_id

    def add_extent(self, txn: Txn, extent_id: int, extent_bytes: int) -> None:
        """Record a new (already durable) extent file, its id reserved
        (:meth:`reserve_extent_id`), and its free run."""
        txn.put(extent_key(extent_id), pack_u64(extent_bytes), db=self.extents)
        self.give_range(txn, extent_id, PAGE, extent_bytes - PAGE)
        self.owner_records.done_creating(txn, extent_id)

    # ------------------------------------------------------------------ the other records
    # Meta, owners, fsck's reads and repairs: a class of their own each (meta.py, ...).

    @cached_property
    def meta_records(self) -> MetaRecords:
        return MetaRecords(self.begin, self.meta)

    @cached_property
    def owner_records(self) -> OwnersTable:
        return OwnersTable(self.owners, self.creating, self.meta_records)

    @cached_property
    def repairs(self) -> Repairs:
        return Repairs(self.begin, blocks=self.blocks, quarantine=self.quarantine,
                       extents=self.extents, children=self.children, lru=self.lru,
                       free_map=self.free_map)

def _rows_after(begin: Callable[[], AbstractContextManager[Txn]], table: Any,
                after: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
    with begin() as txn, txn.cursor(table) as cur:
        if not (cur.set_range(after) if after is not None else cur.first()):
            return []
        return list(islice(((bytes(k), bytes(v)) for k, v in cur if k != after), limit))


class Skipped(NamedTuple):
    """The blocks a put's commit did not index (:meth:`Index.commit_puts`): ``late``,
    indexed meanwhile (deduplicated, late); ``evicted``, under a parent evicted
    meanwhile (counted evicted at once: ``evicted_at_commit``)."""

    late: list[bytes]
    evicted: list[bytes]


def _vanished(txn: Txn, blocks: Any, quarantine: Any, parents: Collection[bytes]
              ) -> set[bytes]:
    """``parents`` neither stored nor quarantined (a quarantined parent is not gone:
    restored or put again it is the same block, as for a put whose parent was
    quarantined before it decided)."""
    with txn.cursor(blocks) as cur, txn.cursor(quarantine) as held:
        return {p for p in parents if not cur.set_key(p) and not held.set_key(p)}


def _below(entries: Sequence[tuple[bytes, IndexEntry]], vanished: set[bytes]) -> set[bytes]:
    """Keys of ``entries`` whose parent is in ``vanished``, and their descendants."""
    cut: set[bytes] = set()
    while True:
        more = {k for k, e in entries if k not in cut and e.parent is not None
                and (e.parent in vanished or e.parent in cut)}
        if not more:
            return cut
        cut |= more


class ChainCut(Exception):
    """A put's commit found blocks it deduplicated against unindexed meanwhile; the put
    is redone (it writes them itself).  Internal: never reaches a caller."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        super().__init__(f"{len(keys)} block(s) the put deduplicated against were "
                         "unindexed before its commit")
        self.keys = list(keys)


def init_meta(txn: Txn, index: Index, *, store_uuid: bytes, extent_bytes: int) -> None:
    index.meta_records.init(txn, store_uuid=store_uuid, extent_bytes=extent_bytes)


def record_namespace(txn: Txn, index: Index, digest: bytes, canonical_json: str) -> None:
    index.meta_records.record_namespace(txn, digest, canonical_json)
