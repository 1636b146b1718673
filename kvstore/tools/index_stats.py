"""What ``python -m kvstore stats PATH`` reports: the store read from its index alone,
beside any live processes that have it open (issue 43).  Like fsck's check
(kvstore/tools/fsck_open.py) it takes ``PATH/LOCK`` shared, registers no owner, starts no
I/O engine and writes nothing; every number comes from one read transaction
(:meth:`Index.one_snapshot`: the store as of one commit).  The live owners (their lock
files held) are listed with their pids and ``sync``.

Space, from the format-2 counters (FORMAT.md "Allocation"): ``used_bytes`` is what
capacity bounds, every byte of the extents that is not in the free pool (stored and
quarantined slots, space owners claimed or reserved, freed space not reusable yet);
``stored_bytes`` is that less the claimed and pending space.  A format-1 store has no
counters: its free space is the ``free`` table's sum, and nothing is claimed or pending.
A library caller's ``Store.stats()`` reports its own process's counters besides.
"""

from __future__ import annotations

import os
from typing import Any

from kvstore.core.scrub import key_fraction
from kvstore.disk.format import FORMAT_VERSION, PAGE
from kvstore.disk.lock import held_owner_locks
from kvstore.index.meta import META_CLAIMED_BYTES, META_FREE_BYTES, META_PENDING_BYTES
from kvstore.index.totals import read_totals
from kvstore.tools.fsck_open import open_for_check

__all__ = ["index_stats"]


def index_stats(path: str) -> dict[str, Any]:
    """The store at ``path`` as its index describes it (the module docstring)."""
    path = os.path.abspath(path)
    index, _, lock = open_for_check(path, repair=False)
    try:
        with index.one_snapshot():
            meta = index.meta_records
            version = meta.check_format()
            extents = index.extents_list()
            counts = index.counts()
            with index.begin() as txn:
                space = index.space.read(txn) if version == FORMAT_VERSION else {}
                owners = index.owner_records.rows(txn) if version == FORMAT_VERSION else {}
            free = space.get(META_FREE_BYTES)
            if free is None:
                free = sum(r[2] for r in index.free_runs())
            claimed = space.get(META_CLAIMED_BYTES) or 0
            pending = space.get(META_PENDING_BYTES) or 0
            cursor, completed = meta.scrub_state()
            doc: dict[str, Any] = {
                "path": path, "format_version": version, "blocks": counts["blocks"],
                "quarantined": counts["quarantine"], "pinned_blocks": counts["pins"],
                "extents": len(extents), "extent_bytes": meta.extent_bytes(),
                "disk_bytes": sum(extents.values()), "free_bytes": free,
                "claimed_bytes": claimed, "pending_free_bytes": pending,
                "capacity_bytes": meta.capacity(),
                "namespaces": list(index.namespaces().values()),
                "totals": read_totals(index),
                "scrub_progress": key_fraction(cursor),
                "scrub_last_complete": None if completed is None else completed / 1e6}
        usable = doc["disk_bytes"] - PAGE * len(extents)
        doc["used_bytes"] = usable - free
        doc["stored_bytes"] = usable - free - claimed - pending
        held = held_owner_locks(path)  # after the snapshot: the owners alive now
        doc["live_owners"] = [{"owner_id": o, "pid": r.pid, "sync": r.sync}
                              for o, r in sorted(owners.items()) if o in held]
        return doc
    finally:
        index.close()
        lock.release()
