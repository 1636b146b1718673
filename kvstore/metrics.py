"""Prometheus metrics of open stores, through ``prometheus_client`` (``kvstore[metrics]``).

Two ways in::

    # an engine with its own registry (vLLM's is prometheus_client.REGISTRY)
    kvstore.metrics.register(store)                 # or register(store, registry)

    # standalone: an HTTP endpoint of its own
    with kvstore.metrics.serve(store, port=9400) as server:   # port=0: any free port
        ...                                         # GET http://127.0.0.1:9400/metrics

Nothing is counted twice: a scrape calls ``store.stats()`` and ``store.latency.snapshot()``
and turns them into metric families (:class:`StoreCollector`, a custom collector; the
exposition format is prometheus_client's).  :data:`METRICS` lists every metric; the
README's table is :func:`metric_table` (a test keeps the two equal).

Rules a reader of the numbers should know:

- Every sample has a ``store`` label (the store's path), so several stores in one
  process are told apart; registering a store at a path that is already registered
  replaces the old one (a reopened store).
- ``kvstore_up`` is 1 while a store is open and 0 once it is closed; a closed store
  exports nothing else (its counters died with it), and a scrape never fails because of
  it.  ``unregister`` removes it.
- Counters are per open ``Store`` object (``StoreStats``), so they restart at 0 when a
  store is reopened; Prometheus' ``rate()`` handles that as a counter reset.
- A family the store has no field for (the memory tier's, the I/O scheduler's, on a
  build without them) is left out rather than exported as a made-up 0.  Per-tier
  counters: ``hits``/``misses`` in ``StoreStats`` count what ``get_many`` answered over
  all tiers, so ``tier="disk"`` hits are ``hits - memory_hits`` and ``tier="disk"``
  misses are ``misses`` (a block missing from disk is missing); bytes are counted where
  they were read or written.
- ``stats()`` runs on the store's event loop (a ``Store`` is used from the loop that
  opened it): a scrape from another thread (the HTTP server's) hands the call to that
  loop and waits for it, so register/serve a ``Store`` from its loop, or pass a
  ``BlockingStore``, whose calls are thread-safe.  A loop that is blocked delays the
  scrape by as long.
"""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio
import anyio.from_thread
import anyio.lowlevel

from kvstore.blocking import BlockingStore
from kvstore.core.latency import HistogramSnapshot
from kvstore.errors import KVStoreError
from kvstore.store import Store, StoreStats

try:
    from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
except ImportError as e:  # an optional extra: say how to get it
    raise ImportError(
        "kvstore.metrics needs prometheus_client, an optional dependency; install it "
        "with: pip install 'kvstore[metrics]'") from e

__all__ = ["METRICS", "MetricSpec", "MetricsServer", "StoreCollector", "metric_table",
           "register", "serve", "unregister"]

AnyStore = Store | BlockingStore
Samples = dict[tuple[str, ...], float]  # extra label values (beyond ``store``) -> value


# ---------------------------------------------------------------------------- the metrics

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


_ABSENT = object()


def _has(stats: StoreStats, name: str) -> bool:
    return getattr(stats, name, _ABSENT) is not _ABSENT


def _field(name: str) -> Callable[[StoreStats], Samples]:
    """A plain field; nothing when this store's StoreStats has no such field."""
    def read(stats: StoreStats) -> Samples:
        return {(): float(getattr(stats, name))} if _has(stats, name) else {}
    return read


def _tiers(disk: Callable[[StoreStats], float], memory: str) -> Callable[[StoreStats], Samples]:
    """``tier="disk"`` always; ``tier="memory"`` when the store has the ``memory`` field."""
    def read(stats: StoreStats) -> Samples:
        out: Samples = {("disk",): float(disk(stats))}
        if _has(stats, memory):
            out[("memory",)] = float(getattr(stats, memory))
        return out
    return read


