"""Prometheus metrics (kvstore/metrics/): served over HTTP from real stores, parsed
with prometheus_client's own parser, and checked to move as operations happen."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

pytest.importorskip("prometheus_client", reason="pip install 'kvstore[metrics]'")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import kvstore  # noqa: E402
from kvstore import metrics  # noqa: E402
from kvstore.testing import parts
from tests.conformance import NS, SMALL_EXTENT, flip_payload_bit, keys, make_tensor  # noqa: E402

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
Families = dict[str, Any]  # family name -> prometheus_client Metric


def opener(path: Path, **options: Any) -> Any:
    options.setdefault("extent_bytes", SMALL_EXTENT)
    return kvstore.open(path, namespace=NS, staging_bytes=4 << 20, **options)


def parse(text: str) -> Families:
    return {family.name: family for family in text_string_to_metric_families(text)}


def fetch(url: str) -> Families:
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.status == 200
        return parse(response.read().decode())


async def scrape(server: metrics.MetricsServer) -> Families:
    """A scrape from outside the event loop, as Prometheus does it (the loop stays free
    to answer the collector's stats() call)."""
    return await anyio.to_thread.run_sync(fetch, server.url)


def value(families: Families, sample: str, **labels: str) -> float:
    """The one sample called ``sample`` whose labels include ``labels``."""
    family = families[sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")]
    found = [s.value for s in family.samples
             if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) == 1, (sample, labels, family.samples)
    return float(found[0])


def values_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


async def test_counters_move_as_operations_happen(tmp_path: Path) -> None:
    ks = keys(4)
    blocks = [make_tensor(torch.float16, (512,), i) for i in range(3)]
    async with opener(tmp_path) as store, metrics.serve(store) as server:
        path = store.path
        before = await scrape(server)
        assert value(before, "kvstore_up", store=path) == 1
        assert value(before, "kvstore_puts_total", store=path) == 0
        assert value(before, "kvstore_read_only", store=path) == 0

        await store.put_many(ks[:3], blocks, parents=kvstore.chain_parents(ks[:3]))
        await store.put_many(ks[:2], blocks[:2])  # already stored: deduplicated
        after_puts = await scrape(server)
        assert value(after_puts, "kvstore_puts_total", store=path) == 2
        assert value(after_puts, "kvstore_put_blocks_total", store=path) == 3
        assert value(after_puts, "kvstore_put_bytes_total", store=path) == values_of(blocks)
        assert value(after_puts, "kvstore_written_bytes_total", store=path, tier="disk") > 0
        assert value(after_puts, "kvstore_dedup_blocks_total", store=path) == 2
        assert value(after_puts, "kvstore_dedup_bytes_total", store=path) == values_of(blocks[:2])
        assert value(after_puts, "kvstore_blocks", store=path, tier="disk") == 3
        assert value(after_puts, "kvstore_used_bytes", store=path, tier="disk") > 0
        assert value(after_puts, "kvstore_index_commits_total", store=path) > 0

        await store.get_many(ks)  # three hits, one miss
        await store.get(ks[3])  # another miss
        after_gets = await scrape(server)
        assert value(after_gets, "kvstore_gets_total", store=path) == 2
        assert value(after_gets, "kvstore_hits_total", store=path, tier="disk") == 3
        assert value(after_gets, "kvstore_misses_total", store=path, tier="disk") == 2
        assert value(after_gets, "kvstore_read_bytes_total", store=path,
                     tier="disk") == values_of(blocks)

        await store.pin(ks[:1])
        assert await store.delete_many([ks[2], ks[3]]) == 1
        after_delete = await scrape(server)
        assert value(after_delete, "kvstore_deleted_blocks_total", store=path) == 1
        assert value(after_delete, "kvstore_blocks", store=path, tier="disk") == 2
        assert value(after_delete, "kvstore_pinned_blocks", store=path) == 1
        # counters never go back
        for family in ("kvstore_puts_total", "kvstore_gets_total"):
            assert value(after_delete, family, store=path) >= value(after_gets, family, store=path)


async def test_latency_histogram_counts_every_call(tmp_path: Path) -> None:
    ks = keys(3)
    async with opener(tmp_path) as store, metrics.serve(store) as server:
        path = store.path
        await store.put_many(ks, [make_tensor(torch.float32, (32,), i) for i in range(3)])
        for _ in range(4):
            await store.get_many(ks)
        with pytest.raises(ValueError, match="out tensors"):  # a failed call counts too
            await store.get_many(ks, out=[None])
        families = await scrape(server)
    name = "kvstore_operation_duration_seconds"
    assert families[name].type == "histogram"
    assert value(families, f"{name}_count", store=path, op="get") == 5
    assert value(families, f"{name}_count", store=path, op="put") == 1
    buckets = [s for s in families[name].samples
               if s.name == f"{name}_bucket" and s.labels["op"] == "get"]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == 5
    assert buckets[-1].labels["le"] == "+Inf" and buckets[0].labels["le"] == "0.0001"
    assert value(families, f"{name}_sum", store=path, op="get") > 0


async def test_evictions_are_counted(tmp_path: Path) -> None:
    slot = 8192  # 6000-byte blocks take one 8 KiB slot each
    ks = keys(12)
    async with opener(tmp_path, capacity_bytes=4 * slot, extent_bytes=256 << 10) as store, \
            metrics.serve(store) as server:
        for i, key in enumerate(ks):  # separate chains: every block is a leaf
            await store.put(key, make_tensor(torch.uint8, (6000,), i))
        families = await scrape(server)
        path = store.path
    assert value(families, "kvstore_capacity_bytes", store=path, tier="disk") == 4 * slot
    assert value(families, "kvstore_evicted_blocks_total", store=path) >= 8
    assert value(families, "kvstore_evicted_bytes_total", store=path) >= 8 * slot
    assert 0 < value(families, "kvstore_peak_used_bytes", store=path) <= 4 * slot


async def test_corruption_is_counted(tmp_path: Path) -> None:
    ks = keys(2)
    values = [make_tensor(torch.float16, (2048,), i) for i in range(2)]
    async with opener(tmp_path) as store:
        await store.put_many(ks, values)
        entry = parts(store).index.get_entries([ks[1]])[0]
    assert entry is not None
    flip_payload_bit(tmp_path, entry)
    async with opener(tmp_path) as store, metrics.serve(store) as server:
        got = await store.get_many(ks)
        families = await scrape(server)
        path = store.path
    assert got[1] is None
    assert value(families, "kvstore_corrupt_blocks_total", store=path) == 1
    assert value(families, "kvstore_quarantined_blocks", store=path) == 1
    assert value(families, "kvstore_hits_total", store=path, tier="disk") == 1
    assert value(families, "kvstore_misses_total", store=path, tier="disk") == 1
    assert value(families, "kvstore_read_errors_total", store=path) == 0


async def test_two_stores_in_one_registry_have_distinct_labels(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with opener(tmp_path / "a") as a, opener(tmp_path / "b") as b:
        collector = metrics.register(a, registry)
        assert metrics.register(b, registry) is collector  # one collector per registry
        await a.put_many(keys(2), [make_tensor(torch.int32, (16,), i) for i in range(2)])
        families = parse(generate_latest(registry).decode())  # on the loop: read directly
        assert value(families, "kvstore_put_blocks_total", store=a.path) == 2
        assert value(families, "kvstore_put_blocks_total", store=b.path) == 0
        stores = {s.labels["store"] for s in families["kvstore_up"].samples}
        assert stores == {a.path, b.path}
        metrics.unregister(b, registry)
        families = parse(generate_latest(registry).decode())
        assert {s.labels["store"] for s in families["kvstore_up"].samples} == {a.path}


async def test_a_closed_store_does_not_break_a_scrape(tmp_path: Path) -> None:
    async with opener(tmp_path / "open") as alive:
        async with opener(tmp_path / "closed") as gone:
            server = metrics.serve([alive, gone])
            await gone.put_many(keys(1), [torch.zeros(8)])
        try:
            families = await scrape(server)
            assert value(families, "kvstore_up", store=gone.path) == 0
            assert value(families, "kvstore_up", store=alive.path) == 1
            # a closed store exports nothing but kvstore_up
            for family in families.values():
                if family.name != "kvstore_up":
                    assert all(s.labels["store"] == alive.path for s in family.samples)
            assert value(families, "kvstore_puts_total", store=alive.path) == 0
        except BaseException:
            await server.aclose()
            raise
    async with server:
        families = await scrape(server)  # both closed now
    assert {s.labels["store"]: s.value for s in families["kvstore_up"].samples} == {
        alive.path: 0, gone.path: 0}
    assert set(families) == {"kvstore_up"}


def test_blocking_store_is_served_from_any_thread(tmp_path: Path) -> None:
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT,
                               staging_bytes=4 << 20) as store, metrics.serve(store) as server:
        store.put_many(keys(2), [make_tensor(torch.float32, (8,), i) for i in range(2)])
        assert store.get(keys(2)[0]) is not None
        families = fetch(server.url)
        assert value(families, "kvstore_put_blocks_total", store=store.store.path) == 2
        assert value(families, "kvstore_hits_total", store=store.store.path, tier="disk") == 1
    # closed: its portal stopped; the collector still answers
    families = parse(generate_latest(server.registry).decode())
    assert value(families, "kvstore_up", store=store.store.path) == 0


async def test_a_store_must_be_registered_from_its_loop(tmp_path: Path) -> None:
    async with opener(tmp_path) as store:
        with pytest.raises(RuntimeError, match="from its event loop"):
            await anyio.to_thread.run_sync(metrics.StoreCollector, store)


async def test_the_docs_list_exactly_what_the_collector_emits(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert metrics.metric_table() in page, "regenerate docs/metrics.md's table: metric_table()"
    async with opener(tmp_path) as store:
        stats = store.stats()
        families = parse(generate_latest(_registry(store)).decode())
    specs = {spec.name.removesuffix("_total"): spec for spec in metrics.METRICS}
    for name, family in families.items():  # everything emitted is documented, same type
        assert name in specs, name
        assert family.type == specs[name].kind
    for name, spec in specs.items():  # and what is documented is emitted when it can be
        present = spec.read is None or bool(spec.read(stats))
        assert (name in families) == present, name


def _registry(store: kvstore.Store) -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics.register(store, registry)
    return registry


def test_without_prometheus_client_the_error_names_the_extra() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["prometheus_client"] = None  # as if it were not installed
        import kvstore  # the library itself does not need it
        try:
            import kvstore.metrics
        except ImportError as e:
            print(e)
        else:
            raise SystemExit("kvstore.metrics imported without prometheus_client")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'kvstore[metrics]'" in proc.stdout
