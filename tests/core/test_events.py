"""The store's event stream (kvstore/core/events.py): every change of content is an event,
in commit order, published before the call that made it returns; a put that did not
commit leaves none; a subscriber that is slow, gone or cancelled never holds the store
up and loses nothing it was not told about (a gap, counted).

No sleeps: a put is held at a real engine's gate (tests/concurrency.py), a consumer's
wait is reached with ``anyio.wait_all_tasks_blocked``.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvstore
from kvstore import BlockEvent, EventGap, Subscription
from kvstore.core.events import EventHub
from kvstore.testing import parts
from tests.concurrency import GatedEngine, real_engine, run_within
from tests.conformance import NS, make_tensor
from tests.read_faults import ReadFaults, open_faulty
from tests.test_full_disk import Filler, small_fs  # noqa: F401 - small_fs: a fixture

SLOT = 4096  # a 64-byte block takes one 4 KiB slot


def value(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (64,), i)


def chain(n: int, start: int = 0) -> list[bytes]:
    """``n`` chained keys (block ``i``'s parent is block ``i - 1``)."""
    return NS.chain_keys(list(range(4 * start, 4 * (start + n))))


def opened(path: Path, **options: Any) -> Any:
    options.setdefault("extent_bytes", 1 << 20)
    options.setdefault("staging_bytes", 1 << 20)
    return kvstore.open(path / "store", namespace=NS, **options)


async def put_chain(store: kvstore.Store, ks: Sequence[bytes], seed: int = 0) -> None:
    await store.put_many(ks, [value(seed + i) for i in range(len(ks))],
                         parents=kvstore.chain_parents(list(ks)))


def drain(sub: Subscription) -> list[BlockEvent | EventGap]:
    out = []
    while (item := sub.next_nowait()) is not None:
        out.append(item)
    return out


def changes(items: Sequence[BlockEvent | EventGap]) -> list[tuple[str, bytes]]:
    return [(e.kind, e.key) for e in items if isinstance(e, BlockEvent)]


@pytest.mark.anyio
async def test_every_change_of_content_is_an_event_in_commit_order(tmp_path: Path) -> None:
    a = chain(3)
    xs = chain(3, 100)
    async with opened(tmp_path, capacity_bytes=4 * SLOT) as store:
        async with store.subscribe() as sub:
            await put_chain(store, a)
            # published before the put returned, with the parents the put gave
            stored = drain(sub)
            assert changes(stored) == [("stored", k) for k in a]
            assert [e.parent for e in stored if isinstance(e, BlockEvent)] == [None, a[0], a[1]]
            await put_chain(store, a)  # deduplicated: nothing changes, no event
            assert await store.delete_many([a[2]]) == 1
            assert changes(drain(sub)) == [("deleted", a[2])]
            await store.put(xs[0], value(10))
            await store.put(xs[1], value(11))  # the store is full now (4 slots)
            assert changes(drain(sub)) == [("stored", xs[0]), ("stored", xs[1])]
            await store.put(xs[2], value(12))  # evicts a leaf: a[1], least recently used
            got = drain(sub)
            assert changes(got) == [("evicted", a[1]), ("stored", xs[2])]
            assert not await store.contains(a[1]) and await store.contains(a[0])
            assert [e.seq for e in got] == [7, 8]  # one count over the whole stream
            assert store.stats().events_published == 8
            assert store.stats().event_subscribers == 1
        assert store.stats().event_subscribers == 0


@pytest.mark.anyio
async def test_concurrent_puts_are_published_in_commit_order_before_they_return(
        tmp_path: Path) -> None:
    chains = [chain(4, 10 * t) for t in range(6)]
    seen: list[BlockEvent | EventGap] = []
    async with opened(tmp_path) as store, store.subscribe() as sub:

        async def putter(t: int) -> None:
            await put_chain(store, chains[t], seed=4 * t)
            seen.extend(drain(sub))
            assert {k for k in chains[t]} <= {e.key for e in seen if isinstance(e, BlockEvent)}

        async with anyio.create_task_group() as tg:
            for t in range(len(chains)):
                tg.start_soon(putter, t)
    events = [e for e in seen if isinstance(e, BlockEvent)]
    assert len(events) == len(seen) == 24
    assert [e.seq for e in events] == list(range(1, 25))  # no gap, no repeat
    order = {e.key: e.seq for e in events}
    for ks in chains:  # a batch's blocks in its order: each after its parent
        assert [order[k] for k in ks] == sorted(order[k] for k in ks)


@pytest.mark.parametrize("kind", ["io_uring", "threads"])
def test_a_cancelled_put_leaves_no_event(tmp_path: Path, kind: str) -> None:
    ks = chain(2)

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with kvstore.open(tmp_path / "store", namespace=NS, engine=engine,
                                extent_bytes=1 << 20, staging_bytes=1 << 20) as store, \
                store.subscribe() as sub:
            gate = engine.gate("write")
            async with anyio.create_task_group() as tg:
                tg.start_soon(put_chain, store, ks)
                await gate.entered.wait()  # its slots are being written
                tg.cancel_scope.cancel()
                gate.open()
            assert not await store.contains(ks[0])
            assert drain(sub) == []
            await put_chain(store, ks)
            got = drain(sub)
            assert changes(got) == [("stored", k) for k in ks]
            assert [e.seq for e in got] == [1, 2]  # the cancelled put took no number

    run_within(scenario, "asyncio")


@pytest.mark.anyio
async def test_overflow_is_one_gap_in_place_of_what_was_lost_and_is_counted(
        tmp_path: Path) -> None:
    async with opened(tmp_path) as store, store.subscribe(max_events=3) as sub:
        await put_chain(store, chain(5))  # events 1-5: 3 fit
        await put_chain(store, chain(2, 50))  # 6-7: the gap grows
        assert sub.pending() == 4
        first = sub.next_nowait()
        assert isinstance(first, BlockEvent) and first.seq == 1
        await put_chain(store, chain(1, 60))  # 8: one place free, no room for gap + event
        await put_chain(store, chain(3, 70))  # 9-11
        got = drain(sub)
        assert [e.seq for e in got if isinstance(e, BlockEvent)] == [2, 3]
        assert got[2:] == [EventGap(4, 11, 8)]  # one gap, never two touching
        await put_chain(store, chain(3, 80))  # 12-14: room again; two fit after the gap
        await put_chain(store, chain(2, 90))  # 15-16: lost
        got = drain(sub)
        assert [e.seq if isinstance(e, BlockEvent) else e for e in got] == \
            [12, 13, 14, EventGap(15, 16, 2)]
        assert sub.dropped == 10 and store.stats().events_dropped == 10
        await put_chain(store, chain(1, 95))  # 17: after the gap, events flow again
        got = drain(sub)
        assert [e.seq for e in got if isinstance(e, BlockEvent)] == [17]


def test_slow_and_gone_subscribers_never_hold_puts_up(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with opened(tmp_path) as store:
            slow = store.subscribe(max_events=2)
            await slow.__aenter__()  # never read
            gone = store.subscribe(max_events=2)
            await gone.__aenter__()
            del gone  # dropped without closing: the store keeps it, bounded
            gc.collect()
            for i in range(40):
                await store.put(chain(1, 1000 + i)[0], value(i))
            assert store.stats().blocks == 40
            assert slow.pending() == 3  # 2 events and the gap
            assert slow.dropped == 38 and store.stats().events_dropped == 2 * 38
            assert store.stats().event_subscribers == 2
            await slow.__aexit__(None, None, None)

    run_within(scenario, "asyncio")  # a put that waited for a subscriber would hang


@pytest.mark.anyio
async def test_a_cancelled_consumer_loses_nothing(tmp_path: Path) -> None:
    ks = chain(3)
    async with opened(tmp_path) as store, store.subscribe() as sub:
        got: list[BlockEvent | EventGap] = []

        async def consume() -> None:
            async for item in sub:
                got.append(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()  # waiting for an event
            tg.cancel_scope.cancel()
        assert got == []
        await put_chain(store, ks)  # a waiter that was cancelled is woken harmlessly
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await put_chain(store, chain(1, 40))
            while len(got) < 4:
                await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
        assert changes(got) == [("stored", k) for k in ks + chain(1, 40)]


@pytest.mark.anyio
async def test_closing_ends_iteration_after_what_was_buffered(tmp_path: Path) -> None:
    ks = chain(2)
    got: list[BlockEvent | EventGap] = []
    async with opened(tmp_path) as store:
        sub = await store.subscribe().__aenter__()  # left open: the store's close ends it

        async def consume() -> None:
            async for item in sub:
                got.append(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await put_chain(store, ks)
            await store.aclose()  # the consumer's loop ends: the task group can exit
    assert changes(got) == [("stored", k) for k in ks]
    with pytest.raises(kvstore.StoreClosedError):
        store.subscribe()
    with pytest.raises(kvstore.StoreClosedError):
        store.snapshot()


@pytest.mark.anyio
async def test_without_subscribers_nothing_is_journaled(tmp_path: Path) -> None:
    async with opened(tmp_path) as store:
        await put_chain(store, chain(3))
        assert store.stats().events_published == 0
        async with store.subscribe():
            await put_chain(store, chain(2, 50))
        await store.delete_many(chain(3))
        assert store.stats().events_published == 2  # only while the subscriber was on
        assert parts(store).index.journal is None


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with opened(tmp_path) as store:
            for bad in (0, -1, 1.5, True):
                with pytest.raises(ValueError, match="max_events"):
                    store.subscribe(max_events=bad)
                with pytest.raises(ValueError, match="page_blocks"):
                    store.snapshot(page_blocks=bad)
            with pytest.raises(ValueError, match="order"):
                store.snapshot(order="chain")
            assert store.stats().event_subscribers == 0

    anyio.run(scenario)


def test_quarantine_and_restore_are_events(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A block a read cannot read leaves the index (quarantined); when the scrub reads it
    again and it verifies, it comes back (restored)."""
    ks = chain(4)

    async def scenario() -> None:
        faults = ReadFaults()
        async with open_faulty("simulated", tmp_path, faults, monkeypatch,
                               namespace=NS, extent_bytes=1 << 20,
                               staging_bytes=1 << 20) as store, store.subscribe() as sub:
            parts(store).rechecks.delays = (3600.0,)  # only the scrub reads it again
            await put_chain(store, ks)
            entry = parts(store).index.get_entries([ks[3]])[0]
            assert entry is not None
            faults.aim(store.path, entry, None)
            assert (await store.get_many(ks))[3] is None
            faults.clear()
            await store.scrub(rate_bytes_per_s=None)
            got = drain(sub)
            assert changes(got)[4:] == [("quarantined", ks[3]), ("restored", ks[3])]
            assert all(e.parent == ks[2] for e in got[4:] if isinstance(e, BlockEvent))

    anyio.run(scenario)


def test_a_put_that_finds_the_disk_full_leaves_no_event(small_fs: Path) -> None:  # noqa: F811
    """On a real full file system (tests/test_full_disk.py's loop mount), the commit that
    cannot grow the index fails its puts whole: none of their blocks is an event, and
    every block an event names is stored."""
    path = small_fs / "store"

    async def run() -> None:
        async with kvstore.open(path, namespace=NS, extent_bytes=16 << 20,
                                staging_bytes=24 << 20, engine="threads") as store, \
                store.subscribe(max_events=1 << 20) as sub:
            await store.put(chain(1)[0], value(0))
            filler = Filler(small_fs)
            failed: list[bytes] = []
            with pytest.raises(kvstore.StoreFullError):
                for batch in range(1, 60):
                    failed = chain(64, 64 * batch)
                    await store.put_many(failed, [value(0)] * 64)
            events = [e for e in drain(sub) if isinstance(e, BlockEvent)]
            assert {e.kind for e in events} == {"stored"}
            named = [e.key for e in events]
            assert set(named).isdisjoint(failed)
            assert all(await store.contains_many(named))
            assert not any(await store.contains_many(failed))
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            filler.give_back()
            await store.put_many(failed, [value(0)] * 64)  # the same blocks, now durable
            assert changes(drain(sub)) == [("stored", k) for k in failed]

    anyio.run(run)


@given(max_events=st.integers(1, 6),
       steps=st.lists(st.one_of(st.integers(1, 7).map(lambda n: ("commit", n)),
                                st.integers(0, 5).map(lambda n: ("read", n))), max_size=40))
def test_what_a_consumer_reads_accounts_for_every_event_exactly_once(
        max_events: int, steps: list[tuple[str, int]]) -> None:
    """Whatever the commits' sizes and the consumer's pace: events come in ``seq`` order,
    gaps cover exactly the events that are missing (never two touching), the buffer never
    holds more than ``max_events`` items, and the drops are counted."""
    hub = EventHub()
    sub = Subscription(hub, None, max_events)  # type: ignore[arg-type]  # attached here
    hub.attach(sub)
    read: list[BlockEvent | EventGap] = []
    for what, n in [*steps, ("read", 1 << 30)]:
        if what == "commit":
            hub.publish([("stored", i.to_bytes(16, "big"), None) for i in range(n)])
        else:
            for _ in range(n):
                item = sub.next_nowait()
                if item is None:
                    break
                read.append(item)
        assert sub.pending() <= max_events + 1  # (+1: a gap waiting for room)
    covered: list[int] = []
    for before, item in zip([None, *read], read):
        if isinstance(item, EventGap):
            assert not isinstance(before, EventGap)
            covered += range(item.first_seq, item.last_seq + 1)
            assert item.dropped == item.last_seq - item.first_seq + 1
        else:
            covered.append(item.seq)
    assert covered == list(range(1, hub.published + 1))
    assert sub.dropped == hub.dropped == sum(g.dropped for g in read if isinstance(g, EventGap))


@pytest.mark.anyio
async def test_what_does_not_change_the_content_is_no_event(tmp_path: Path) -> None:
    """Gets (and the memory tier's fills), prefetches, pins, lookups: no event."""
    ks = chain(3)
    async with opened(tmp_path, memory_bytes=1 << 20) as store:
        await put_chain(store, ks)
        async with store.subscribe() as sub:
            await store.pin(ks[:1])
            await store.unpin(ks[:1])
            assert all(v is not None for v in await store.get_many(ks))
            await store.prefetch(ks)
            assert await store.match_prefix(ks) == 3
            await put_chain(store, ks)  # all deduplicated
            assert store.stats().memory_blocks > 0  # the memory tier did fill
            assert drain(sub) == [] and store.stats().events_published == 0
