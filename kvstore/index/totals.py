"""Store-lifetime totals (puts, dedup, evictions, corruption), persisted in the index.

``Store.stats()`` counters say what one ``Store`` object did since it was opened; an
operator asking "how much has this store deduplicated?" wants the store's history.
These totals are meta records ``total:<name>`` (u64 LE, FORMAT.md "Meta records";
written by ``Index.meta_records``, kvstore/index/meta.py) that
the store raises inside its own write transactions by what its counters grew since the
previous one: :meth:`Totals.flush` rides along in every transaction that commits puts,
evicts or records last use (``StoreParts.flush_totals_in`` / ``last_writes``,
kvstore/core/opening.py), and runs once more at close (``StoreParts.flush_totals``, a cleanup
run before the writer thread stops) for the counts of the last operations.

They are statistics, not state: a crash (or a write transaction that fails) loses at
most the counts since the last commit, fsck does not check them, and
``fsck --rebuild-index`` starts them again at 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvstore.index.index import Index, Txn

TOTAL_NAMES = ("puts", "put_blocks", "put_bytes", "dedup_blocks", "dedup_bytes",
               "evicted_blocks", "evicted_bytes", "corrupt_blocks")


def read_totals(index: Index) -> dict[str, int]:
    """The persisted totals of the store behind ``index``."""
    return index.meta_records.totals(TOTAL_NAMES)


class Totals:
    """Adds a store's per-open ``counters`` to the persisted totals, a delta at a time."""

    def __init__(self, counters: Mapping[str, int]) -> None:
        self._counters = counters
        self._flushed = dict.fromkeys(TOTAL_NAMES, 0)

    def pending(self) -> bool:
        return any(self._counters[n] != self._flushed[n] for n in TOTAL_NAMES)

    def flush(self, txn: Txn, index: Index) -> None:
        """Raise the records by what the counters grew since the last flush (writer thread;
        the event loop may raise a counter meanwhile: that growth goes to the next flush)."""
        now = {name: self._counters[name] for name in TOTAL_NAMES}
        deltas = {name: n - self._flushed[name] for name, n in now.items() if n != self._flushed[name]}
        if deltas:
            index.meta_records.add_to_totals(txn, deltas)
            self._flushed.update(now)

    def current(self, index: Index) -> dict[str, int]:
        """Persisted totals plus what this store counted and has not flushed yet."""
        stored = read_totals(index)
        return {n: stored[n] + self._counters[n] - self._flushed[n] for n in TOTAL_NAMES}


__all__ = ["TOTAL_NAMES", "Totals", "read_totals"]