def _per_class(name: str) -> Callable[[StoreStats], Samples]:
    """A ``{class: value}`` field of the I/O scheduler, one sample per class."""
    def read(stats: StoreStats) -> Samples:
        values: dict[str, float] = getattr(stats, name, None) or {}
        return {(str(cls),): float(v) for cls, v in sorted(values.items())}
    return read


def _remote(value: Callable[[dict[str, Any]], float]) -> Callable[[StoreStats], Samples]:
    """A number of the remote tier's stats; nothing when the store has no remote tier."""
    def read(stats: StoreStats) -> Samples:
        remote = getattr(stats, "remote", None)
        return {(): float(value(remote))} if remote else {}
    return read


def _memory(stats: StoreStats, name: str) -> float:
    return float(getattr(stats, name, 0))


def _counter(name: str, help: str, read: Callable[[StoreStats], Samples],
             labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(f"kvstore_{name}_total", "counter", labels, help, read)


def _gauge(name: str, help: str, read: Callable[[StoreStats], Samples],
           labels: tuple[str, ...] = ()) -> MetricSpec:
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
           "(reads still work), else 0", lambda s: {(): float(s.read_only)}),
    _counter("puts", "put_many calls (a put is one)", _field("puts")),
    _counter("put_blocks", "Blocks written by puts (not already stored)", _field("put_blocks")),
    _counter("put_bytes", "Bytes of the blocks written, as given (before the codec)",
             _field("put_bytes")),
    _counter("written_bytes", "Bytes written per tier (disk: block payloads after the codec)",
             _tiers(lambda s: s.put_payload_bytes, "memory_written_bytes"), TIER),
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
             _tiers(lambda s: s.hits - _memory(s, "memory_hits"), "memory_hits"), TIER),
    _counter("misses", "Blocks a get looked for and did not find in the tier",
             _tiers(lambda s: s.misses, "memory_misses"), TIER),
    _counter("read_bytes", "Bytes of blocks served, by the tier that served them",
             _tiers(lambda s: s.read_bytes, "memory_read_bytes"), TIER),
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
           lambda s: {} if s.scrub_last_complete is None else {(): s.scrub_last_complete}),
    _counter("deleted_blocks", "Blocks deleted by delete_many", _field("deletes")),
    _counter("index_commits", "Index write transactions committed", _field("commits")),
    _gauge("used_bytes", "Bytes in use per tier (disk: slots stored, quarantined, reserved "
           "or waiting for readers: what capacity bounds)",
           _tiers(lambda s: s.used_bytes, "memory_used_bytes"), TIER),
    _gauge("capacity_bytes", "The most used_bytes may reach, per tier",
           _tiers(lambda s: s.capacity_bytes, "memory_capacity_bytes"), TIER),
    _gauge("peak_used_bytes", "Highest disk used_bytes since the store was opened",
           _field("peak_used_bytes")),
    _gauge("stored_bytes", "Bytes of the slots in the extent files (not free, extent "
           "headers not counted)", _field("stored_bytes")),
    _gauge("free_bytes", "Free bytes inside the extent files", _field("free_bytes")),
    _gauge("disk_bytes", "Size of the extent files", _field("disk_bytes")),
    _gauge("blocks", "Blocks stored, per tier", _tiers(lambda s: s.blocks, "memory_blocks"),
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
           _remote(lambda r: float(r["state"] in ("ok", "probing")))),
    _counter("remote_hits", "Blocks fetched from the remote tier and verified",
             _remote(lambda r: r["hits"])),
    _counter("remote_joined", "Blocks a read took from another read's fetch in flight "
             "(requested once, not once per reader)", _remote(lambda r: r["joined"])),
    _counter("remote_misses", "Blocks looked up in the remote tier and not found (or not "
             "fetched by the deadline)", _remote(lambda r: r["misses"])),
    _counter("remote_bad_objects", "Remote objects that failed verification (CRC, key, "
             "HMAC): answered as misses", _remote(lambda r: r["bad_objects"])),
    _counter("remote_fast_misses", "Blocks answered as misses without a request while the "
             "breaker was open", _remote(lambda r: r["fast_misses"])),
    _counter("remote_breaker_trips", "Times the remote tier's circuit breaker opened",
             _remote(lambda r: r["breaker_trips"])),
    _counter("remote_uploaded_blocks", "Blocks uploaded to the remote tier",
             _remote(lambda r: r["uploaded_blocks"])),
    _counter("remote_upload_dropped", "Blocks not uploaded (queue full, or queued at close)",
             _remote(lambda r: r["upload_dropped"])),
    _counter("remote_promoted_blocks", "Blocks fetched from the remote tier and stored "
             "locally", _remote(lambda r: r["promoted_blocks"])),
    _counter("remote_promotion_dropped", "Blocks fetched from the remote tier and not "
             "stored locally (backpressure, full or read-only store)",
             _remote(lambda r: r["promotion_dropped"])),
    _gauge("remote_upload_queue_blocks", "Blocks waiting for upload",
           _remote(lambda r: r["upload_queue_blocks"])),
    LATENCY,
)
"""Every metric the collector can export, in exposition order."""


