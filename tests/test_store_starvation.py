"""A waiting foreground caller is never overtaken for ever (issue 31, items 2 and 3): it
waits at most for what was admitted before it, however long the competing load lasts.

Bounded by counting operations, not by clocks: each test runs a sustained stream of
competing calls (bounded loops, so the test ends by itself), starts the waiting call
in the middle of it, and counts the competing calls that were *started after* the
waiter began and *completed* (not dropped) before it returned.  No sleeps."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from tests.concurrency import DEADLINE, GatedEngine, real_engine, until
from tests.conformance import NS, keys, make_tensor, same

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10
ROUNDS = 40  # puts / gets per competing task: the stream outlasts any fair wait


def block(i: int, n: int = BLOCK) -> torch.Tensor:
    return make_tensor(torch.uint8, (n,), i)


async def test_background_puts_do_not_overtake_a_waiting_foreground_put(
        tmp_path: Path) -> None:
    """Three tasks stream background puts under a small backlog; a foreground put larger
    than the bound starts while they run.  Before: every background put that fitted
    went ahead of it, so it waited until the stream ended.  Now background puts that
    arrive while it waits are dropped, and it goes once those admitted before it end."""
    async with kvstore.open(tmp_path, namespace=NS, engine="threads", sync=False,
                            extent_bytes=16 << 20, backlog_bytes=2 * BLOCK) as store:
        waiter = {"waiting": False, "done": False}
        overtook = 0  # background puts started after the waiter and written before it ended
        written = 0
        big = keys(6, start=10_000)

        async def stream(task: int) -> None:
            nonlocal overtook, written
            for i in range(ROUNDS):
                after = waiter["waiting"]
                r = await store.put_many(keys(1, start=task * 1000 + i),
                                         [block(i)], background=True)
                written += r.written
                if after and r.written and not waiter["done"]:
                    overtook += 1

        async def foreground() -> None:
            await until(lambda: written >= 3 and store.stats().backlog_bytes > 0)
            waiter["waiting"] = True  # no await from here to the put's admission check
            result = await store.put_many(big, [block(i) for i in range(6)])
            waiter["done"] = True
            assert result.written == 6

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                for task in range(3):
                    tg.start_soon(stream, task)
                tg.start_soon(foreground)
        assert waiter["done"]
        assert overtook <= 3, f"{overtook} background puts overtook the waiting put"
        assert same(await store.get(big[5]), block(5))
        assert store.stats().backlog_bytes == 0


async def test_a_small_foreground_put_does_not_overtake_a_waiting_large_one(
        tmp_path: Path) -> None:
    """Sibling of item 3: foreground puts that fit went ahead of one waiting for room.
    Now they queue behind it, in arrival order."""
    engine = GatedEngine(real_engine("threads", tmp_path / "probe"))
    async with kvstore.open(tmp_path / "s", namespace=NS, engine=engine, sync=False,
                            extent_bytes=16 << 20, backlog_bytes=2 * BLOCK) as store:
        order: list[str] = []
        gate = engine.gate("write")

        async def put(name: str, ks: list[bytes]) -> None:
            await store.put_many(ks, [block(i) for i in range(len(ks))])
            order.append(name)

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(put, "first", keys(1, start=1))
                await gate.entered.wait()  # one block in flight, held
                tg.start_soon(put, "large", keys(3, start=10))  # does not fit: waits
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(put, "small", keys(1, start=20))  # would fit beside "first"
                await anyio.wait_all_tasks_blocked()
                assert order == []
                gate.open()
        assert order == ["first", "large", "small"]


@pytest.mark.parametrize("waits_by", ["get", "handle"])
async def test_a_get_waiting_on_a_prefetch_is_not_held_back_by_other_gets(
        tmp_path: Path, waits_by: str) -> None:
    """A get of a key being prefetched waits for the prefetch's read, which the scheduler
    admitted only while no get was served: under a stream of other gets (one held on
    the device throughout, so the stream never pauses) it waited until the stream
    ended.  Now the awaited prefetch reads go at once; the other gets that complete
    meanwhile are those running beside it, a handful, not the stream.  Sibling: a
    caller awaiting the prefetch's handle itself (``waits_by="handle"``)."""
    path = tmp_path / "s"
    wanted, *others = keys(5)
    async with kvstore.open(path, namespace=NS, engine="threads", sync=False,
                            extent_bytes=16 << 20) as store:
        await store.put_many([wanted, *others], [block(i) for i in range(5)])
    engine = GatedEngine(real_engine("threads", tmp_path / "probe"))
    # a fresh open: nothing in the memory tier yet, so the prefetch reads the disk
    async with kvstore.open(path, namespace=NS, engine=engine, sync=False,
                            extent_bytes=16 << 20, memory_bytes=4 << 20) as store:
        waiter = {"waiting": False, "done": False}
        overtook = 0  # gets started after the waiter and completed before it returned
        streams_left = 2
        gate = engine.gate("read")
        got: list[torch.Tensor | None] = []

        async def held_get() -> None:
            await store.get(others[0], torch.empty(BLOCK, dtype=torch.uint8))

        async def stream(task: int) -> None:
            nonlocal overtook, streams_left
            out = torch.empty(BLOCK, dtype=torch.uint8)  # out=: never cached in memory
            for i in range(ROUNDS):
                after = waiter["waiting"]
                assert await store.get(others[1 + (task + i) % 3], out) is not None
                if after and not waiter["done"]:
                    overtook += 1
            streams_left -= 1
            if not streams_left:
                gate.open()

        async def waiting_get() -> None:
            waiter["waiting"] = True
            if waits_by == "handle":
                assert await handle == 1
            got.append(await store.get(wanted))
            waiter["done"] = True
            gate.open()

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(held_get)
                await gate.entered.wait()  # a get is being served, and stays so
                handle = store.prefetch([wanted])
                await until(lambda: store.stats().io_queue_depth.get("prefetch", 0) > 0)
                tg.start_soon(stream, 0)
                tg.start_soon(stream, 1)
                await until(lambda: store.stats().gets >= 2)  # the stream is running
                tg.start_soon(waiting_get)
        assert await handle == 1
        assert same(got[0], block(0))
        assert overtook <= 8, f"{overtook} other gets completed while the get waited"
