"""fsck's checks of format 2's space state (issue 43; kvstore/index/space_counters.py):
the ``claims`` and ``pending`` rows as owners of space in the allocation map (step 3 of
kvstore/tools/fsck.py), the space counters against the tables they sum (step 7), and
the owners left by processes that did not close, told from live ones (step 7)."""

from __future__ import annotations

import os
from contextlib import suppress
from functools import partial
from typing import Any

from kvstore.core.owners import forget
from kvstore.disk.format import FORMAT_VERSION
from kvstore.disk.layout import marks_path, owner_id_of, owner_lock_path, owners_dir
from kvstore.disk.lock import held_owner_locks
from kvstore.index.index import Index
from kvstore.index.owners import OwnerRecord
from kvstore.tools.fsck_files import remove_file
from kvstore.tools.fsck_repairs import Repairs
from kvstore.tools.fsck_report import DAMAGE, NOTE, RECLAIMABLE

__all__ = ["check_counters", "check_owners", "shared_runs"]

Owner = tuple[int, int, int, str, bytes | None]  # extent, offset, length, what, key


def shared_runs(index: Index) -> list[Owner]:
    """Every claim (an owner's space) and pending run (freed, not reusable yet) as an
    owner of its range; the key slot carries its owner id or txnid (the repair of a
    range owned twice drops the row: ``Repairs.drop_later_owner``)."""
    with index.begin() as txn:
        shared = [(run, "claim") for run in index.space.claim_runs(txn)] + \
            [(run, "pending") for run in index.space.pending_runs(txn)]
    return [(extent, offset, length, what, first.to_bytes(8, "big"))
            for (first, extent, offset, length), what in shared]


def check_counters(checker: Repairs, version: int) -> None:
    """The space counters against the tables they sum (a store of an older format has
    none: the next open, or --repair, upgrades it and counts them)."""
    index = checker.index
    if version != FORMAT_VERSION:
        checker.find("old-format", NOTE, f"the store is in on-disk format {version}; the "
                     f"next open (or --repair) upgrades it to {FORMAT_VERSION}")
    else:
        with index.begin() as txn:
            have, want = index.space.read(txn), index.space.actual(txn)
        drift = [f"{k.decode()} {have[k]} (tables: {v})" for k, v in want.items()
                 if have[k] != v]
        if not drift:
            return
        checker.find("counter-drift", DAMAGE, "space counters disagree with their tables: "
                     + ", ".join(drift))
    # first in the repair's transaction, so its other fixes count from true values (its
    # last step recounts after them: Repairs.rewrite_derived)
    checker.fixes.insert(0, index.space.recount)


def check_owners(checker: Repairs, *, beside_live: bool = False) -> None:
    """Owners that did not close (killed, or the machine stopped).  Reclaimable
    (dead-owner): ``--repair`` recovers it as the next open would
    (kvstore/core/owners.py): its claims back to the free pool, its ``creating`` rows and
    row deleted (the extent files they name are orphan extent files, step 2), its lock
    file removed.  A lock file of no owner is a note (stale-owner-lock), removed by
    ``--repair``.

    Under fsck's exclusive lock no owner is live: every ``owners`` row (and every
    ``creating`` row naming an owner) is a dead one.  ``beside_live`` (the check, with
    ``LOCK`` shared): the owners whose lock files are held are live (a note names their
    pids); one whose lock is free is dead only if its rows are still there when read
    again after that probe (a closing owner deletes its row before it lets its lock go,
    and a registering one locks its file before its row exists)."""
    index = checker.index
    rows, creating, claimed = _owners(index)
    if beside_live:
        held = held_owner_locks(checker.path)
        rows_now, creating_now, _ = _owners(index)
        live = sorted(o for o in claimed if o in held)
        still = {*rows_now, *creating_now.values()}
        claimed = {o: n for o, n in claimed.items() if o not in held and o in still}
        if live:
            pids = [rows[o].pid if o in rows else held[o] for o in live]
            checker.report.live_owners = [p for p in pids if p is not None]
            checker.find("live-owners", NOTE, "the store is in use by " + ", ".join(
                f"pid {p}" for p in pids) + ": this check read the index as of one commit "
                "and judged a slot that failed by its key's entry read again; --repair "
                "needs them closed")
        held_files = set(held)
    else:
        held_files = set()
    for owner_id, nbytes in sorted(claimed.items()):
        pid = f"pid {rows[owner_id].pid}" if owner_id in rows else "no owners row"
        making = sorted(e for e, o in creating.items() if o == owner_id)
        f = checker.find("dead-owner", RECLAIMABLE, f"owner {owner_id} ({pid}) did not close: "
                         f"{nbytes} bytes claimed, extents being made: {making or 'none'}; "
                         "--repair recovers it")
        checker.fixes.append(partial(_forget, index=index, owner_id=owner_id))
        checker.file_fixes.append((f, partial(_remove_lock, checker.path, owner_id)))
        # its read mark may be frozen in owners/marks: no owner is live under fsck's
        # exclusive lock, and the file is not durable state (the next open makes it)
        checker.file_fixes.append((f, partial(_remove_marks, checker.path)))
    try:
        names = sorted(os.listdir(owners_dir(checker.path)))
    except FileNotFoundError:
        return
    known = {*rows, *creating.values()}
    for name in names:
        left = owner_id_of(name)
        if left is not None and left not in known and left not in held_files:
            # a registration or a close killed between its transaction and the file's
            # removal (the next open sweeps it too)
            f = checker.find("stale-owner-lock", NOTE, f"{owner_lock_path(checker.path, left)}"
                             " belongs to no owner; --repair removes it")
            checker.file_fixes.append((f, partial(_remove_lock, checker.path, left)))


def _owners(index: Index) -> tuple[dict[int, OwnerRecord], dict[int, int], dict[int, int]]:
    """The ``owners`` rows, the ``creating`` rows (extent -> owner) and the bytes each
    owner of either claims, in one read transaction."""
    with index.begin() as txn:
        rows = index.owner_records.rows(txn)
        creating = index.owner_records.creating_owners(txn)
        claimed = {o: sum(r[2] for r in index.space.claims_of(txn, o))
                   for o in {*rows, *creating.values()}}
    return rows, creating, claimed


def _forget(txn: Any, *, index: Index, owner_id: int) -> None:
    forget(txn, index, owner_id)  # (the files of its creating rows: orphans, step 2)


def _remove_marks(path: str) -> None:
    with suppress(FileNotFoundError):
        remove_file(marks_path(path))


def _remove_lock(path: str, owner_id: int) -> None:
    with suppress(FileNotFoundError):  # (gone already: the row alone says it is dead)
        remove_file(owner_lock_path(path, owner_id))