def metric_table() -> str:
    """The README's metric list (Markdown), made from :data:`METRICS`."""
    rows = ["| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(("store", *spec.labels))
        rows.append(f"| `{spec.name}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------- one store

class _Source:
    """One store as the collector reads it, from whichever thread scrapes."""

    def __init__(self, store: AnyStore) -> None:
        inner = store.store if isinstance(store, BlockingStore) else store
        self.store = store
        self.path = inner.path
        self.latency = inner.latency
        self._stats: Callable[[], StoreStats]
        if isinstance(store, BlockingStore):
            self._stats = store.stats  # its portal runs stats() on the store's loop
            return
        try:
            token = anyio.lowlevel.current_token()
        except RuntimeError:
            raise RuntimeError(
                f"register or serve the store {inner.path} from its event loop (inside "
                "`async with kvstore.open(...)`), or pass a BlockingStore") from None
        loop_thread = threading.get_ident()

        def stats() -> StoreStats:
            if threading.get_ident() == loop_thread:
                return inner.stats()
            return anyio.from_thread.run_sync(inner.stats, token=token)

        self._stats = stats

    def read(self) -> tuple[StoreStats, dict[str, HistogramSnapshot]] | None:
        """The store's numbers, or None once it is closed (or its loop is gone)."""
        try:
            return self._stats(), self.latency.snapshot()
        except (KVStoreError, RuntimeError):  # StoreClosedError; a stopped portal or loop
            return None


# ---------------------------------------------------------------------------- collector

def _family(spec: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily:
    labels = ["store", *spec.labels]
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=labels)
    if spec.kind == "histogram":
        return HistogramMetricFamily(spec.name, spec.help, labels=labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=labels)


def _buckets(hist: HistogramSnapshot) -> list[tuple[str, float]]:
    les = [repr(b) for b in hist.bounds] + ["+Inf"]
    return [(le, float(n)) for le, n in zip(les, hist.cumulative)]


class StoreCollector:
    """A ``prometheus_client`` collector of one or more stores, read at scrape time.

    ``StoreCollector(store)`` or ``StoreCollector([a, b])``; ``add``/``remove`` later.
    A ``Store`` must be added from its event loop (see the module doc).
    """

    def __init__(self, stores: AnyStore | Iterable[AnyStore] = ()) -> None:
        self._sources: dict[str, _Source] = {}
        self._lock = threading.Lock()  # add/remove on the loop vs. a scrape's thread
        for store in [stores] if isinstance(stores, (Store, BlockingStore)) else stores:
            self.add(store)

    def add(self, store: AnyStore) -> None:
        source = _Source(store)
        with self._lock:
            self._sources[source.path] = source  # a reopened store replaces the closed one

    def remove(self, store: AnyStore) -> None:
        path = (store.store if isinstance(store, BlockingStore) else store).path
        with self._lock:
            source = self._sources.get(path)
            if source is not None and source.store is store:
                del self._sources[path]

    def describe(self) -> list[Metric]:
        """The families' names, without reading any store (the registry checks them for
        clashes at registration)."""
        return [_family(spec) for spec in METRICS]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = sorted(self._sources.items())
        readings = [(path, source.read()) for path, source in sources]
        up = _family(UP)
        assert isinstance(up, GaugeMetricFamily)
        for path, reading in readings:
            up.add_metric([path], 0.0 if reading is None else 1.0)
        families: list[Metric] = [up]
        open_ = [(path, r) for path, r in readings if r is not None]
        for spec in METRICS:
            if spec.read is None:
                continue
            family = _family(spec)
            assert not isinstance(family, HistogramMetricFamily)
            for path, (stats, _) in open_:
                for values, value in spec.read(stats).items():
                    family.add_metric([path, *values], value)
            families.append(family)
        latency = _family(LATENCY)
        assert isinstance(latency, HistogramMetricFamily)
        for path, (_, hists) in open_:
            for op, hist in hists.items():
                latency.add_metric([path, op], _buckets(hist), hist.sum)
        families.append(latency)
        # a family no store has a field for is left out, not exported as a made-up 0
        yield from (family for family in families if family.samples)


# ---------------------------------------------------------------------------- registries

_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, StoreCollector] = (
    weakref.WeakKeyDictionary())
_REGISTER_LOCK = threading.Lock()


def register(store: AnyStore, registry: CollectorRegistry = REGISTRY) -> StoreCollector:
    """Export ``store`` through ``registry`` (default: prometheus_client's global one).

    All stores registered in one registry share one collector (so their families do
    not clash); it is returned.  Call from the store's event loop, or pass a
    ``BlockingStore``.
    """
    with _REGISTER_LOCK:
        collector = _BY_REGISTRY.get(registry)
        if collector is None:
            collector = StoreCollector(store)
            registry.register(collector)
            _BY_REGISTRY[registry] = collector
        else:
            collector.add(store)
        return collector


def unregister(store: AnyStore, registry: CollectorRegistry = REGISTRY) -> None:
    """Stop exporting ``store`` (e.g. after closing it: its ``kvstore_up 0`` goes too)."""
    with _REGISTER_LOCK:
        collector = _BY_REGISTRY.get(registry)
    if collector is not None:
        collector.remove(store)


# ---------------------------------------------------------------------------- serve

class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold up the process' exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Scrapes are not logged to stderr."""


class MetricsServer:
    """An HTTP endpoint serving one registry (``GET /metrics``, any path works) on a
    daemon thread.  ``close()`` (or leaving ``with``) stops it and frees the port;
    ``aclose()`` (or ``async with``) does it without blocking the event loop."""

    def __init__(self, collector: StoreCollector, port: int, addr: str) -> None:
        self.collector = collector
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self._httpd = make_server(addr, port, make_wsgi_app(self.registry),
                                  server_class=_Server6 if ":" in addr else _Server,
                                  handler_class=_QuietHandler)
        self.addr = addr
        self.port: int = self._httpd.server_port
        # close() waits for the serving loop to notice: poll often enough to stop quickly
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,),
                                        name="kvstore-metrics", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def serve(stores: AnyStore | Iterable[AnyStore], port: int = 0,
          addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the metrics of ``stores`` over HTTP at ``addr:port`` (``port=0``: a free
    port, see ``.port``), with a registry of their own.  Loopback by default: the
    numbers describe users' traffic; pass ``addr="0.0.0.0"`` to expose them.  Call from
    the stores' event loop, or pass ``BlockingStore`` objects."""
    return MetricsServer(StoreCollector(stores), port, addr)
