"""What :mod:`kvstore.metrics` exports: every metric family (:data:`METRICS`), the
``StoreStats`` field each one reads (``MetricSpec.source``: the mapping where the names
differ, e.g. ``kvstore_deleted_blocks_total`` from ``deletes``), the fields left out
and why (:data:`UNEXPORTED`), and the docs' table (:func:`metric_table`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.stats import StoreStats

__all__ = ["CLASS", "LATENCY", "METRICS", "TIER", "UNEXPORTED", "UP", "MetricSpec", "Samples",
           "metric_table"]

Samples = dict[tuple[str, ...], float]  # extra label values (beyond ``store``) -> value
Reader = Callable[[StoreStats], Samples]


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: its exposition name, type, labels beyond ``store``, meaning,
    and how to read it from a ``StoreStats`` (None: ``kvstore_up`` and the latency
    histogram, made by the collector itself)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    labels: tuple[str, ...]
    help: str
    read: Callable[[StoreStats], Samples] | None = None

    @property
    def source(self) -> str:
        """The ``StoreStats`` field(s) it is read from ("" for those the collector makes)."""
        return str(getattr(self.read, "source", ""))


_ABSENT = object()


@dataclass(frozen=True)
class _Read:
    """A reader of one metric's samples, and the ``StoreStats`` field(s) it reads."""

    source: str
    fn: Reader

    def __call__(self, stats: StoreStats) -> Samples:
        return self.fn(stats)


def _has(stats: StoreStats, name: str) -> bool:
    return getattr(stats, name, _ABSENT) is not _ABSENT


def _field(name: str) -> _Read:
    """A plain field; nothing when this store's StoreStats has no such field."""
    def read(stats: StoreStats) -> Samples:
        return {(): float(getattr(stats, name))} if _has(stats, name) else {}
    return _Read(name, read)


def _tiers(disk: str, memory: str, *, less: str | None = None) -> _Read:
    """``tier="disk"`` always (field ``disk``, less field ``less`` if the store has it);
    ``tier="memory"`` when the store has the ``memory`` field."""
    def read(stats: StoreStats) -> Samples:
        on_disk = float(getattr(stats, disk)) - (_memory(stats, less) if less else 0.0)
        out: Samples = {("disk",): on_disk}
        if _has(stats, memory):
            out[("memory",)] = float(getattr(stats, memory))
        return out
    return _Read(f"{disk}{f' - {less}' if less else ''}; memory: {memory}", read)


def _per_class(name: str) -> _Read:
    """A ``{class: value}`` field of the I/O scheduler, one sample per class."""
    def read(stats: StoreStats) -> Samples:
        values: dict[str, float] = getattr(stats, name, None) or {}
        return {(str(cls),): float(v) for cls, v in sorted(values.items())}
    return _Read(name, read)


def _remote(key: str, value: Callable[[Any], float] = float) -> _Read:
    """``value`` of one number of the remote tier's stats (``stats.remote[key]``);
    nothing when the store has no remote tier."""
    def read(stats: StoreStats) -> Samples:
        remote = getattr(stats, "remote", None)
        return {(): float(value(remote[key]))} if remote else {}
    return _Read(f"remote[{key!r}]", read)


def _info(stats: StoreStats) -> Samples:
    """The store's identity as labels of one sample, 1: its engine, O_DIRECT,
    durability and its owner id (the processes sharing a store have one each)."""
    return {(stats.engine, str(stats.o_direct).lower(), str(stats.durable).lower(),
             str(stats.owner_id)): 1.0}


def _memory(stats: StoreStats, name: str) -> float:
    return float(getattr(stats, name, 0))


