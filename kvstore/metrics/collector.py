"""The collector of :mod:`kvstore.metrics`: open stores read at scrape time
(:class:`StoreCollector`, from whichever thread scrapes) and the registries they are
registered in (:func:`register`, :func:`unregister`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator

import anyio
import anyio.from_thread
import anyio.lowlevel
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvstore.blocking import BlockingStore
from kvstore.core.latency import HistogramSnapshot
from kvstore.errors import KVStoreError
from kvstore.metrics.specs import LATENCY, METRICS, UP, MetricSpec
from kvstore.store import Store, StoreStats

__all__ = ["AnyStore", "StoreCollector", "register", "unregister"]

AnyStore = Store | BlockingStore


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
