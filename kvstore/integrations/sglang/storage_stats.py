"""What the SGLang HiCache backend reports (``get_stats``): pages and bandwidth of each
batch read or written since the last report, in the fields of SGLang's
``StorageMetrics``, and the store's own counters.  Imports without SGLang."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvstore.blocking import BlockingStore

__all__ = ["BatchStats", "KVStoreStorageStats", "store_counters"]


@dataclass
class KVStoreStorageStats:
    """What :meth:`KVStoreHiCache.get_stats` returns where SGLang's ``StorageMetrics``
    cannot be imported: the same fields, plus ``kvstore`` (the store's counters)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    kvstore: dict[str, Any] = field(default_factory=dict)


class BatchStats:
    """Pages and GB/s of each batch since the last :meth:`take` (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = KVStoreStorageStats()

    def record(self, get: bool, pages: int, nbytes: int, seconds: float) -> None:
        """A batch of ``pages`` (``nbytes``) read (``get``) or written in ``seconds``."""
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            if get:
                self._taken.prefetch_pgs.append(pages)
                self._taken.prefetch_bandwidth.append(gbps)
            else:
                self._taken.backup_pgs.append(pages)
                self._taken.backup_bandwidth.append(gbps)

    def take(self, store: BlockingStore) -> Any:
        """SGLang's ``StorageMetrics`` of the batches since the last call, with the
        store's counters in ``.kvstore`` (a :class:`KVStoreStorageStats` where SGLang's
        class cannot be imported)."""
        with self._lock:
            taken, self._taken = self._taken, KVStoreStorageStats()
        taken.kvstore = store_counters(store)
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # a partial SGLang install (the tests'): same fields
            return taken
        metrics = StorageMetrics(prefetch_pgs=taken.prefetch_pgs, backup_pgs=taken.backup_pgs,
                                 prefetch_bandwidth=taken.prefetch_bandwidth,
                                 backup_bandwidth=taken.backup_bandwidth)
        metrics.kvstore = taken.kvstore
        return metrics


def store_counters(store: BlockingStore) -> dict[str, Any]:
    """The store's counters SGLang's report carries."""
    s = store.stats()
    names = ("blocks", "stored_bytes", "disk_bytes", "capacity_bytes", "used_bytes", "puts",
             "put_blocks", "put_bytes", "dedup_blocks", "gets", "hits", "misses", "read_bytes",
             "corrupt_blocks", "read_errors", "quarantined_blocks", "evicted_blocks",
             "evicted_bytes", "memory_hits", "dropped_puts", "dropped_blocks", "commits")
    out: dict[str, Any] = {name: getattr(s, name) for name in names}
    out["read_only"] = s.read_only
    out["engine"] = s.engine
    if s.remote:
        out["remote"] = dict(s.remote)
    return out
