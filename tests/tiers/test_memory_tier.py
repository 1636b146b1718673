"""The host-memory tier: its cache (kvstore/tiers/memory/cache.py) on its own, and the
tier (kvstore/tiers/memory/tier.py) inside a real store: hits do no disk I/O; a deleted,
evicted-on-disk, quarantined or re-put block is never served from memory; leaf-first
LRU eviction; pinned blocks and blocks being read stay; fills raced by a discard are
dropped; the region bounds RSS."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.io import page_locking
from kvstore.io.arena import Arena
from kvstore.io.protocol import IOEngine, IoOp
from kvstore.testing import parts
from kvstore.tiers.memory.cache import MemoryCache
from tests.concurrency import GatedEngine, real_engine, resident_bytes
from tests.conformance import NS, keys, make_tensor, same

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10  # one 64 KiB block per run (page-rounded, no slack)


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (BLOCK,), i)


def cache(blocks: int, pinned: Sequence[bytes] = ()) -> MemoryCache:
    return MemoryCache(blocks * BLOCK, lambda ks: {k for k in ks if k in pinned})


def add(t: MemoryCache, key: bytes, parent: bytes | None, i: int = 0, seq: int = 1) -> bool:
    return t.insert(key, parent, block(i), torch.uint8, (BLOCK,), seq)


# ------------------------------------------------------------------ the cache alone


def test_eviction_takes_least_recently_used_leaves_and_keeps_a_chains_head() -> None:
    a, b, c, d = keys(4)
    x, y = keys(2, 100)
    t = cache(3)
    assert add(t, a, None) and add(t, b, a) and add(t, c, b)
    # d's parent c is protected and a, b have cached children: nothing may go
    assert not add(t, d, c)
    assert [k in t for k in (a, b, c, d)] == [True, True, True, False]
    assert t.not_cached == 1
    assert add(t, x, None)  # an unrelated block: the chain's tail (its only leaf) goes
    assert [k in t for k in (a, b, c, x)] == [True, True, False, True]
    t.lookup(x, 1)  # x is now the most recently used leaf; b is a leaf again, older
    assert add(t, y, None)
    assert [k in t for k in (a, b, x, y)] == [True, False, True, True]
    assert t.evicted_blocks == 2 and t.used_bytes == 3 * BLOCK
    t.close()


def test_pinned_blocks_and_blocks_being_read_are_not_evicted() -> None:
    a, b, c = keys(3, 200)
    t = cache(2, pinned=[a])
    assert add(t, a, None) and add(t, b, None)
    reading = t.lookup(b, 1)
    assert reading is not None
    t.begin_read(reading)
    assert not add(t, c, None)  # a is pinned, b is being read
    t.end_read(reading)
    assert add(t, c, None) and b not in t and a in t
    t.close()


def test_a_block_discarded_while_read_keeps_its_bytes_until_the_read_ends() -> None:
    (a,) = keys(1, 300)
    t = cache(1)
    assert add(t, a, None, i=7)
    cached = t.lookup(a, 1)
    assert cached is not None
    t.begin_read(cached)
    assert t.discard([a]) == 1 and a not in t
    assert t.region.free_bytes == 0  # still owned by the reader
    assert torch.equal(cached.view(), block(7))
    t.end_read(cached)
    assert t.region.free_bytes == t.capacity_bytes
    t.close()


def test_a_fill_raced_by_a_discard_is_dropped_and_a_stale_seq_is_not_served() -> None:
    (a,) = keys(1, 400)
    t = cache(2)
    got = t.reserve(a, BLOCK)
    assert got is not None
    token, run = got
    run.tensor[:BLOCK].copy_(block(1))
    t.discard([a])  # a delete landed while the bytes were being copied in
    assert not t.publish(token, run, key=a, parent=None, nbytes=BLOCK, dtype=torch.uint8,
                         shape=(BLOCK,), seq=1)
    assert a not in t and t.region.free_bytes == t.capacity_bytes
    assert add(t, a, None, seq=5)
    assert t.lookup(a, 6) is None and a not in t  # the index names a newer block now
    t.close()


# ------------------------------------------------------------------ inside a store


class CountingEngine(GatedEngine):
    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner)
        self.reads = 0

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        self.reads += len(ops)
        return await super().read(ops)


async def test_memory_hits_do_no_disk_io_and_a_restart_refills_from_disk(
        tmp_path: Path) -> None:
    ks = keys(4)
    values = [make_tensor(torch.bfloat16, (2, 4, 16, 64), i) for i in range(4)]
    opts = {"namespace": NS, "memory_bytes": 1 << 20, "extent_bytes": 4 << 20}
    engine = CountingEngine(real_engine("threads", tmp_path / "probe"))
    async with kvstore.open(tmp_path / "s", engine=engine, **opts) as store:
        await store.put_many(ks, values, parents=kvstore.chain_parents(ks))
        got = await store.get_many(ks)
        outs = [torch.empty_like(v) for v in values]
        into = await store.get_many(ks, out=outs)
        st = store.stats()
    assert all(same(g, v) for g, v in zip(got, values))
    assert all(o is t and same(o, v) for o, t, v in zip(into, outs, values))
    assert engine.reads == 0 and st.memory_hits == 8 and st.memory_blocks == 4
    assert st.memory_read_bytes == 8 * values[0].numel() * 2 and st.read_bytes == 0
    engine = CountingEngine(real_engine("threads", tmp_path / "probe2"))
    async with kvstore.open(tmp_path / "s", engine=engine, **opts) as store:
        first = await store.get_many(ks)  # a fresh tier: from disk, then cached
        reads = engine.reads
        second = await store.get_many(ks)
        st = store.stats()
    assert reads == 4 and engine.reads == 4  # the second get did no I/O
    assert all(same(g, v) for g, v in zip(first + second, values + values))
    assert st.memory_misses == 4 and st.memory_hits == 4


async def test_deleted_and_re_put_blocks_are_never_served_from_memory(tmp_path: Path) -> None:
    a, b = keys(2, 500)
    async with kvstore.open(tmp_path, namespace=NS, memory_bytes=1 << 20,
                            extent_bytes=4 << 20) as store:
        await store.put_many([a, b], [block(1), block(2)])
        assert same(await store.get(a), block(1))  # cached
        assert await store.delete(a)
        assert await store.get(a) is None
        await store.put(a, block(3))  # the same key, new bytes
        assert same(await store.get(a), block(3))
        assert store.stats().memory_blocks == 2


async def test_a_block_evicted_on_disk_is_not_served_from_memory(tmp_path: Path) -> None:
    ks = keys(3, 600)
    async with kvstore.open(tmp_path, namespace=NS, memory_bytes=4 << 20,
                            capacity_bytes=2 * (BLOCK + 4096), extent_bytes=4 << 20) as store:
        for i, k in enumerate(ks):  # the third put evicts the first on disk
            await store.put(k, block(i))
        st = store.stats()
        assert st.evicted_blocks == 1
        assert await store.get(ks[0]) is None
        assert [k in parts(store).memory for k in ks] == [False, True, True]  # type: ignore[operator]


async def test_a_quarantined_block_is_not_served_from_memory(tmp_path: Path) -> None:
    a, b = keys(2, 700)
    async with kvstore.open(tmp_path, namespace=NS, memory_bytes=BLOCK,
                            extent_bytes=4 << 20) as store:
        await store.put(a, block(1))  # cached ...
        await store.put(b, block(2))  # ... and pushed out by b (room for one)
        entry = parts(store).index.get_entries([a])[0]
        assert entry is not None and a not in parts(store).memory  # type: ignore[operator]
        with open(extent_path(store.path, entry.extent), "r+b") as f:  # damage a on disk
            at = entry.offset + SLOT_HEADER_BYTES + 10  # inside the payload
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 1]))
        assert await store.get(a) is None  # verified on the way in: quarantined
        assert await store.get(a) is None and a not in parts(store).memory  # type: ignore[operator]
        assert store.stats().corrupt_blocks == 1
        assert same(await store.get(b), block(2))


async def test_the_region_bounds_memory_whatever_is_put(tmp_path: Path) -> None:
    ks = keys(48, 800)
    async with kvstore.open(tmp_path, namespace=NS, memory_bytes=1 << 20,
                            extent_bytes=8 << 20) as store:
        for i in range(0, 48, 8):
            await store.put_many(ks[i:i + 8], [block(j) for j in range(i, i + 8)])
        st = store.stats()
        region = parts(store).memory.region  # type: ignore[union-attr]
        resident = resident_bytes(region.address, region.size)
    assert st.memory_used_bytes <= st.memory_capacity_bytes == 1 << 20
    assert st.memory_blocks == 16 and st.memory_evicted_blocks == 32
    assert resident <= 1 << 20


async def test_bad_memory_bytes_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="memory_bytes must be >= 0"):
        async with kvstore.open(tmp_path, namespace=NS, memory_bytes=-1):
            pass


# ------------------------------------------------------------------ prefetch


@asynccontextmanager
async def cold_store(tmp_path: Path, ks: list[bytes], memory_bytes: int = 2 << 20
                     ) -> AsyncIterator[tuple[kvstore.Store, CountingEngine]]:
    """A store holding ``block(i)`` under ``ks[i]``, with nothing of it in memory (as
    after a restart), on a real engine that counts reads."""
    engine = CountingEngine(real_engine("threads", tmp_path / "probe"))
    async with kvstore.open(tmp_path / "s", namespace=NS, engine=engine, extent_bytes=4 << 20,
                            memory_bytes=memory_bytes) as store:
        await store.put_many(ks, [block(i) for i in range(len(ks))])
        assert parts(store).memory is not None
        parts(store).memory.discard(ks)
        yield store, engine


async def test_prefetched_blocks_are_then_served_without_disk_io(tmp_path: Path) -> None:
    ks = keys(6, 900)
    async with cold_store(tmp_path, ks) as (store, engine):
        handle = store.prefetch(ks[:4] + keys(1, 990))  # one key that is not stored
        assert await handle == 4 and handle.scheduled == 4 and handle.requested == 5
        reads = engine.reads
        got = await store.get_many(ks[:4])
        st = store.stats()
    assert reads == 4 and engine.reads == 4  # the get read nothing
    assert all(same(g, block(i)) for i, g in enumerate(got))
    assert st.prefetch_blocks == 4 and st.memory_hits == 4 and st.hits == 4


async def test_a_get_of_keys_being_prefetched_waits_for_those_reads_only(
        tmp_path: Path) -> None:
    ks = keys(4, 1000)
    async with cold_store(tmp_path, ks) as (store, engine):
        gate = engine.gate("read")
        handle = store.prefetch(ks)
        got: list[torch.Tensor | None] = []
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await gate.entered.wait()  # the prefetch's read is on the device (held)

                async def get() -> None:
                    got.extend(await store.get_many(ks))

                tg.start_soon(get)
                await anyio.wait_all_tasks_blocked()  # the get waits for the prefetch
                assert not got
                gate.open()
        assert await handle == 4
        st = store.stats()
    assert engine.reads == 4 and st.memory_hits == 4  # one read per block, by the prefetch
    assert all(same(g, block(i)) for i, g in enumerate(got))


async def test_a_get_right_after_a_prefetch_of_its_keys_does_not_wait_on_itself(
        tmp_path: Path) -> None:
    """The get comes before the prefetch's reads were admitted: prefetch reads wait while
    a get is being served, so the get must not count as served while it waits for them
    (it did, and both waited for each other)."""
    ks = keys(4, 1100)
    async with cold_store(tmp_path, ks) as (store, engine):
        handle = store.prefetch(ks)
        with anyio.fail_after(30):
            got = await store.get_many(ks)
            assert await handle == 4
        st = store.stats()
    assert engine.reads == 4 and st.memory_hits == 4
    assert all(same(g, block(i)) for i, g in enumerate(got))


async def test_a_cancelled_prefetch_ends_and_reads_fall_back_to_disk(tmp_path: Path) -> None:
    ks = keys(3, 1100)
    async with cold_store(tmp_path, ks) as (store, engine):
        gate = engine.gate("read")
        handle = store.prefetch(ks)
        with anyio.fail_after(30):
            await gate.entered.wait()
            handle.cancel()
            assert await handle == 0
        assert handle.cancelled and handle.done and store.stats().memory_blocks == 0
        got = await store.get_many(ks)  # nothing waits for the cancelled prefetch
        assert all(same(g, block(i)) for i, g in enumerate(got))


async def test_prefetch_takes_at_most_its_share_of_memory(tmp_path: Path) -> None:
    ks = keys(16, 1200)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=4 << 20,
                            memory_bytes=16 * BLOCK, prefetch_share=0.5) as store:
        await store.put_many(ks, [block(i) for i in range(16)])
        parts(store).memory.discard(ks)  # type: ignore[union-attr]
        assert await store.prefetch(ks) == 8  # half of 16 blocks' worth
        assert all(g is not None for g in await store.get_many(ks[:8]))  # now used ...
        assert await store.prefetch(ks[8:]) == 8  # ... so they no longer count
        assert store.stats().memory_blocks == 16


async def test_closing_the_store_stops_a_prefetch_in_flight(tmp_path: Path) -> None:
    ks = keys(2, 1300)
    with anyio.fail_after(30):
        async with cold_store(tmp_path, ks) as (store, engine):
            gate = engine.gate("read")
            handle = store.prefetch(ks)
            await gate.entered.wait()
        assert handle.done and handle.cancelled and handle.arrived == 0


async def test_prefetch_without_the_memory_tier_says_what_to_do(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=4 << 20) as store:
        with pytest.raises(ValueError, match="memory_bytes"):
            store.prefetch(keys(1))


class _Locker:
    """A page locker that records what it is asked to lock and unlock."""

    status = "test locker"

    def __init__(self) -> None:
        self.locked: list[int] = []
        self.unlocked = 0

    def __call__(self, region: Arena, mode: bool | None) -> _Locker:
        self.locked.append(region.size)
        return self

    def close(self) -> None:
        self.unlocked += 1


async def test_the_tier_page_locks_its_region_and_unlocks_it_at_close(tmp_path: Path) -> None:
    locker = _Locker()
    page_locking.set_default_page_locker(locker)
    try:
        async with kvstore.open(tmp_path, namespace=NS, extent_bytes=4 << 20,
                                staging_bytes=1 << 20, memory_bytes=2 << 20):
            assert sorted(locker.locked) == [1 << 20, 2 << 20]  # the arena, the region
        assert locker.unlocked == 2
    finally:
        page_locking.set_default_page_locker(None)
