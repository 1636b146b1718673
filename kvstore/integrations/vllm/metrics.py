"""The vLLM connector's numbers in vLLM's own metrics: ``/metrics`` and the log lines.

vLLM (0.32) asks every connector for stats after every step
(``get_kv_connector_stats``: the scheduler's and each worker's), sums the workers' with
:meth:`KVStoreConnectorStats.aggregate`, ships the result to the front end as
``to_dict()``, rebuilds it there with the connector class's
``build_kv_connector_stats`` and hands it to the connector's Prometheus families
(``build_prom_metrics`` -> :class:`KVStorePromMetrics`) and to its periodic
"KV Transfer metrics:" log line (:meth:`KVStoreConnectorStats.reduce`).

Each report holds what changed since the previous one, per reporter: ``"scheduler"``
(lookups) or the worker's rank (``"0"``, ``"1"``, ... under tensor/pipeline parallel,
where each rank has a store of its own: its block counts are counts of its shards).
Counters are summed, gauges keep the latest value, load durations are concatenated.
Plain ``str``/``int``/``float``/``list`` values only: vLLM serialises it with msgpack.

Families (all with vLLM's ``model_name`` and ``engine`` labels; ``rank`` on the
workers' ones) are listed in :data:`FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

__all__ = ["FAMILIES", "GROUP_COUNTERS", "SCHEDULER_COUNTERS", "STORE_COUNTERS",
           "STORE_GAUGES",
           "KVStoreConnectorStats", "KVStorePromMetrics"]

# StoreStats fields each worker samples from its store when something changed.
STORE_COUNTERS = ("corrupt_blocks", "read_errors")
STORE_GAUGES = ("used_bytes", "capacity_bytes", "blocks", "memory_used_bytes",
                "memory_capacity_bytes")

# Counted by the scheduler (lookups; no rank label), the rest by the workers.
SCHEDULER_COUNTERS = ("lookups", "lookup_hit_blocks", "lookups_deferred",
                      "reset_stale_requests")

# A hybrid model's parts (each KV cache group's block or state), by kind of group:
# loaded, failed (a failed load counts every part of it) and handed over for saving.
GROUP_KINDS = ("full", "sliding", "state")
GROUP_COUNTERS = tuple(f"group_{what}_{kind}" for what in ("loaded", "failed", "save")
                       for kind in GROUP_KINDS)

_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_MAX_SAMPLES = 4096

# stats key -> (family, documentation, kind, extra labels {name: value}, scale)
FAMILIES: dict[str, tuple[str, str, str, dict[str, str], float]] = {
    "lookups": ("vllm:kvstore_lookups_total",
                "Prefix lookups the scheduler sent to the store(s)", "counter", {}, 1.0),
    "lookups_deferred": ("vllm:kvstore_lookups_deferred_total",
                         "Lookups not answered within lookup_wait_ms: vLLM asked again at "
                         "a later step while the lookup went on", "counter", {}, 1.0),
    "reset_stale_requests": ("vllm:kvstore_stale_requests_total",
                             "Requests neither loaded into nor saved: they reused KV that "
                             "vLLM's prefix cache kept across a weight update whose reset "
                             "vLLM refused", "counter", {}, 1.0),
    "lookup_hit_blocks": ("vllm:kvstore_lookup_hit_blocks_total",
                          "Blocks the scheduler took as stored hits (on every rank) and "
                          "scheduled for loading", "counter", {}, 1.0),
    "load_blocks": ("vllm:kvstore_load_requested_blocks_total",
                    "Blocks a worker was asked to load", "counter", {}, 1.0),
    "loaded_blocks": ("vllm:kvstore_load_blocks_total",
                      "Blocks loaded into vLLM's KV cache (verified), or failed and "
                      "reported for recomputation, by outcome", "counter",
                      {"outcome": "loaded"}, 1.0),
    "load_failed_blocks": ("vllm:kvstore_load_blocks_total", "", "counter",
                           {"outcome": "failed"}, 1.0),
    "loaded_bytes": ("vllm:kvstore_loaded_bytes_total",
                     "Bytes of the blocks loaded into vLLM's KV cache", "counter", {}, 1.0),
    "load_deferred_blocks": ("vllm:kvstore_load_deferred_blocks_total",
                             "Blocks of background loads that waited for room in the load "
                             "staging (load_staging_bytes) instead of failing", "counter",
                             {}, 1.0),
    "load_ns": ("vllm:kvstore_load_seconds_total",
                "Time loads were in flight (background: other requests keep running)",
                "counter", {}, 1e-9),
    "save_blocks": ("vllm:kvstore_save_requested_blocks_total",
                    "Blocks handed to the store for saving (not stored yet)", "counter",
                    {}, 1.0),
    "saved_blocks": ("vllm:kvstore_save_blocks_total",
                     "Saves by outcome: written, deduplicated (stored already), dropped "
                     "(whole, under backpressure or after a failed forward), failed",
                     "counter", {"outcome": "written"}, 1.0),
    "save_dedup_blocks": ("vllm:kvstore_save_blocks_total", "", "counter",
                          {"outcome": "deduplicated"}, 1.0),
    "save_dropped_blocks": ("vllm:kvstore_save_blocks_total", "", "counter",
                            {"outcome": "dropped"}, 1.0),
    "save_failed_blocks": ("vllm:kvstore_save_blocks_total", "", "counter",
                           {"outcome": "failed"}, 1.0),
    "saved_bytes": ("vllm:kvstore_saved_bytes_total",
                    "Bytes of the blocks written to the store (before the codec)",
                    "counter", {}, 1.0),
    "save_stall_ns": ("vllm:kvstore_save_stall_seconds_total",
                      "Time the forward pass waited for save copies out of the KV cache",
                      "counter", {}, 1e-9),
    "save_io_ns": ("vllm:kvstore_save_io_seconds_total",
                   "Time background saves were in flight in the store", "counter", {},
                   1e-9),
    "store_corrupt_blocks": ("vllm:kvstore_corrupt_blocks_total",
                             "Blocks that failed verification on read (quarantined, "
                             "answered as misses, recomputed)", "counter", {}, 1.0),
    "store_read_errors": ("vllm:kvstore_read_errors_total",
                          "Block reads that failed with an I/O error (recomputed)",
                          "counter", {}, 1.0),
    "store_used_bytes": ("vllm:kvstore_used_bytes",
                         "Bytes the store uses on disk (what capacity bounds)", "gauge",
                         {}, 1.0),
    "store_capacity_bytes": ("vllm:kvstore_capacity_bytes",
                             "The most the store may use on disk", "gauge", {}, 1.0),
    "store_blocks": ("vllm:kvstore_blocks", "Blocks stored", "gauge", {}, 1.0),
    "store_memory_used_bytes": ("vllm:kvstore_memory_used_bytes",
                                "Bytes held by the store's host-memory tier", "gauge", {},
                                1.0),
    "store_memory_capacity_bytes": ("vllm:kvstore_memory_capacity_bytes",
                                    "Size of the host-memory tier (0: off)", "gauge", {},
                                    1.0),
    **{f"group_{what}_{kind}": (
        "vllm:kvstore_group_load_parts_total",
        "A hybrid model's parts (each KV cache group's block or state) loaded, or failed "
        "(every part of a load that failed), by kind of group (full, sliding, state)"
        if (what, kind) == ("loaded", "full") else "", "counter",
        {"kind": kind, "outcome": "loaded" if what == "loaded" else "failed"}, 1.0)
       for what in ("loaded", "failed") for kind in GROUP_KINDS},
    **{f"group_save_{kind}": (
        "vllm:kvstore_group_save_requested_parts_total",
        "A hybrid model's parts handed to the store for saving, by kind of group"
        if kind == "full" else "", "counter", {"kind": kind}, 1.0)
       for kind in GROUP_KINDS},
}
_LOAD_HISTOGRAM = ("vllm:kvstore_load_duration_seconds",
                   "Duration of one request's load, from start to blocks in vLLM's KV cache")


@dataclass
class KVStoreConnectorStats(KVConnectorStats):  # type: ignore[misc]  # Any w/o vLLM
    """``data = {"counters": {reporter: {key: n}}, "gauges": {reporter: {key: v}},
    "load_seconds": {reporter: [s, ...]}}`` (see the module docstring)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for part in ("counters", "gauges", "load_seconds"):
            self.data.setdefault(part, {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "load_seconds": {}}

    def add(self, reporter: str, counters: dict[str, int],
            load_seconds: list[float] | None = None) -> None:
        mine = self.data["counters"].setdefault(reporter, {})
        for key, n in counters.items():
            mine[key] = mine.get(key, 0) + n
        if load_seconds:
            samples = self.data["load_seconds"].setdefault(reporter, [])
            samples.extend(load_seconds[:max(0, _MAX_SAMPLES - len(samples))])

    def set_gauges(self, reporter: str, gauges: dict[str, float]) -> None:
        self.data["gauges"].setdefault(reporter, {}).update(
            {f"store_{k}": v for k, v in gauges.items()})

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVStoreConnectorStats):
            return self
        for reporter, counters in other.data["counters"].items():
            self.add(reporter, counters)
        for reporter, samples in other.data["load_seconds"].items():
            self.add(reporter, {}, samples)
        for reporter, gauges in other.data["gauges"].items():
            self.data["gauges"].setdefault(reporter, {}).update(gauges)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One log line: counters and gauges summed over ranks, times in ms."""
        out: dict[str, int | float] = {}
        for part in ("counters", "gauges"):
            for values in self.data[part].values():
                for key, v in values.items():
                    name, v = (key[:-3] + "_ms", v / 1e6) if key.endswith("_ns") else (key, v)
                    out[name] = out.get(name, 0) + v
        samples = [s for ss in self.data["load_seconds"].values() for s in ss]
        if samples:
            out["loads"] = len(samples)
            out["load_avg_ms"] = round(1e3 * sum(samples) / len(samples), 3)
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}

    def is_empty(self) -> bool:
        return not any(self.data[part] for part in ("counters", "gauges", "load_seconds"))


class KVStorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # Any w/o vLLM
    """The connector's Prometheus families (:data:`FAMILIES`), registered by vLLM's
    Prometheus logger next to its own."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for key, (name, doc, kind, extra, _) in FAMILIES.items():
            if name in self._families:
                continue
            labels = [*labelnames, *([] if key in SCHEDULER_COUNTERS
                                     else ["rank"]), *extra]
            if kind == "counter":
                self._families[name] = self._counter_cls(
                    name=name, documentation=doc, labelnames=labels)
            else:
                self._families[name] = self._gauge_cls(
                    name=name, documentation=doc, labelnames=labels,
                    multiprocess_mode="mostrecent")
        self._histogram = self._histogram_cls(
            name=_LOAD_HISTOGRAM[0], documentation=_LOAD_HISTOGRAM[1],
            labelnames=[*labelnames, "rank"], buckets=list(_LOAD_BUCKETS))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for part in ("counters", "gauges"):
            for reporter, values in transfer_stats_data.get(part, {}).items():
                for key, value in values.items():
                    spec = FAMILIES.get(key)
                    if spec is None:  # a newer worker's key: not ours to guess
                        continue
                    name, _, kind, extra, scale = spec
                    labels = [*base, *([] if reporter == "scheduler" else [reporter]),
                              *extra.values()]
                    child = self._families[name].labels(*labels)
                    if kind == "counter":
                        if value > 0:
                            child.inc(value * scale)
                    else:
                        child.set(value * scale)
        for reporter, samples in transfer_stats_data.get("load_seconds", {}).items():
            child = self._histogram.labels(*base, reporter)
            for s in samples:
                child.observe(s)
