"""Prometheus metrics of open stores, through ``prometheus_client`` (``kvstore[metrics]``).

The package: :mod:`~kvstore.metrics.specs` (what is exported: every metric and the
``StoreStats`` field it reads), :mod:`~kvstore.metrics.collector` (the collector and
the registries), :mod:`~kvstore.metrics.server` (the HTTP endpoint); the public names
are re-exported here.

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

try:
    import prometheus_client  # noqa: F401 - the optional extra, checked before the rest
except ImportError as e:  # an optional extra: say how to get it
    raise ImportError(
        "kvstore.metrics needs prometheus_client, an optional dependency; install it "
        "with: pip install 'kvstore[metrics]'") from e

from kvstore.metrics.collector import StoreCollector, register, unregister
from kvstore.metrics.server import MetricsServer, serve
from kvstore.metrics.specs import METRICS, UNEXPORTED, MetricSpec, metric_table

__all__ = ["METRICS", "UNEXPORTED", "MetricSpec", "MetricsServer", "StoreCollector",
           "metric_table", "register", "serve", "unregister"]
