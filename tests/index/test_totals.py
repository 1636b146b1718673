"""Store-lifetime totals (kvstore/index/totals.py): persisted in the index, summed over opens;
the per-open counters of ``stats()`` start at 0 on every open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES, IndexEntry
from kvstore.index.totals import TOTAL_NAMES
from kvstore.testing import parts
from tests.conformance import NS, keys, make_tensor

BLOCK = (4096,)  # float16: 8 KiB payload, a 12 KiB slot
OPTIONS: dict[str, Any] = dict(namespace=NS, extent_bytes=256 << 10)


def value(i: int) -> torch.Tensor:
    return make_tensor(torch.float16, BLOCK, i)


def session(path: Path, fn: Any, **options: Any) -> Any:
    async def run() -> Any:
        async with kvstore.open(path, **OPTIONS, **options) as store:
            await fn(store)
            return store.stats()

    return anyio.run(run)


def test_totals_survive_reopen_and_add_up(tmp_path: Path) -> None:
    ks = keys(6)

    async def first(store: kvstore.Store) -> None:
        await store.put_many(ks[:4], [value(i) for i in range(4)])
        await store.put_many(ks[2:5], [value(i) for i in range(2, 5)])  # 2 dedup, 1 new

    s = session(tmp_path, first)
    assert (s.puts, s.put_blocks, s.dedup_blocks) == (2, 5, 2)
    assert s.totals["put_blocks"] == 5 and s.totals["dedup_blocks"] == 2

    async def nothing(store: kvstore.Store) -> None:
        pass

    s = session(tmp_path, nothing)
    assert (s.puts, s.put_blocks, s.dedup_blocks) == (0, 0, 0)  # this open's counters
    assert s.totals == {"puts": 2, "put_blocks": 5, "put_bytes": 5 * 8192, "dedup_blocks": 2,
                        "dedup_bytes": 2 * 8192, "evicted_blocks": 0, "evicted_bytes": 0,
                        "corrupt_blocks": 0}

    async def second(store: kvstore.Store) -> None:
        await store.put_many(ks[4:], [value(i) for i in range(4, 6)])  # 1 dedup, 1 new

    session(tmp_path, second)
    s = session(tmp_path, nothing)
    assert (s.totals["puts"], s.totals["put_blocks"], s.totals["dedup_blocks"]) == (3, 6, 3)


def test_evictions_and_corruption_are_totalled(tmp_path: Path) -> None:
    ks = keys(8)

    async def fill(store: kvstore.Store) -> None:
        for i, k in enumerate(ks):  # capacity: 4 slots of 12 KiB; the rest evicts
            await store.put_many([k], [value(i)])

    s = session(tmp_path, fill, capacity_bytes=4 * 12 << 10)
    evicted = s.evicted_blocks
    assert evicted == 4
    found: list[IndexEntry | None] = []

    async def locate(store: kvstore.Store) -> None:
        found.extend(parts(store).index.get_entries(ks[-1:]))

    session(tmp_path, locate)
    entry = found[0]
    assert entry is not None
    with open(extent_path(str(tmp_path), entry.extent), "r+b") as f:
        f.seek(entry.offset + SLOT_HEADER_BYTES + 3)
        f.write(b"\xff\xff")

    async def read(store: kvstore.Store) -> None:
        assert await store.get(ks[-1]) is None  # corrupt: a miss, quarantined

    s = session(tmp_path, read)
    assert s.corrupt_blocks == 1
    s = session(tmp_path, lambda store: anyio.sleep(0))
    assert s.totals["evicted_blocks"] == evicted
    assert s.totals["evicted_bytes"] == evicted * (12 << 10)
    assert s.totals["corrupt_blocks"] == 1
    assert set(s.totals) == set(TOTAL_NAMES)
