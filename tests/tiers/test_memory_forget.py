"""One ``forget`` for the memory tier (kvstore/tiers/memory/tier.py): a cached block
evicted on disk, quarantined or deleted leaves the memory tier through
``MemoryTier.forget`` at once, and is never a memory hit afterwards."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.testing import parts
from kvstore.tiers.memory.tier import MemoryTier
from tests.conformance import NS, keys, make_tensor, same

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (BLOCK,), i)


async def evict(store: kvstore.Store, victim: bytes) -> None:
    """Two more blocks into a store with room for two: both stored ones go."""
    await store.put_many(keys(2, 9100), [block(8), block(9)])
    assert store.stats().evicted_blocks == 2


async def quarantine(store: kvstore.Store, victim: bytes) -> None:
    """Damage the block on disk; the scrub reads every slot and quarantines it (a get
    would not: it is served from memory, where the bytes are still good)."""
    entry = parts(store).index.get_entries([victim])[0]
    assert entry is not None
    with open(extent_path(store.path, entry.extent), "r+b") as f:
        at = entry.offset + SLOT_HEADER_BYTES + 10  # inside the payload
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    report = await store.scrub(rate_bytes_per_s=None)
    assert report.failed_blocks == 1


async def delete(store: kvstore.Store, victim: bytes) -> None:
    assert await store.delete(victim)


@pytest.mark.parametrize("drop", [evict, quarantine, delete], ids=lambda f: f.__name__)
async def test_a_block_gone_from_disk_is_never_a_memory_hit_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        drop: Callable[[kvstore.Store, bytes], Awaitable[None]]) -> None:
    forgotten: list[bytes] = []
    real_forget = MemoryTier.forget

    def forget(self: MemoryTier, keys_: Sequence[bytes]) -> None:
        forgotten.extend(keys_)
        real_forget(self, keys_)

    monkeypatch.setattr(MemoryTier, "forget", forget)
    a, b = keys(2, 9000)
    async with kvstore.open(tmp_path, namespace=NS, memory_bytes=8 * BLOCK,
                            capacity_bytes=2 * (BLOCK + 4096), extent_bytes=4 << 20) as store:
        await store.put(a, block(1))
        await store.put(b, block(2))
        memory = parts(store).memory
        assert memory is not None and a in memory
        assert same(await store.get(a), block(1))  # a memory hit
        hits = store.stats().memory_hits
        assert hits == 1
        await drop(store, a)
        assert a in forgotten  # through the one method, at once
        assert a not in memory
        assert await store.get(a) is None
        assert await store.get(a) is None
        assert store.stats().memory_hits == hits  # never served from memory again
