"""The staging arena hands out aligned, disjoint runs and makes waiters wait."""

from __future__ import annotations

import anyio
import pytest

from kvstore.errors import BlockTooLargeError
from kvstore.io.arena import Arena

pytestmark = pytest.mark.anyio


async def test_runs_are_page_aligned_and_disjoint() -> None:
    arena = Arena(64 * 4096)
    runs = [arena.try_acquire(n) for n in (1, 4096, 5000, 3 * 4096)]
    assert all(r is not None for r in runs)
    spans = sorted((r.offset, r.length) for r in runs if r is not None)
    assert all((arena.address + off) % 4096 == 0 for off, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    for r in runs:
        assert r is not None
        arena.release(r)
    assert arena.free_bytes == arena.size
    arena.close()


async def test_acquire_waits_until_space_is_released() -> None:
    arena = Arena(4 * 4096)
    first = await arena.acquire(3 * 4096)
    got = []

    async def waiter() -> None:
        got.append(await arena.acquire(2 * 4096))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # only one page is free
        arena.release(first)
    assert got[0].length == 2 * 4096
    arena.release(got[0])
    arena.close()


async def test_a_transfer_larger_than_the_arena_is_refused() -> None:
    arena = Arena(4096)
    with pytest.raises(BlockTooLargeError, match="staging_bytes"):
        await arena.acquire(8192)
    arena.close()
