"""Request slots (kvstore/tiers/remote/request_slots.py): given back once, by the
thread that used one, or by the event loop when no thread ever started with it."""

from __future__ import annotations

import anyio
import pytest

from kvstore.tiers.remote.request_slots import RequestSlots


def test_a_slot_is_given_back_once_by_whoever_ends_its_use() -> None:
    slots = RequestSlots(2)
    a, b = slots.take_nowait(), slots.take_nowait()
    assert a is not None and b is not None and slots.take_nowait() is None
    # a's thread started: the loop giving up on it (a deadline) keeps the slot held
    assert a.claim()
    a.drop()
    assert slots.in_flight == 2 and slots.take_nowait() is None
    a.release()  # its request returned
    assert slots.in_flight == 1
    # b's thread never started: the loop gives it back, and a late start sends nothing
    b.drop()
    assert slots.in_flight == 0 and not b.claim()
    b.release()
    assert slots.in_flight == 0


def test_uploads_never_take_the_last_slot() -> None:
    slots = RequestSlots(3)
    ups = [slots.take_nowait(upload=True) for _ in range(3)]
    assert ups[2] is None and slots.in_flight == 2
    assert slots.take_nowait() is not None and slots.take_nowait() is None
    assert RequestSlots(1).take_nowait(upload=True) is not None  # one slot: shared


@pytest.mark.anyio
async def test_a_slot_given_back_on_another_thread_wakes_a_waiter(anyio_backend: str) -> None:
    slots = RequestSlots(1)
    held = slots.take_nowait()
    assert held is not None and held.claim()
    got = []

    async def waiter() -> None:
        got.append(await slots.take())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert not got
        await anyio.to_thread.run_sync(held.release)
    assert len(got) == 1 and slots.in_flight == 1