def _counter(name: str, help: str, read: Reader, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(f"kvstore_{name}_total", "counter", labels, help, read)


def _gauge(name: str, help: str, read: Reader, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(f"kvstore_{name}", "gauge", labels, help, read)


TIER = ("tier",)
CLASS = ("class",)
UP = MetricSpec("kvstore_up", "gauge", (), "1 while the store is open, 0 once it is closed "
                "(a closed store exports nothing else)")
LATENCY = MetricSpec("kvstore_operation_duration_seconds", "histogram", ("op",),
                     "Duration of store calls, failed and cancelled ones included "
                     "(op: get = get_many, put = put_many, prefetch)")

METRICS: tuple[MetricSpec, ...] = (
    UP,
    _gauge("read_only", "1 once the store stopped accepting writes after an I/O error "
           "(reads still work), else 0", _field("read_only")),
    _counter("puts", "put_many calls (a put is one)", _field("puts")),
    _counter("put_blocks", "Blocks written by puts (not already stored)", _field("put_blocks")),
    _counter("put_bytes", "Bytes of the blocks written, as given (before the codec)",
             _field("put_bytes")),
    _counter("written_bytes", "Bytes written per tier (disk: block payloads after the codec)",
             _tiers("put_payload_bytes", "memory_written_bytes"), TIER),
    _counter("dedup_blocks", "Blocks a put skipped because they were already stored",
             _field("dedup_blocks")),
    _counter("dedup_bytes", "Bytes of the blocks skipped as already stored",
             _field("dedup_bytes")),
    _counter("put_retries", "Puts decided again because an eviction removed a block they "
             "deduplicated against", _field("put_retries")),
    _counter("put_replans", "FP8 puts encoded and placed again because a block's values "
             "made the codec fall back to raw (its slot was sized for FP8)",
             _field("put_replans")),
    _counter("dropped_puts", "Background puts dropped whole under write backpressure",
             _field("dropped_puts")),
    _counter("dropped_blocks", "Blocks of the background puts dropped under backpressure",
             _field("dropped_blocks")),
    _counter("gets", "get_many calls (a get is one)", _field("gets")),
    _counter("hits", "Blocks a get found, by the tier that served them",
             _tiers("hits", "memory_hits", less="memory_hits"), TIER),
    _counter("misses", "Blocks a get looked for and did not find in the tier",
             _tiers("misses", "memory_misses"), TIER),
    _counter("read_bytes", "Bytes of blocks served, by the tier that served them",
             _tiers("read_bytes", "memory_read_bytes"), TIER),
    _counter("prefetched_blocks", "Blocks brought into the memory tier by prefetch",
             _field("prefetch_blocks")),
    _counter("evicted_blocks", "Blocks evicted from disk to stay within capacity",
             _field("evicted_blocks")),
    _counter("evicted_bytes", "Slot bytes freed by evictions", _field("evicted_bytes")),
    _counter("corrupt_blocks", "Blocks that failed verification on read (quarantined, "
             "answered as misses)", _field("corrupt_blocks")),
    _counter("read_errors", "Block reads that failed with an I/O error, after retries "
             "(answered as misses)", _field("read_errors")),
    _counter("read_retries", "Block reads tried again, alone, after an I/O error or a short "
             "read (a merged read that failed is retried block by block)",
             _field("read_retries")),
    _counter("blocks_quarantined", "Blocks taken out of the index because a read of them "
             "failed (each block once, however many reads failed on it)",
             _field("quarantined_blocks")),
    _counter("restored_blocks", "Quarantined blocks that verified when read again (a later "
             "re-read, the scrub) and were put back", _field("restored_blocks")),
    _counter("scrubbed_blocks", "Blocks the scrub read and checked", _field("scrubbed_blocks")),
    _counter("scrubbed_bytes", "Slot bytes the scrub read", _field("scrubbed_bytes")),
    _counter("scrub_failed_blocks", "Blocks the scrub found failing (now quarantined)",
             _field("scrub_failed_blocks")),
    _counter("scrub_passes", "Scrub passes completed (every stored block checked once)",
             _field("scrub_passes")),
    _gauge("scrub_progress_ratio", "How far the scrub's pass in progress is, 0 to 1 (0: none "
           "in progress)", _field("scrub_progress")),
    _gauge("scrub_last_complete_timestamp_seconds", "When a scrub pass of this store last "
           "completed, in Unix time (any process; absent: never)",
           _Read("scrub_last_complete", lambda s: {} if s.scrub_last_complete is None
                 else {(): s.scrub_last_complete})),
    _counter("deleted_blocks", "Blocks deleted by delete_many", _field("deletes")),
    _counter("index_commits", "Index write transactions committed", _field("commits")),
    _gauge("used_bytes", "Bytes in use per tier (disk: slots stored, quarantined, reserved "
           "or waiting for readers: what capacity bounds)",
           _tiers("used_bytes", "memory_used_bytes"), TIER),
    _gauge("capacity_bytes", "The most used_bytes may reach, per tier",
           _tiers("capacity_bytes", "memory_capacity_bytes"), TIER),
    _gauge("peak_used_bytes", "Highest disk used_bytes since the store was opened",
           _field("peak_used_bytes")),
    _gauge("stored_bytes", "Bytes of the slots in the extent files (not free, extent "
           "headers not counted)", _field("stored_bytes")),
    _gauge("free_bytes", "Free bytes inside the extent files", _field("free_bytes")),
    _gauge("disk_bytes", "Size of the extent files", _field("disk_bytes")),
    _gauge("blocks", "Blocks stored, per tier", _tiers("blocks", "memory_blocks"),
           TIER),
    _gauge("pinned_blocks", "Blocks pinned against eviction", _field("pinned_blocks")),
    _gauge("quarantined_blocks", "Blocks in quarantine now: a read failed; read again later "
           "(re-reads, the scrub, fsck) and put back if they verify", _field("quarantined")),
    _gauge("io_queue_depth", "I/O requests waiting, per scheduling class",
           _per_class("io_queue_depth"), CLASS),
    _gauge("io_backlog_bytes", "Bytes of transfers on the device, per scheduling class",
           _per_class("io_backlog_bytes"), CLASS),
    _counter("io_deferred", "Transfers that waited for their class's turn (read-first "
             "scheduling), per scheduling class", _per_class("io_deferred"), CLASS),
    _counter("io_busy_flushes", "Flushes the I/O scheduler issued itself while reads were "
             "served, so that each flush (which reads wait behind) stays small",
             _field("io_busy_flushes")),
    _gauge("put_backlog_bytes", "Bytes of puts in flight (past open(backlog_bytes=...) "
           "background puts are dropped, foreground puts wait)", _field("backlog_bytes")),
    _gauge("remote_up", "1 while the remote tier answers (0: breaker open or disabled)",
           _remote("state", lambda state: float(state in ("ok", "probing")))),
    _counter("remote_hits", "Blocks fetched from the remote tier and verified",
             _remote("hits")),
    _counter("remote_joined", "Blocks a read took from another read's fetch in flight "
             "(requested once, not once per reader)", _remote("joined")),
    _counter("remote_misses", "Blocks looked up in the remote tier and not found (or not "
             "fetched by the deadline)", _remote("misses")),
    _counter("remote_bad_objects", "Remote objects that failed verification (CRC, key, "
             "HMAC): answered as misses", _remote("bad_objects")),
    _counter("remote_fast_misses", "Blocks answered as misses without a request while the "
             "breaker was open", _remote("fast_misses")),
    _counter("remote_breaker_trips", "Times the remote tier's circuit breaker opened",
             _remote("breaker_trips")),
    _counter("remote_uploaded_blocks", "Blocks uploaded to the remote tier",
             _remote("uploaded_blocks")),
    _counter("remote_upload_dropped", "Blocks not uploaded (queue full, or queued at close)",
             _remote("upload_dropped")),
    _counter("remote_promoted_blocks", "Blocks fetched from the remote tier and stored "
             "locally", _remote("promoted_blocks")),
    _counter("remote_promotion_dropped", "Blocks fetched from the remote tier and not "
             "stored locally (backpressure, full or read-only store)",
             _remote("promotion_dropped")),
    _gauge("remote_upload_queue_blocks", "Blocks waiting for upload",
           _remote("upload_queue_blocks")),
    _gauge("store_info", "The store as this process opened it, as labels of one sample "
           "(1): its I/O engine, O_DIRECT, durability (sync), and its owner id: each "
           "process (each open Store) sharing a store directory is an owner of its own",
           _Read("engine, o_direct, durable, owner_id", _info),
           ("engine", "o_direct", "durable", "owner_id")),
    _gauge("extents", "Extent files of the store", _field("extents")),
    _gauge("extent_size_bytes", "Size of each extent file", _field("extent_bytes")),
    _counter("memory_evicted_blocks", "Blocks the memory tier dropped to make room for "
             "others (its own LRU; blocks gone from disk are not counted)",
             _field("memory_evicted_blocks")),
    _counter("prefetch_read_bytes", "Bytes prefetches read from disk into the memory tier",
             _field("prefetch_read_bytes")),
    _counter("dedup_late_blocks", "Blocks a put wrote that another owner of the store "
             "indexed before its commit: counted as deduplicated, their slots given back",
             _field("dedup_late")),
    _counter("evicted_at_commit_blocks", "Blocks a put wrote whose parent another owner "
             "evicted or deleted before its commit: not indexed (counted evicted too)",
             _field("evicted_at_commit")),
    _counter("raced_reads", "Reads whose slot failed verification because another owner "
             "reused it after the lookup (answered as misses; 0 expected: read marks "
             "prevent it)", _field("raced_reads")),
    _counter("owners_recovered", "Owners of the store that did not close (killed "
             "processes) that this store's open recovered", _field("owners_recovered")),
    _counter("map_adoptions", "Sizes of the index's memory map that another process grew "
             "and this process took (per process: the stores of a process share the index)",
             _field("map_adoptions")),
    _counter("events_published", "Content events made while a subscriber was on",
             _field("events_published")),
    _counter("events_dropped", "Content events lost by slow subscribers (each a gap in "
             "their stream)", _field("events_dropped")),
    _gauge("event_subscribers", "Event stream subscriptions open now",
           _field("event_subscribers")),
    LATENCY,
)
"""Every metric the collector can export, in exposition order."""

UNEXPORTED: dict[str, str] = {
    "path": "the `store` label of every sample",
    "engine_reason": "text: why the I/O engine was chosen",
    "read_only_reason": "text: why writes stopped (`kvstore_read_only` is the number)",
    "cuda": "text: the GPU path of the staging arena",
    "namespaces": "text: the key namespaces recorded in the store",
    "dedup_ratio": "derived: (put_bytes + dedup_bytes) / put_bytes, from exported counters",
    "compression_ratio": "derived: put_bytes / written_bytes{tier=\"disk\"}",
    "totals": "the store's history over all processes and opens: exported by each of "
              "the processes sharing a store, a sum over them would count it as often; "
              "`python -m kvstore stats` prints it",
}
"""The ``StoreStats`` fields no metric reads, and why (a test keeps this list exact)."""


def metric_table() -> str:
    """docs/metrics.md's metric list (Markdown), made from :data:`METRICS`, with the
    ``stats()`` field each metric is read from."""
    rows = ["| Metric | Type | Labels | From `stats()` | Meaning |", "|---|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(("store", *spec.labels))
        source = f"`{spec.source}`" if spec.source else "-"
        rows.append(f"| `{spec.name}` | {spec.kind} | {labels} | {source} | {spec.help} |")
    return "\n".join(rows) + "\n"

