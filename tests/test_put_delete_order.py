"""Puts and deletes of one key take effect in the order they started (kvstore/core/key_order.py),
whatever either waits for on its way: room in the backlog, earlier calls of the key,
capacity.  Each scenario is the interleaving that broke it, set up at gates (no sleeps),
on asyncio and trio.

* A put waiting for backlog room, then a delete of its key: the delete returned False,
  then the put landed and the key was stored (the put registered only after its wait).
* A delete waiting behind a put of K, then a new put of K: the new put deduplicated
  against the block the delete was about to remove, and K ended absent.
* A put waiting for backlog room protected its parent from eviction only once admitted:
  an eviction meanwhile took the parent, and the put stored a child under a hole.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.testing import parts, waiting_on, waiting_reserves
from tests.concurrency import DEADLINE, Gate, GatedEngine, real_engine, until
from tests.conformance import NS, keys, make_tensor

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10
SLOT = 68 << 10  # a BLOCK-byte block's slot: header + payload, 4 KiB-aligned


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (BLOCK,), i)


def gated(path: Path, **options: object) -> tuple[GatedEngine, object]:
    engine = GatedEngine(real_engine("threads", path / "probe"))
    return engine, kvstore.open(path / "s", namespace=NS, engine=engine,
                                extent_bytes=4 << 20, **options)


async def test_a_delete_after_a_put_waiting_for_backlog_room_wins(tmp_path: Path) -> None:
    big, k = keys(2)
    engine, opening = gated(tmp_path, backlog_bytes=BLOCK)
    async with opening as store:  # type: ignore[attr-defined]
        gate = engine.gate("write")
        put: list[bool] = []
        deleted: list[bool] = []

        async def put_k() -> None:
            put.append(await store.put(k, block(1)))

        async def delete_k() -> None:
            deleted.append(await store.delete(k))

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.put, big, block(0))
                await gate.entered.wait()  # the backlog is full: held on the device
                tg.start_soon(put_k)
                await anyio.wait_all_tasks_blocked()  # put(K) waits for backlog room
                assert store.stats().backlog_bytes == BLOCK
                tg.start_soon(delete_k)
                await anyio.wait_all_tasks_blocked()
                assert deleted == []  # it waits for the put that started before it
                assert waiting_on(parts(store).puts.order, k) == 1
                gate.open()
        assert put == [True] and deleted == [True]
        assert await store.contains_many([big, k]) == [True, False]


async def test_a_put_after_a_waiting_delete_lands_after_it(tmp_path: Path) -> None:
    k, = keys(1)
    engine, opening = gated(tmp_path)
    async with opening as store:  # type: ignore[attr-defined]
        gate = engine.gate("write")
        results: dict[str, object] = {}

        async def call(name: str, fn: object, *args: object) -> None:
            results[name] = await fn(*args)  # type: ignore[operator]

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "first", store.put, k, block(0))
                await gate.entered.wait()
                tg.start_soon(call, "delete", store.delete, k)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(call, "second", store.put, k, block(1))
                await anyio.wait_all_tasks_blocked()
                assert results == {}
                gate.open()
        # first put, then the delete removed it, then the second put stored K again
        assert results == {"first": True, "delete": True, "second": True}
        got = await store.get(k)
        assert got is not None and torch.equal(got, block(1))


async def test_a_put_waiting_for_backlog_room_keeps_its_parent_from_eviction(
        tmp_path: Path) -> None:
    """Capacity for three blocks, P and Q stored and pinned, a put of X on the device
    (the store full), a put of Y admitted and waiting at capacity (nothing evictable),
    then put(K, parent=P) queued for backlog room.  P is unpinned and X lands: Y's
    eviction runs now, and it must not take P, the parent of a put in flight."""
    p, q, x, y, k = keys(5)
    engine, opening = gated(tmp_path, capacity_bytes=3 * SLOT, backlog_bytes=2 * BLOCK)
    async with opening as store:  # type: ignore[attr-defined]
        await store.put(p, block(0))
        await store.put(q, block(1))
        await store.pin([p, q])
        gate = engine.gate("write")
        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.put, x, block(2))
                await gate.entered.wait()  # X reserved: the store is full
                tg.start_soon(store.put, y, block(3))
                # Y's eviction found nothing (on the writer thread): it waits for space
                await until(lambda: waiting_reserves(parts(store).allocator) == 1)
                tg.start_soon(lambda: store.put(k, block(4), parent=p))
                await anyio.wait_all_tasks_blocked()
                assert store.stats().backlog_bytes == 2 * BLOCK  # K waits for room
                await store.unpin([p])
                gate.open()
        assert await store.contains_many([p, q, k]) == [True, True, True]
        assert store.used_bytes <= store.capacity_bytes


def test_submitted_put_then_delete_from_one_thread_end_with_the_key_absent(
        tmp_path: Path) -> None:
    """The same through the blocking facade: one thread submits put(K) while the backlog
    is full, then delete(K); the delete waits for the put and removes K."""
    big, k = keys(2, 50)
    engine = GatedEngine(real_engine("threads", tmp_path / "probe"))
    with kvstore.open_blocking(tmp_path / "s", namespace=NS, engine=engine,
                               extent_bytes=4 << 20, backlog_bytes=BLOCK) as store:
        async def arm() -> Gate:
            return engine.gate("write")

        async def open_gate() -> None:
            gate.open()

        gate = store.call(arm)
        first = store.submit(store.store.put, big, block(0))
        store.call(gate.entered.wait)  # the backlog is full: held on the device
        put = store.submit(store.store.put, k, block(1))
        delete = store.submit(store.store.delete, k)
        store.call(anyio.wait_all_tasks_blocked)  # put(K) waits for room, delete(K) too
        store.call(open_gate)
        assert first.result(timeout=DEADLINE) and put.result(timeout=DEADLINE)
        assert delete.result(timeout=DEADLINE) is True
        assert store.contains_many([big, k]) == [True, False]
