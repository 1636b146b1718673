"""fsck's checks of format 2's space state (issue 43; kvstore/index/space_counters.py):
the ``claims`` and ``pending`` rows as owners of space in the allocation map (step 3 of
kvstore/tools/fsck.py), and the space counters against the tables they sum (step 7)."""

from __future__ import annotations

from kvstore.disk.format import FORMAT_VERSION
from kvstore.index.index import Index
from kvstore.tools.fsck_repairs import Repairs
from kvstore.tools.fsck_report import DAMAGE, NOTE

__all__ = ["check_counters", "shared_runs"]

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
