"""Opening and closing a store many times leaks no mapped (or page-locked) memory.

On this CPU-only machine the registration itself cannot run, so the test measures what
it can for real: the address space.  The staging arena is the memory that would be
page-locked; if a close failed to unmap it (or the LMDB map, or anything else), the
mapping count and the mapped size of /proc/self/maps would grow with every cycle.
RSS is not used: it depends on page faults, not on what stays mapped.  The GPU script
(tests/gpu) repeats the cycles with real registration and checks the pool is empty.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.cuda import _lib
from kvstore.cuda.page_locked import pool
from kvstore.testing import parts
from tests.conformance import SMALL_EXTENT

pytestmark = pytest.mark.anyio

STAGING = 8 << 20
CYCLES = 50


def mapped() -> tuple[int, int]:
    """(number of mappings, total mapped bytes) of this process."""
    n = size = 0
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split(None, 1)[0].split("-")
            n += 1
            size += int(hi, 16) - int(lo, 16)
    return n, size


async def _cycles(path: Path, count: int) -> None:
    key = bytes(range(16))
    for i in range(count):
        async with kvstore.open(path, extent_bytes=SMALL_EXTENT, staging_bytes=STAGING,
                                index_map_bytes=64 << 20) as store:
            if i == 0:
                await store.put(key, torch.arange(4096, dtype=torch.float16))
            got = await store.get(key)           # fault arena pages in, as real use does
            assert got is not None
            store.stats()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_open_close_cycles_do_not_grow_mapped_memory(
        tmp_path: Path, use_built_runtime: _lib.Runtime) -> None:
    await _cycles(tmp_path, 3)                   # warm up: imports, thread pools, caches
    before = mapped()
    locked_before = pool().registered_bytes
    await _cycles(tmp_path, CYCLES)
    after = mapped()
    # One leaked arena per cycle would be 50 mappings and 400 MiB; allow a little slack
    # for allocator arenas of threads that come and go.
    assert after[0] - before[0] < CYCLES // 5, (before, after)
    assert after[1] - before[1] < STAGING, (before, after)
    assert pool().registered_bytes == locked_before    # every registration was released


async def test_arena_is_unmapped_at_close(tmp_path: Path) -> None:
    async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT, staging_bytes=STAGING,
                            page_lock_staging=False) as store:
        lo = parts(store).arena.address
        with open("/proc/self/maps") as f:
            starts = {int(line.split("-", 1)[0], 16) for line in f}
        assert lo in starts
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split(None, 1)[0].split("-")) for line in f]
    assert not any(a <= lo < b and b - a >= STAGING for a, b in spans)
