"""fsck's findings and the repairs they call for (kvstore/tools/fsck.py checks).

A check records a finding and queues its repair here; ``--repair`` then applies them in
the order that keeps the store safe: the data-file changes first, each durable, then
every index change in one transaction (:meth:`Repairs.apply_fixes`), the chain tables
recomputed last from what ``blocks`` holds by then.  A data-file change that fails is
a finding of its own (repair-failed) and leaves its finding unfixed; an index
transaction that fails changes nothing.  What could not be read is never repaired.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from kvstore.disk.format import IndexEntry, lru_key
from kvstore.disk.layout import extent_path
from kvstore.errors import KVStoreError
from kvstore.index.index import Index, IndexWriter, Txn
from kvstore.index.quarantine import OK
from kvstore.tools.fsck_files import zero_page
from kvstore.tools.fsck_report import DAMAGE, RECLAIMABLE, Finding, Report

__all__ = ["Repairs", "chain_tables"]


class Repairs:
    """The report's findings and the repairs they call for: the data-file changes first
    (each durable), then the index's, in one transaction."""

    def __init__(self, report: Report, writer: IndexWriter | None, index: Index,
                 path: str) -> None:
        self.report, self.writer, self.index, self.path = report, writer, index, path
        self.fixes: list[Callable[[Txn], None]] = []
        self.unfixable: list[Finding] = []  # stay unfixed after --repair (foreign-owner)
        self.file_fixes: list[tuple[Finding, Callable[[], None]]] = []  # before the index's

    def find(self, kind: str, severity: str, detail: str, **where: Any) -> Finding:
        f = Finding(kind, severity, detail, **where)
        self.report.findings.append(f)
        return f

    def unreadable(self, detail: str, e: OSError, **where: Any) -> None:
        """Damage that repair leaves as it is: nothing is written over what could not be
        read (the next fsck or scrub reads it again)."""
        self.unfixable.append(self.find("unreadable", DAMAGE, f"{detail} ({e.strerror})",
                                        errno=e.errno, **where))

    def apply_fixes(self, last: Callable[[Txn], None]) -> None:
        """Every fix, ``last`` the last in the index transaction; marks what was fixed."""
        found = list(self.report.findings)
        for f, fn in self.file_fixes:
            try:
                fn()
            except OSError as e:
                self.unfixable.append(f)
                self.find("repair-failed", DAMAGE, f"could not fix {f.kind} ({e.strerror}): "
                          f"{f.detail}", extent=f.extent, offset=f.offset, errno=e.errno)
        fixes = [*self.fixes, last]

        def apply(txn: Txn) -> None:
            for fix in fixes:
                fix(txn)

        assert self.writer is not None, "a repair opens the index with its writer"
        try:
            self.writer.run_sync(apply)
        except KVStoreError as e:  # the index as it was: nothing of it is fixed
            self.find("repair-failed", DAMAGE, f"the repair's index transaction failed, the "
                      f"index is as it was: {e}; run the repair again",
                      errno=e.errno if isinstance(e, OSError) else None)
            return
        for f in found:
            # Never touched: files fsck did not create, files of another user, what
            # could not be read, fixes that failed.
            f.fixed = f.kind != "foreign-file" and all(f is not u for u in self.unfixable)

    def check_tags(self) -> None:
        """Step 8's tags: orphans are reclaimable; :meth:`last_fixes` drops them."""
        orphans = self.index.tags.orphans()
        if orphans:
            self.find("orphan-tag", RECLAIMABLE,
                      f"{len(orphans)} tag(s) of blocks no longer stored (left by a build "
                      f"that does not keep tags), e.g. {orphans[0].hex()}; --repair drops them")

    # ------------------------------------------------------------------ the repairs

    def free_range(self, extent_id: int, offset: int, length: int) -> None:
        """Leaked space back to the free map."""
        self.fixes.append(lambda txn: self.index.give_range(txn, extent_id, offset, length))

    def drop_later_owner(self, what: str, key: bytes | None, extent_id: int,
                         offset: int) -> None:
        """Repair of a double-owned range: drop the later owner (a free run, a claims or
        pending row: ``key`` its owner or txnid, or an entry)."""
        if what == "free":
            self.fixes.append(partial(self.index.repairs.delete_free_run, extent=extent_id,
                                      offset=offset))
        elif what in ("claim", "pending"):
            assert key is not None
            self.fixes.append(partial(self.index.space.drop_run, claimed=what == "claim",
                                      first=int.from_bytes(key, "big"), extent=extent_id,
                                      offset=offset))
        else:
            assert key is not None
            self.fixes.append(partial(self.index.repairs.drop_entry, key=key))

    def quarantine(self, key: bytes, e: IndexEntry) -> None:
        """A stored block that cannot be read: to quarantine, kept (read again later)."""
        def fix(txn: Txn) -> None:
            self.index.quarantine_records.move(txn, [(key, e, True)])

        self.fixes.append(fix)

    def restore(self, key: bytes, e: IndexEntry) -> None:
        """A quarantined block that verifies: back into the index (or freed, if its key
        was stored again)."""
        def fix(txn: Txn) -> None:
            self.index.quarantine_records.settle(txn, [(key, e, OK)])

        self.fixes.append(fix)

    def free_bad_slot(self, f: Finding, key: bytes, e: IndexEntry, *, quarantined: bool) -> None:
        """A block that fails verification: its header zeroed (no rebuild resurrects it),
        its row dropped and its slot freed."""
        p = extent_path(self.path, e.extent)
        self.file_fixes.append((f, partial(zero_page, p, e.offset)))
        self.fixes.append(partial(self.index.repairs.free_slot, key=key, entry=e,
                                  quarantined=quarantined))

    def rewrite_derived(self, txn: Txn) -> None:
        """The last step of a repair, after every other fix has changed ``blocks`` and
        ``quarantine``: the chain tables rewritten, the orphan tags dropped, then the
        space counters recounted (they follow every repair of the tables they sum; this
        mends drift) and the format upgraded if the store was of an older one."""
        self.rewrite_chain_tables(txn)
        self.index.tags.drop_orphans(txn)
        self.index.space.recount(txn)
        self.index.space.upgrade(txn)

    def rewrite_chain_tables(self, txn: Txn) -> None:
        """Recompute ``children`` and ``lru`` from ``blocks`` (the last step of a repair,
        after every other fix has changed ``blocks``)."""
        blocks = [(k, e, False) for k, e in self.index.repairs.stored_blocks(txn)]
        self.index.repairs.rewrite_chain_tables(txn, *chain_tables(blocks))


def chain_tables(entries: list[tuple[bytes, IndexEntry, bool]]
                 ) -> tuple[dict[bytes, int], set[bytes]]:
    """What the ``children`` counts and ``lru`` rows must be, from the stored blocks."""
    children: dict[bytes, int] = {}
    lru: set[bytes] = set()
    for key, e, quarantined in entries:
        if quarantined:
            continue
        lru.add(lru_key(e.last_use, key))
        if e.parent is not None:
            children[e.parent] = children.get(e.parent, 0) + 1
    return children, lru
