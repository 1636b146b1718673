"""The arena serves waiting transfers in arrival order (issue 31): a large transfer that
waits is not overtaken by smaller ones for as long as they keep coming.

Bounded by counting, not by clocks: four tasks stream small acquisitions (each holds its
run across a scheduling point, so the arena is never empty while they run: a bounded
number of rounds, so the test ends by itself), a transfer of the whole arena starts in
the middle of it, and the test counts the small runs *requested after* it began waiting
and *granted before* it.  Before: every one that found room went ahead, so it waited
for the whole stream (every later request overtook it).  No sleeps."""

from __future__ import annotations

import anyio
import pytest

from kvstore.disk.format import PAGE
from kvstore.io.arena import Arena
from tests.concurrency import until

pytestmark = pytest.mark.anyio

ROUNDS = 200  # acquisitions per competing task: the stream outlasts any fair wait


async def test_a_waiting_large_transfer_is_not_overtaken_by_a_stream_of_small_ones() -> None:
    arena = Arena(64 * PAGE)
    state = {"waiting": False, "granted": False}
    overtook = 0  # small runs requested after the large one waited, granted before it
    granted = 0

    async def stream() -> None:
        nonlocal overtook, granted
        for _ in range(ROUNDS):
            after = state["waiting"]
            run = await arena.acquire(4 * PAGE)
            granted += 1
            if after and not state["granted"]:
                overtook += 1
            await anyio.lowlevel.checkpoint()  # held across a scheduling point
            arena.release(run)

    async def large() -> None:
        await until(lambda: granted >= 8)
        state["waiting"] = True  # no await from here to its place in the queue
        run = await arena.acquire(arena.size)
        state["granted"] = True
        assert granted < 4 * ROUNDS, "granted only once the stream had ended"
        await anyio.lowlevel.checkpoint()
        arena.release(run)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(stream)
        tg.start_soon(large)
    assert overtook == 0, f"{overtook} later requests went ahead of the waiting transfer"
    assert arena.free_bytes == arena.size
    arena.close()


async def test_try_acquire_does_not_go_ahead_of_a_waiter() -> None:
    arena = Arena(4 * PAGE)
    first = await arena.acquire(3 * PAGE)
    got = []

    async def waiter() -> None:
        got.append(await arena.acquire(2 * PAGE))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert arena.try_acquire(PAGE) is None  # a page is free, but a transfer waits
        arena.release(first)  # handed to the waiter at once
        assert len(got) == 0 and arena.free_bytes == 2 * PAGE
    assert got[0].length == 2 * PAGE
    arena.release(got[0])
    assert arena.free_bytes == arena.size
    arena.close()


async def test_a_cancelled_waiter_lets_the_next_one_through() -> None:
    """Leaving the queue passes the room on: the one behind a cancelled head is not left
    waiting for a release that already came."""
    arena = Arena(4 * PAGE)
    held = await arena.acquire(3 * PAGE)
    got: list[int] = []
    head = anyio.CancelScope()

    async def waiter(n: int, scope: anyio.CancelScope) -> None:
        with scope:
            run = await arena.acquire(n * PAGE)
            got.append(n)
            arena.release(run)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 4, head)  # the head: needs the whole arena
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(waiter, 1, anyio.CancelScope())  # behind it, though a page is free
        await anyio.wait_all_tasks_blocked()
        assert got == [] and arena.try_acquire(PAGE) is None
        head.cancel()
    assert got == [1]  # went once the head left, with the page that was free all along
    arena.release(held)
    assert arena.free_bytes == arena.size
    arena.close()
