"""Bounded capacity: never exceeded (even under concurrent puts), eviction is leaf-first
LRU and never touches pinned blocks, a full store fails clearly and loses nothing, and a
shared prefix is stored once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, make_tensor, same

pytestmark = pytest.mark.anyio

SLOT = 8192  # every block below is 6000 bytes: one 8 KiB slot


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (6000,), i)


def chain(start: int, n: int) -> list[bytes]:
    return NS.chain_keys(list(range(start, start + 4 * n)))


def opener(path: Path, capacity: int, **options: Any) -> Any:
    return kvstore.open(path, namespace=NS, capacity_bytes=capacity, extent_bytes=256 << 10,
                        staging_bytes=1 << 20, **options)


async def put_chain(store: kvstore.Store, keys: list[bytes], seed: int) -> kvstore.PutResult:
    return await store.put_many(keys, [block(seed + i) for i in range(len(keys))],
                                parents=kvstore.chain_parents(keys))


async def test_capacity_is_never_exceeded_under_concurrent_puts(tmp_path: Path) -> None:
    """The store's own high-water mark is taken right after every allocation."""
    capacity = 40 * SLOT
    async with opener(tmp_path, capacity) as store:
        async def writer(w: int) -> None:
            for round_ in range(3):
                await put_chain(store, chain(10_000 * w + 1000 * round_, 12), 100 * w + round_)
                assert store.used_bytes <= capacity

        async with anyio.create_task_group() as tg:
            for w in range(6):
                tg.start_soon(writer, w)
        stats = store.stats()
        stored = sum(e.slot_len for _, e in parts(store).index.iter_entries())
    assert 0 < stats.peak_used_bytes <= capacity
    assert stored <= capacity
    assert stats.used_bytes <= capacity and stats.stored_bytes <= capacity
    assert stats.evicted_blocks >= 6 * 3 * 12 - 40
    report = fsck.check(str(tmp_path))
    assert not report.damage


async def test_eviction_is_leaf_first_so_chains_keep_no_holes(tmp_path: Path) -> None:
    a, b = chain(0, 10), chain(5000, 10)
    async with opener(tmp_path, 20 * SLOT) as store:
        await put_chain(store, a, 0)
        await put_chain(store, b, 100)
        await store.get_many(a)  # a is now the more recently used chain
        await put_chain(store, chain(9000, 3), 200)  # needs 3 slots: evicts from b's tail
        assert await store.match_prefix(a) == 10
        kept_b = await store.match_prefix(b)
        assert kept_b < 10
        assert await store.contains_many(b) == [True] * kept_b + [False] * (10 - kept_b)
        got = await store.get_many(b[:kept_b])
    assert all(same(g, block(100 + i)) for i, g in enumerate(got))


async def test_pinned_blocks_are_never_evicted(tmp_path: Path) -> None:
    system = chain(0, 8)
    async with opener(tmp_path, 16 * SLOT) as store:
        await put_chain(store, system, 0)
        await store.pin(system)
        assert store.stats().pinned_blocks == 8
        for r in range(5):  # churn far more than the capacity through the store
            await put_chain(store, chain(10_000 + 1000 * r, 6), 50 + r)
        assert await store.match_prefix(system) == 8
        with pytest.raises(kvstore.CapacityError, match="pinned"):
            await put_chain(store, chain(90_000, 9), 90)  # only 8 unpinned slots exist
        assert await store.match_prefix(system) == 8  # the failed batch lost nothing
        assert all(same(g, block(i)) for i, g in enumerate(await store.get_many(system)))
        await store.unpin(system)
        await put_chain(store, chain(90_000, 9), 90)  # now the system prompt can make room
        assert await store.match_prefix(system) < 8


async def test_a_shared_system_prompt_is_stored_once(tmp_path: Path) -> None:
    system = list(range(64))  # 16 blocks of 4 tokens
    async with opener(tmp_path, 1 << 30) as store:
        for session in range(10):
            keys = NS.chain_keys(system + list(range(1000 * (session + 1), 1000 * (session + 1) + 8)))
            await store.put_many(keys, [block(hash(k) % 1000) for k in keys],
                                 parents=kvstore.chain_parents(keys))
        stats = store.stats()
    assert stats.blocks == 16 + 10 * 2
    assert stats.put_blocks == 36 and stats.dedup_blocks == 9 * 16
    assert stats.dedup_ratio == pytest.approx((36 + 9 * 16) / 36)


async def test_eviction_survives_reopen_and_fsck_is_clean(tmp_path: Path) -> None:
    async with opener(tmp_path, 12 * SLOT) as store:
        for r in range(4):
            await put_chain(store, chain(1000 * r, 5), 10 * r)
        evicted = store.stats().evicted_blocks
    assert evicted >= 8
    assert fsck.check(str(tmp_path), deep=True).problems == []
    async with opener(tmp_path, 12 * SLOT) as store:
        assert store.used_bytes <= 12 * SLOT
        assert await store.match_prefix(chain(3000, 5)) == 5  # the newest chain is whole


async def test_evicted_blocks_leave_the_memory_tier(tmp_path: Path) -> None:
    """The allocator reports what it evicted and the put path drops it from the memory
    tier: evicted blocks are neither hits nor kept there (before, when the report was
    ignored, they stayed cached beside the blocks that replaced them)."""
    old, new = chain(0, 10), chain(5000, 3)
    async with opener(tmp_path, 10 * SLOT, memory_bytes=1 << 20) as store:
        await put_chain(store, old, 0)
        assert store.stats().memory_blocks == 10  # write-through: every put block cached
        await put_chain(store, new, 100)  # evicts 3 of the old chain's leaves
        stats = store.stats()
        assert stats.evicted_blocks == 3
        assert stats.memory_blocks == 10  # the 7 old ones left and the 3 new ones
        assert await store.get_many(old[-3:]) == [None, None, None]
        assert await store.match_prefix(old) == 7
