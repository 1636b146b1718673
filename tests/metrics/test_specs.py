"""What kvstore.metrics exports (kvstore/metrics/specs.py): every ``StoreStats`` field
is read by a metric or listed in ``UNEXPORTED`` with the reason (exactly), and the
families added for the processes sharing a store and for the event stream carry the
values ``stats()`` reports, from a real store."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="pip install 'kvstore[metrics]'")

import torch  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import kvstore  # noqa: E402
from kvstore import metrics  # noqa: E402
from kvstore.stats import StoreStats  # noqa: E402
from kvstore.testing import parts  # noqa: E402
from tests.conformance import NS, keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def read_fields() -> set[str]:
    """Every name a metric's ``source`` mentions."""
    return {name for spec in metrics.METRICS for name in re.findall(r"\w+", spec.source)}


def test_every_stats_field_is_exported_or_said_why() -> None:
    names = {f.name for f in fields(StoreStats)}
    read = read_fields()
    assert sorted(names - read - set(metrics.UNEXPORTED)) == []  # a field nobody reads
    assert sorted(set(metrics.UNEXPORTED) & read) == []  # listed, yet exported
    assert sorted(set(metrics.UNEXPORTED) - names) == []  # listed, not a field
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert all(f"`{name}`" in page for name in metrics.UNEXPORTED)


def test_the_names_that_differ_are_mapped_in_the_table() -> None:
    source = {spec.name: spec.source for spec in metrics.METRICS}
    assert source["kvstore_deleted_blocks_total"] == "deletes"
    assert source["kvstore_index_commits_total"] == "commits"
    assert source["kvstore_prefetched_blocks_total"] == "prefetch_blocks"
    assert "| `kvstore_deleted_blocks_total` | counter | store | `deletes` |" \
        in metrics.metric_table()


def scrape(store: kvstore.BlockingStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    metrics.register(store, registry)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "store"))):
            s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_owner_and_event_families_carry_what_stats_reports(tmp_path: Path) -> None:
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads") as store:
        events = store.subscribe()
        store.put_many(keys(3), [torch.full((64,), i) for i in range(3)])
        store.delete_many(keys(1))
        got, stats = scrape(store), store.stats()
        events.close()
        owner = parts(store).owner.id
        assert stats.owner_id == owner and stats.events_published >= 4
        info = ("kvstore_store_info", (("durable", "true"), ("engine", stats.engine),
                                       ("o_direct", str(stats.o_direct).lower()),
                                       ("owner_id", str(owner))))
        assert got[info] == 1
        assert got[("kvstore_events_published_total", ())] == stats.events_published
        assert got[("kvstore_events_dropped_total", ())] == stats.events_dropped == 0
        assert got[("kvstore_event_subscribers", ())] == stats.event_subscribers == 1
        for name, field in (("kvstore_dedup_late_blocks_total", "dedup_late"),
                            ("kvstore_owners_recovered_total", "owners_recovered"),
                            ("kvstore_map_adoptions_total", "map_adoptions"),
                            ("kvstore_extents", "extents"),
                            ("kvstore_extent_size_bytes", "extent_bytes"),
                            ("kvstore_memory_evicted_blocks_total", "memory_evicted_blocks"),
                            ("kvstore_prefetch_read_bytes_total", "prefetch_read_bytes")):
            assert got[(name, ())] == getattr(stats, field), name
        assert got[("kvstore_extents", ())] >= 1
