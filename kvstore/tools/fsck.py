"""Offline check and repair of a store: ``python -m kvstore fsck PATH``.

The check runs beside live processes that have the store open: it takes ``LOCK``
shared (a repair cannot start meanwhile), registers no owner and writes nothing to the
store.  ``repair=True`` (and ``rebuild_index``) take ``LOCK`` exclusively and are refused
(:class:`~kvstore.errors.StoreLockedError`, naming the pids) while a store is open.
``check`` runs these steps, each finding classified as *reclaimable* (what a crash
legitimately leaves behind: space or files nobody references) or *damage* (something
the store never produces on its own: a bad sector, a bug, a file edited by hand):

1. Take the store lock; open the LMDB index (every page checked before LMDB maps it:
   kvstore/index/file.py, walked inside the snapshot below when the store may be in
   use; no link followed: store_files.py); check the format.  (else exit 2)
   Every table is read in *one* read transaction (:meth:`Index.one_snapshot`: the
   state of one commit, however many processes write meanwhile) and what the later
   steps need is copied; it ends before any slot is read.  Live owners (their lock
   files held) are listed (note: live-owners).
2. Extent files: none is a link or not a regular file (damage: unsafe-extent-file; never
   read through; repair removes a link, never its target, and drops the extent's
   blocks).  Every extent in the ``extents`` table exists, has its recorded size and
   a valid extent header naming its id and the store's uuid (damage: missing-extent,
   short-extent, bad-extent-header; repair rewrites the header, and gives a short file
   its size back, zero-filled: its blocks past the old end are bad slots, dropped).  A file or header that
   cannot be read or examined (an I/O error) is damage with its errno (unreadable): left
   as it is, its blocks checked one by one, never dropped.  Extent files
   (``NNNNNNNN.kvx``) that the table does not name are left by a crash between creating
   a file and committing it (reclaimable: orphan-extent-file, removed by repair once its
   header reads: one that cannot be read is unreadable, kept); beside live owners, one
   that the index read again names in ``extents`` or ``creating`` is theirs.  Any other file there is
   not the store's: listed, never deleted (note: foreign-file).
3. Allocation map: the ranges of ``blocks`` and ``quarantine`` entries and the runs of the
   ``free``, ``claims`` and ``pending`` tables must tile every extent from 4096 to its
   end exactly once.  Two owners
   of one byte is damage (overlap, free-and-referenced, out-of-bounds); bytes owned by
   nobody are reclaimable (leaked-space).
4. Slot headers: each indexed slot's header must decode and agree with its index entry
   (key, sequence number, lengths, dtype, codec, payload CRC) (damage: bad-slot).  With
   ``deep=True`` every payload's CRC32C is recomputed too (damage: bad-payload).  Slots
   are read after the snapshot ended, without a read mark: a slot that fails is judged
   by its key's entry read again now; if that names another slot (deleted, evicted,
   quarantined or stored again meanwhile) the failure is a race with a live owner, not
   damage (counted in ``Report.slots_changed``).
5. Quarantined blocks (a read failed while serving) are read again, whole: one whose
   header and payload verify is put back into the index by ``--repair`` (reclaimable:
   restorable; if its key was stored again meanwhile, the slot is a redundant copy and
   is freed, never zeroed); one that fails again is reclaimable (quarantined: freed and
   its header zeroed); one that cannot be read is left in quarantine (damage:
   unreadable, not fixed: read again by the next fsck or scrub).  A stored slot whose
   header cannot be read (an I/O error) is damage too (unreadable): ``--repair`` moves it
   to quarantine, never erases it.  Nothing that verifies is ever erased.
6. With ``deep=True``, free space is scanned for slots that still verify: deleted blocks
   and writes of puts that never committed (note: orphan-slot; harmless, as the space is
   free, but ``rebuild_index`` would resurrect them, so ``--repair`` zeroes their headers).
   Only the ``free`` table's runs (as of the snapshot) are scanned, never a claim: an
   owner's claimed space holds its writes in flight.  Beside live owners a put in
   flight may also show as an orphan slot (a note; only the exclusive repair zeroes).
   A range of free space that cannot be read (narrowed to its pages: fsck_files.py) is
   damage with its errno (unreadable), left as it is.
7. Meta records: the sequence counter is at least every entry's, ``next_extent`` is past
   every extent id, namespace records are valid JSON (damage: meta); the space counters
   (``free_bytes``, ``claimed_bytes``, ``pending_bytes``) equal the sums of their tables
   (damage: counter-drift; repair recounts them).  A store of an older format is noted
   (old-format); --repair upgrades it (kvstore/index/space_counters.py).  An ``owners``
   row (fsck's exclusive lock means none is live) is an owner that did not close
   (reclaimable: dead-owner); --repair recovers it as the next open would: its claims
   back to the pool, its rows deleted, its lock file removed (fsck_space.py); a lock
   file of no owner is a note (stale-owner-lock), removed by --repair.  Beside live
   processes an owner is dead only if its lock file is free and its row is still there
   when read again after that probe (a closing owner drops its row first), so no live
   owner's claims or ``creating`` rows are called dead.

8. Chain bookkeeping: the ``children`` counts (stored blocks naming each parent) and the
   ``lru`` rows (one per block, at its last use) must equal what the ``blocks`` table
   implies (damage: refcount-drift; repair rewrites both tables from ``blocks``).  Stored
   blocks whose parent is not stored are holes in their chains (``match_prefix`` stops
   before them), counted in ``Report.chain_holes``: a caller's delete or a quarantine
   (or a repair dropping a damaged block) leaves them legitimately, so they are not
   findings; eviction never does, so holes in a store nobody deleted from point at a bug.
   A tag (``tags`` table) whose key has neither a block nor a quarantine record is an
   orphan (reclaimable: orphan-tag, one finding for all; an older build that does not
   keep tags leaves them when it evicts or deletes); repair drops every tag that is an
   orphan after the other repairs (kvstore/index/tags.py).
9. Permissions: no path under the store grants group/other users more than the store's
   file mode (``file_mode`` meta record, default owner-only 0600/0700) or belongs to
   another user (damage: loose-permissions, repaired by a chmod to the store's mode;
   foreign-owner, which needs a chown by root and stays unfixed) (:mod:`kvstore.disk.permissions`).
   A damaged ``file_mode`` record is meta damage; repair drops it (back to 0600).

Each key owns exactly one slot, so there are no slot reference counts to drift.

``repair=True`` fixes every finding in one LMDB transaction after the data-file changes
are durable: reclaimable space returns to the free map, orphan files are deleted,
orphan slot headers are zeroed, damaged blocks are dropped from the index and their
space freed (their headers zeroed so a rebuild cannot resurrect them), entries of
missing extents are dropped, meta counters are raised.  A second check finds nothing
but what repair never touches: what could not be read (nothing is written over it),
files of another user or program.  A data-file change that fails (an I/O error, a full
or read-only disk) is a finding of its own (repair-failed, with its errno) and leaves
its finding unfixed; an index transaction that fails changes nothing in the index
(repair-failed; run it again).

The checks are here (step 1's opening and what live owners may change: fsck_open.py;
step 7's meta records and step 9: fsck_meta.py; owners and counters: fsck_space.py);
each finding's repair is queued and applied by
kvstore/tools/fsck_repairs.py.  ``rebuild_index`` recreates the index from the extent
files alone: kvstore/tools/fsck_rebuild.py.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

from kvstore.disk import layout
from kvstore.disk.format import (
    EXTENT_HEADER_BYTES,
    PAGE,
    ExtentHeader,
    IndexEntry,
)
from kvstore.disk.layout import extent_path
from kvstore.disk.store_files import unsafe_reason
from kvstore.errors import CorruptionError, IndexCorruptionError, KVStoreError
from kvstore.index.index import Index, IndexWriter
from kvstore.io.protocol import IOEngine
from kvstore.tools.fsck_files import (
    ExtentReader,
    Unreadable,
    extend,
    remove_file,
    rewrite,
    verified_slots,
    verify_slot,
    zero_page,
)
from kvstore.tools.fsck_meta import check_meta, check_permissions
from kvstore.tools.fsck_open import being_made, changed_since, open_for_check, walk_index
from kvstore.tools.fsck_rebuild import rebuild_index
from kvstore.tools.fsck_repairs import Repairs, chain_tables
from kvstore.tools.fsck_report import DAMAGE, NOTE, RECLAIMABLE, Finding, ProgressFn, Report
from kvstore.tools.fsck_space import check_counters, check_owners, shared_runs


def check(path: str, *, repair: bool = False, deep: bool = False,
          progress: ProgressFn | None = None, engine: IOEngine | None = None) -> Report:
    """Check (and with ``repair`` fix) the store at ``path``; see the module docstring.

    Extent files are read through ``engine`` (fsck's for the check: started on fsck's
    own event loop and closed at the end; None: the thread-pool engine, ``O_DIRECT``
    where allowed: kvstore/tools/fsck_files.py)."""
    path = os.path.abspath(path)
    started = time.perf_counter()
    report = Report(path=path, deep=deep, repair=repair)
    if not os.path.isdir(layout.index_dir(path)):
        if os.path.isdir(layout.extents_dir(path)):
            raise IndexCorruptionError(f"{path} has extent files but no index; run "
                                       f"`python -m kvstore fsck {path} --rebuild-index`")
        raise FileNotFoundError(f"no kvstore at {path}")
    index, writer, lock = open_for_check(path, repair)
    try:
        with ExtentReader(engine) as reader:
            _Checker(path, index, writer, reader, report, repair, deep, progress).run()
    finally:
        if writer is not None:
            writer.close()
        index.close()
        lock.release()
    report.seconds = time.perf_counter() - started
    return report


class _Checker(Repairs):
    def __init__(self, path: str, index: Index, writer: IndexWriter | None,
                 reader: ExtentReader, report: Report, repair: bool, deep: bool,
                 progress: ProgressFn | None) -> None:
        super().__init__(report, writer, index, path)
        self.reader, self.repair, self.deep = reader, repair, deep
        self.progress = progress or (lambda stage, done, total: None)
        self.kept: set[int] = set()  # extents that could not be examined: never dropped
        self.unnamed: list[tuple[int, str]] = []  # extent files the table does not name
        # the check shares LOCK with live owners; a repair holds it alone
        self.beside_live = not repair
        self.version = index.meta_records.check_format()  # (older: repair upgrades it)
        self.uuid: bytes = index.meta_records.store_uuid() or b""

    def run(self) -> None:
        with self.index.one_snapshot():  # step 1: every table as of one commit
            if self.beside_live:
                walk_index(self.path)
            extents = self.check_extents()
            entries = self.load_entries()
            self.check_allocation(extents, entries)
            free = [r for r in self.index.free_runs() if extents.get(r[0], 0)]
            check_meta(self, extents, entries)
            check_counters(self, self.version)
            self.check_chains(entries)
            self.check_tags()  # (fsck_repairs.py: the finding and its repair)
        self.check_unnamed()  # (these read the index again, each: fsck_open.py,
        check_owners(self, beside_live=self.beside_live)  # fsck_space.py)
        self.check_slots(extents, entries)
        if self.deep:
            self.scan_free_space(free)
        check_permissions(self)
        if self.repair and self.report.findings:
            self.apply_fixes(self.rewrite_derived)

    # -- step 2
    def check_extents(self) -> dict[int, int]:
        """Extent id -> usable size (0 if the file is unusable)."""
        table = self.index.extents_list()
        self.report.extents = len(table)
        usable: dict[int, int] = {}
        for extent_id, size in sorted(table.items()):
            p = extent_path(self.path, extent_id)
            try:
                usable[extent_id] = self.check_extent(extent_id, size, p)
            except OSError as e:  # lstat, open: kept, never dropped for what was not seen
                self.unreadable(f"{p} cannot be examined; its blocks are left as they are",
                                e, extent=extent_id)
                usable[extent_id] = 0
                self.kept.add(extent_id)
        directory = layout.extents_dir(self.path)
        try:
            names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        except OSError as e:
            self.unreadable(f"{directory} cannot be listed: unnamed files not looked for", e)
            names = []
        for name in names:
            p = os.path.join(directory, name)
            if not layout.is_extent_name(name) or (unsafe_reason(p) and not os.path.islink(p)):
                self.find("foreign-file", NOTE, f"{p} is not an extent file; left alone")
            elif layout.extent_id_of(name) not in table:
                self.unnamed.append((layout.extent_id_of(name), p))  # (after the snapshot)
        for extent_id, size in usable.items():
            if size == 0 and extent_id not in self.kept:
                self.fixes.append(partial(self.index.repairs.drop_extent, extent_id=extent_id))
        return usable

    def check_unnamed(self) -> None:
        """Step 2's extent files the snapshot's table does not name, judged with the
        index read again: one an owner is making or has added since is not an orphan."""
        theirs = being_made(self.index, self.beside_live)
        for extent_id, p in self.unnamed:
            if theirs(extent_id):
                continue
            try:  # removed only once it reads: a rebuild may have left it out for that
                self.reader.read(p, 0, EXTENT_HEADER_BYTES)
            except FileNotFoundError:
                if self.beside_live:  # (an owner's creation that failed removed it)
                    continue
                raise
            except OSError as e:
                self.unreadable(f"{p} is not named by the index and cannot be read; "
                                "left as it is (rebuild the index once it reads)", e)
                continue
            f = self.find("orphan-extent-file", RECLAIMABLE,
                          f"{p} is not named by the index (a crash before its commit)")
            self.file_fixes.append((f, partial(remove_file, p)))

    def check_extent(self, extent_id: int, size: int, p: str) -> int:
        """One extent of the table: its usable size, 0 if it is unusable."""
        if (reason := unsafe_reason(p)) is not None:  # never read or written through
            f = self.find("unsafe-extent-file", DAMAGE, f"{p} is {reason}: the store will "
                          "not open; --repair removes a link (never its target), dropping "
                          "the extent's blocks", extent=extent_id)
            if os.path.islink(p):
                self.file_fixes.append((f, partial(remove_file, p)))
            else:  # not a file the store made: left to the operator
                self.unfixable.append(f)
            return 0
        try:
            actual = os.lstat(p).st_size
        except FileNotFoundError:
            self.find("missing-extent", DAMAGE, f"extent file {p} is missing; its blocks are "
                      "lost", extent=extent_id)
            return 0
        if actual < size:  # the table's size is not trusted: its blocks past the end
            # are read as bad slots (dropped by repair), and repair gives the file its size
            f = self.find("short-extent", DAMAGE, f"{p} has {actual} of {size} bytes: blocks "
                          "past its end are lost; --repair gives it its size back (zeroes)",
                          extent=extent_id)
            self.file_fixes.append((f, partial(extend, p, size)))
        try:
            header = ExtentHeader.decode(self.reader.read(p, 0, EXTENT_HEADER_BYTES))
            if (header.extent_id, header.extent_bytes, header.store_uuid) != \
                    (extent_id, size, self.uuid):
                raise CorruptionError("extent header names another extent or store")
        except OSError as e:
            self.unreadable(f"{p}: its extent header cannot be read; left as it is, its "
                            "blocks checked one by one", e, extent=extent_id, offset=0,
                            length=PAGE)
        except KVStoreError as e:
            f = self.find("bad-extent-header", DAMAGE, f"{p}: {e}", extent=extent_id)
            good = ExtentHeader(extent_id, size, self.uuid).encode()
            self.file_fixes.append((f, partial(rewrite, p, 0, good)))
        return size

    def load_entries(self) -> list[tuple[bytes, IndexEntry, bool]]:
        entries: list[tuple[bytes, IndexEntry, bool]] = []
        for quarantined in (False, True):
            for k, v in self.index.repairs.entry_rows(quarantined=quarantined):
                try:
                    entries.append((k, IndexEntry.decode(v), quarantined))
                except KVStoreError as e:
                    self.find("bad-index-entry", DAMAGE, f"entry {k.hex()}: {e}", key=k.hex())
                    self.fixes.append(partial(self.index.repairs.drop_entry, key=k,
                                              quarantined=quarantined))
        self.report.blocks = sum(not q for _, _, q in entries)
        self.report.quarantined = sum(q for _, _, q in entries)
        return entries

    # -- step 3
    def check_allocation(self, extents: dict[int, int],
                         entries: list[tuple[bytes, IndexEntry, bool]]) -> None:
        owners: list[tuple[int, int, int, str, bytes | None]] = []
        for key, e, _ in entries:
            if extents.get(e.extent, 0) == 0:
                continue  # reported (and dropped on repair) with its extent
            owners.append((e.extent, e.offset, e.slot_len, "entry", key))
        for extent_id, offset, length in self.index.free_runs():
            if extents.get(extent_id, 0):
                owners.append((extent_id, offset, length, "free", None))
        owners += [o for o in shared_runs(self.index) if extents.get(o[0], 0)]
        owners.sort(key=lambda o: (o[0], o[1]))
        by_extent: dict[int, list[tuple[int, int, int, str, bytes | None]]] = {}
        for o in owners:
            by_extent.setdefault(o[0], []).append(o)
        for extent_id, size in extents.items():
            if size == 0:
                continue
            cursor, owner = PAGE, "entry"
            for _, offset, length, what, owner_key in by_extent.get(extent_id, []):
                end = offset + length
                if end > size:
                    self.find("out-of-bounds", DAMAGE,
                              f"{what} [{offset}, {end}) runs past the end ({size}) of extent "
                              f"{extent_id}", extent=extent_id, offset=offset, length=length,
                              key=owner_key.hex() if owner_key else None)
                    self.drop_later_owner(what, owner_key, extent_id, offset)
                    continue
                if offset < cursor:
                    self.find("free-and-referenced" if "free" in (what, owner) else "overlap",
                              DAMAGE, f"{what} [{offset}, {end}) of extent {extent_id} overlaps "
                              "space already owned", extent=extent_id, offset=offset,
                              length=length, key=owner_key.hex() if owner_key else None)
                    self.drop_later_owner(what, owner_key, extent_id, offset)
                    cursor = max(cursor, end)
                    continue
                if offset > cursor:
                    self._leak(extent_id, cursor, offset - cursor)
                cursor, owner = end, what
            if cursor < size:
                self._leak(extent_id, cursor, size - cursor)

    def _leak(self, extent_id: int, offset: int, length: int) -> None:
        self.find("leaked-space", RECLAIMABLE, f"{length} bytes at {offset} of extent "
                  f"{extent_id} are neither free nor referenced", extent=extent_id,
                  offset=offset, length=length)
        self.free_range(extent_id, offset, length)

    # -- steps 4 and 5
    def check_slots(self, extents: dict[int, int],
                    entries: list[tuple[bytes, IndexEntry, bool]]) -> None:
        # --deep reads every payload: progress in bytes (stage "payloads"), else in slots
        stage = "payloads" if self.deep else "slots"
        sizes = [e.slot_len if self.deep else 1 for _, e, _ in entries]
        total, done = sum(sizes), 0
        inside = [0 < e.offset + e.slot_len <= extents.get(e.extent, 0) for _, e, _ in entries]
        reads = self.reader.read_each(  # a quarantined slot is read whole
            (extent_path(self.path, e.extent), e.offset, e.slot_len if q or self.deep else PAGE)
            for (_, e, q), ok in zip(entries, inside) if ok)
        for (key, e, quarantined), n, ok in zip(entries, sizes, inside):
            self.progress(stage, done, total)
            done += n
            if not ok:
                continue
            raw = next(reads)
            where = dict(extent=e.extent, offset=e.offset, length=e.slot_len, key=key.hex())
            if quarantined:
                self._check_quarantined(key, e, raw, where)
                continue
            try:
                verify_slot(raw, key, e, self.deep)
                if self.deep:
                    self.report.payloads_verified += 1
            except OSError as err:
                self.find("unreadable", DAMAGE, f"block {key.hex()} cannot be read "
                          f"({err.strerror}); --repair quarantines it (kept, read again)",
                          errno=err.errno, **where)
                self.quarantine(key, e)
            except KVStoreError as err:
                if changed_since(self.index, key, e, quarantined=False):
                    self.report.slots_changed += 1
                    continue
                kind = "bad-payload" if "payload" in str(err) else "bad-slot"
                f = self.find(kind, DAMAGE, f"block {key.hex()}: {err}", **where)
                self.free_bad_slot(f, key, e, quarantined=False)
        self.progress(stage, total, total)

    def _check_quarantined(self, key: bytes, e: IndexEntry, raw: bytes | OSError,
                           where: dict[str, Any]) -> None:
        """Step 5: a quarantined slot read again, whole (see the module docstring)."""
        try:
            verify_slot(raw, key, e, True)
        except OSError as err:
            self.unreadable(f"quarantined block {key.hex()} cannot be read; left in "
                            "quarantine, read again by the next fsck or scrub", err, **where)
            return
        except KVStoreError as err:
            if changed_since(self.index, key, e, quarantined=True):
                self.report.slots_changed += 1
                return
            f = self.find("quarantined", RECLAIMABLE, f"block {key.hex()} failed a read "
                          f"while serving and fails verification now ({err})", **where)
            self.free_bad_slot(f, key, e, quarantined=True)
            return
        self.report.payloads_verified += 1
        self.find("restorable", RECLAIMABLE, f"quarantined block {key.hex()} verifies now: "
                  "--repair puts it back (or frees it, if its key was stored again)", **where)
        self.restore(key, e)

    # -- step 6
    def scan_free_space(self, runs: list[tuple[int, int, int]]) -> None:
        total = sum(r[2] for r in runs)
        done = 0
        for extent_id, offset, length in runs:
            p = extent_path(self.path, extent_id)

            def unreadable(bad: Unreadable, extent_id: int = extent_id) -> None:
                self.unreadable(f"free space of extent {extent_id}: {bad.length} bytes at "
                                f"{bad.offset} cannot be read; left as it is", bad.error,
                                extent=extent_id, offset=bad.offset, length=bad.length)

            for slot_offset, _ in verified_slots(self.reader, p, offset, length, unreadable):
                f = self.find("orphan-slot", NOTE,
                              f"free space at {slot_offset} of extent {extent_id} holds a valid "
                              "slot no index entry names (deleted, or written by a put that "
                              "never committed" + (", or one in flight in a live owner"
                                                   if self.report.live_owners else "") + ")",
                              extent=extent_id, offset=slot_offset)
                self.file_fixes.append((f, partial(zero_page, p, slot_offset)))
            done += length
            self.progress("free space", done, total)

    # -- step 8
    def check_chains(self, entries: list[tuple[bytes, IndexEntry, bool]]) -> None:
        stored = {key for key, _, quarantined in entries if not quarantined}
        holes = [(key, e.parent) for key, e, quarantined in entries
                 if not quarantined and e.parent is not None and e.parent not in stored]
        self.report.chain_holes = len(holes)
        self.report.chain_hole_examples = [f"{k.hex()} (parent {p.hex()})" for k, p in holes[:3]]
        want_children, want_lru = chain_tables(entries)
        have_children, have_lru = self.index.repairs.chain_tables()
        if have_children == want_children and have_lru == want_lru:
            return
        self.find("refcount-drift", DAMAGE,
                  f"chain child counts or LRU rows disagree with the blocks table "
                  f"({len(have_children)} vs {len(want_children)} parents, {len(have_lru)} vs "
                  f"{len(want_lru)} LRU rows)")


__all__ = ["DAMAGE", "NOTE", "RECLAIMABLE", "Finding", "Report", "check", "rebuild_index"]
