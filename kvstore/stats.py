"""What a store reports: :class:`StoreStats` (``Store.stats()``), :class:`PutResult`
(``put_many``), the per-open counters every call path adds to (:data:`COUNTERS`), and
the fields the I/O scheduler adds (the memory tier reports its own fields:
``MemoryTier.stats_fields``).  Stats live here, apart from the call paths: ``Store``
counts, this module reports (``kvstore.metrics`` exports the same fields to Prometheus).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.io.scheduler import IoScheduler

__all__ = ["COUNTERS", "PutResult", "StoreStats", "io_fields", "ratios", "scrub_fields"]

# Counters of one open Store, by the calls that add to them (StoreStats fields of the
# same names); kvstore/index/totals.py persists some of them across opens.
COUNTERS = ("puts", "put_blocks", "put_bytes", "dedup_blocks", "dedup_bytes", "gets", "hits",
            "misses", "read_bytes", "corrupt_blocks", "read_errors", "deletes",
            "evicted_blocks", "evicted_bytes", "put_payload_bytes", "put_retries",
            "put_replans", "memory_hits", "memory_misses", "memory_read_bytes",
            "prefetch_blocks", "prefetch_read_bytes", "dropped_puts", "dropped_blocks",
            "quarantined_blocks", "read_retries", "restored_blocks", "scrubbed_blocks",
            "scrubbed_bytes", "scrub_failed_blocks", "scrub_passes", "dedup_late",
            "raced_reads", "evicted_at_commit")


@dataclass
class StoreStats:
    """A snapshot of the store, from ``Store.stats()``."""

    path: str
    engine: str
    o_direct: bool
    engine_reason: str
    durable: bool
    read_only: bool
    read_only_reason: str | None
    blocks: int
    quarantined: int
    extents: int
    extent_bytes: int
    disk_bytes: int
    free_bytes: int
    stored_bytes: int
    capacity_bytes: int = 0
    used_bytes: int = 0
    peak_used_bytes: int = 0
    pinned_blocks: int = 0
    dedup_ratio: float = 1.0
    compression_ratio: float = 1.0
    put_payload_bytes: int = 0
    puts: int = 0
    put_blocks: int = 0
    put_bytes: int = 0
    dedup_blocks: int = 0
    dedup_bytes: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    read_bytes: int = 0
    corrupt_blocks: int = 0  # block reads that failed verification
    read_errors: int = 0  # block reads that failed with an I/O error, after retries
    read_retries: int = 0  # block reads tried again (alone) after an I/O error
    quarantined_blocks: int = 0  # distinct blocks taken out of the index (each once)
    restored_blocks: int = 0  # quarantined blocks that verified when read again: put back
    scrubbed_blocks: int = 0  # blocks the scrub read and checked
    scrubbed_bytes: int = 0  # slot bytes the scrub read
    scrub_failed_blocks: int = 0  # blocks the scrub found failing (quarantined)
    scrub_passes: int = 0  # scrub passes completed (every block checked once)
    scrub_progress: float = 0.0  # how far the pass in progress is (0: none; key-space fraction)
    scrub_last_complete: float | None = None  # when a pass last completed (Unix s; any process)
    deletes: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    put_retries: int = 0  # puts redone because an eviction cut what they deduplicated against
    put_replans: int = 0  # FP8 puts placed again: a block's values made it fall back to raw
    memory_hits: int = 0  # blocks served from the memory tier (no disk I/O)
    memory_misses: int = 0  # stored blocks a get looked for in memory and read from disk
    memory_read_bytes: int = 0
    memory_capacity_bytes: int = 0  # 0: the memory tier is off
    memory_used_bytes: int = 0
    memory_blocks: int = 0
    memory_evicted_blocks: int = 0
    prefetch_blocks: int = 0  # blocks prefetches brought into memory
    prefetch_read_bytes: int = 0  # bytes prefetches read from disk
    dropped_puts: int = 0  # background puts dropped whole under backpressure
    dropped_blocks: int = 0
    backlog_bytes: int = 0  # bytes of puts in flight now
    io_deferred: dict[str, int] = field(default_factory=dict)  # transfers that waited, by class
    io_queue_depth: dict[str, int] = field(default_factory=dict)  # transfers waiting now
    io_backlog_bytes: dict[str, int] = field(default_factory=dict)  # bytes on the device now
    io_busy_flushes: int = 0  # flushes the scheduler issued to keep writes small under reads
    remote: dict[str, Any] = field(default_factory=dict)  # RemoteStats.as_dict(); {}: no remote
    commits: int = 0
    events_published: int = 0  # content events made while a subscriber was on (this open)
    events_dropped: int = 0  # of them, lost by slow subscribers (each reported as a gap)
    event_subscribers: int = 0  # subscriptions now
    # Issue 43, the processes sharing the store: this store's owner id, the dead owners
    # its open recovered, and the index map sizes another process grew that it adopted
    # (process-wide: the Stores of a process on one path share the index).
    owner_id: int = 0
    owners_recovered: int = 0
    dedup_late: int = 0  # blocks a put wrote that were indexed (another owner) before its commit
    evicted_at_commit: int = 0  # blocks whose parent another owner evicted before their commit
    map_adoptions: int = 0
    # reads whose slot failed verification because the block moved after their lookup
    # (another owner deleted it and reused its slot): misses, not quarantined; 0 expected
    raced_reads: int = 0
    namespaces: list[str] = field(default_factory=list)
    # Since the store was created, all processes (kvstore/index/totals.py); the counters above
    # (puts ... evicted_bytes) count only this Store object since it was opened.
    totals: dict[str, int] = field(default_factory=dict)
    cuda: str = ""  # GPU path of the staging arena (kvstore.io.page_locking.ArenaPageLock)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PutResult:
    """What ``put_many`` did: blocks newly written, blocks skipped as already stored, and
    blocks of a ``background=True`` put dropped whole under backpressure (then nothing
    was written)."""

    written: int
    deduplicated: int
    bytes_written: int
    dropped: int = 0


def ratios(counters: dict[str, int]) -> dict[str, float]:
    """dedup_ratio (bytes offered / bytes written) and compression_ratio (raw / payload)."""
    put, payload = counters["put_bytes"], counters["put_payload_bytes"]
    offered = put + counters["dedup_bytes"]
    return {"dedup_ratio": offered / put if put else 1.0,
            "compression_ratio": put / payload if payload else 1.0}


def io_fields(sched: IoScheduler | None) -> dict[str, Any]:
    """The I/O scheduler's numbers ({} without one)."""
    if sched is None:
        return {}
    return {"io_deferred": dict(sched.deferred), "io_queue_depth": dict(sched.waiting),
            "io_backlog_bytes": dict(sched.inflight), "io_busy_flushes": sched.flushes}


def scrub_fields(progress: float, completed_us: int | None) -> dict[str, float | None]:
    """The scrub's place in its pass and when a pass last completed (Unix seconds)."""
    return {"scrub_progress": progress,
            "scrub_last_complete": None if completed_us is None else completed_us / 1e6}
