"""Latency histograms (kvstore/core/latency.py): bucket edges, cumulative snapshots, failures
counted, and the store timing its batch calls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.core.latency import BUCKETS, Latency
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor

pytestmark = pytest.mark.anyio


def test_observations_land_in_their_bucket_cumulatively() -> None:
    lat = Latency(["get"], buckets=[0.001, 0.01, 0.1])
    for seconds in (0.0005, 0.001, 0.002, 0.05, 3.0):  # 0.001 is on an edge: le="0.001"
        lat.observe("get", seconds)
    hist = lat.snapshot()["get"]
    assert hist.bounds == (0.001, 0.01, 0.1)
    assert hist.cumulative == (2, 3, 4, 5)
    assert hist.count == 5
    assert hist.sum == pytest.approx(0.0005 + 0.001 + 0.002 + 0.05 + 3.0)


def test_declared_ops_start_at_zero_and_unknown_ops_are_refused() -> None:
    lat = Latency(["get", "put"])
    snap = lat.snapshot()
    assert set(snap) == {"get", "put"}
    assert snap["put"].cumulative == (0,) * (len(BUCKETS) + 1)
    with pytest.raises(ValueError, match="'prefetch' is not one of"):
        lat.observe("prefetch", 0.1)
    with pytest.raises(ValueError, match="'prefetch' is not one of"), lat.time("prefetch"):
        pass
    assert lat.snapshot()["get"].count == 0


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="increasing"):
        Latency(["get"], buckets=[0.1, 0.01])
    with pytest.raises(ValueError, match="not empty"):
        Latency(["get"], buckets=[])


def test_a_failing_block_is_timed_too() -> None:
    lat = Latency(["put"])
    with pytest.raises(RuntimeError), lat.time("put"):
        raise RuntimeError("boom")
    with lat.time("put"):
        pass
    assert lat.snapshot()["put"].count == 2


def test_default_buckets_span_kv_io() -> None:
    assert BUCKETS[0] == 0.0001 and BUCKETS[-1] == 10.0
    assert list(BUCKETS) == sorted(set(BUCKETS))


async def test_store_times_every_batch_call(tmp_path: Path) -> None:
    ks = keys(4)
    values = [make_tensor(torch.float16, (64,), i) for i in range(4)]
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        await store.put_many(ks[:2], values[:2])
        await store.put(ks[2], values[2])  # sugar: one put_many
        await store.get_many(ks)
        await store.get(ks[0])
        with pytest.raises(ValueError, match="out tensors"):  # refused: still a get call
            await store.get_many(ks, out=[None])
        await store.contains_many(ks)  # not timed
        snap = store.latency.snapshot()
    assert (snap["put"].count, snap["get"].count) == (2, 3)
    assert set(snap) == {"get", "put", "prefetch"} and snap["prefetch"].count == 0
    assert snap["get"].sum > 0
