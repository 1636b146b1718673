"""The staging arena hands out aligned, disjoint runs and makes waiters wait."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest

from kvstore.errors import BlockTooLargeError
from kvstore.io.arena import Arena
from kvstore.testing import parts
from tests.concurrency import resident_bytes

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


def _resident_kib(arena: Arena) -> int:
    return resident_bytes(arena.address, arena.size) // 1024


def _until_prefaulted(arena: Arena, nbytes: int) -> None:
    deadline = time.monotonic() + 30
    while arena.prefaulted_bytes < nbytes:
        assert time.monotonic() < deadline, f"prefaulted {arena.prefaulted_bytes} of {nbytes}"
        os.sched_yield()


def test_pages_are_faulted_in_ahead_of_use_not_at_creation() -> None:
    arena = Arena(64 << 20)
    assert _resident_kib(arena) < 1024 and arena.prefaulted_bytes == 0  # opening is free
    small = arena.try_acquire(1 << 20)  # a store moving small blocks: 8 MiB ahead
    assert small is not None
    _until_prefaulted(arena, 8 << 20)
    assert 8 << 20 <= _resident_kib(arena) * 1024 < 16 << 20
    big = arena.try_acquire(24 << 20)  # now up to 2 x 25 MiB: the whole 50 MiB
    assert big is not None
    _until_prefaulted(arena, 50 << 20)
    assert _resident_kib(arena) * 1024 >= 50 << 20
    assert bytes(big.view[:4]) == b"\0\0\0\0"  # and the runs work as before
    arena.release(small)
    arena.release(big)
    arena.close()


def test_close_stops_a_prefault_in_progress() -> None:
    arena = Arena(512 << 20)
    run = arena.try_acquire(256 << 20)  # 512 MiB to fault in: close comes first
    assert run is not None
    arena.release(run)
    arena.close()  # joins the thread: at most one step more
    assert arena._prefault is not None and not arena._prefault.is_alive()
    assert arena.prefaulted_bytes <= arena.size


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="kernel without transparent huge pages")
def test_the_arena_asks_for_transparent_huge_pages() -> None:
    arena = Arena(16 << 20)
    try:
        assert "hg" in _vm_flags(arena.address)  # madvise(MADV_HUGEPAGE) took
    finally:
        arena.close()


async def test_a_store_opens_with_its_staging_arena_resident(tmp_path: Path) -> None:
    """Faulting the arena in while transfers run cost more than the zeroing itself
    (issue 13): a store populates it at open, off the event loop."""
    import kvstore

    async with kvstore.open(tmp_path / "s", staging_bytes=32 << 20) as store:
        arena = parts(store).arena
        assert arena.prefaulted_bytes == arena.size
        assert resident_bytes(arena.address, arena.size) == arena.size
        assert arena._prefault is None  # nothing left for the ahead-of-use thread
