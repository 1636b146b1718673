"""The six concurrency bugs of issue 12, each written as the scenario that reproduced it, on
the io_uring and thread engines, asyncio and trio.  Every scenario runs under a deadline
(``run_within``): a hang is a failure, never a stuck CI job.  Nothing sleeps: operations
are held at gates (``tests/concurrency.py``) and released when the race is set up.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore.errors import BlockTooLargeError, StoreClosedError, StoreFullError
from kvstore.testing import parts, waiting_on
from kvstore.tools import fsck
from tests.concurrency import BACKENDS, ENGINES, GatedEngine, real_engine, run_within, until
from tests.conformance import NS, make_tensor, same

SLOT = 8192  # a 6000-byte block takes one 8 KiB slot

pytestmark = [pytest.mark.parametrize("backend", BACKENDS),
              pytest.mark.parametrize("kind", ENGINES)]


def block(i: int, n: int = 6000) -> torch.Tensor:
    return make_tensor(torch.uint8, (n,), i)


def keys(n: int, start: int = 0) -> list[bytes]:
    return NS.chain_keys(list(range(start, start + 4 * n)))[:n] if n else []


def opener(path: Path, engine: Any, **options: Any) -> Any:
    options.setdefault("extent_bytes", 256 << 10)
    options.setdefault("staging_bytes", 1 << 20)
    return kvstore.open(path / "store", namespace=NS, engine=engine, **options)


def no_damage(path: Path) -> list[str]:
    report = fsck.check(str(path / "store"))
    return [f"{f.kind}: {f.detail}" for f in report.findings if f.severity != fsck.NOTE]


def test_slow_read_does_not_make_eviction_empty_the_cache(tmp_path: Path, kind: str,
                                                           backend: str) -> None:
    """Bug 1: a full store, a get held on a slow device, then a one-block put: the put
    evicts one block and waits for the reader instead of evicting the whole cache."""
    ks = keys(11)

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with opener(tmp_path, engine, capacity_bytes=10 * SLOT) as store:
            for i, k in enumerate(ks[:10]):
                await store.put(k, block(i))
            gate = engine.gate("read")
            got: dict[str, Any] = {}

            async def reader() -> None:
                got["read"] = await store.get(ks[0])

            async def writer() -> None:
                got["put"] = await store.put(ks[10], block(10))

            with anyio.fail_after(DEADLINE_IN):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(reader)
                    await gate.entered.wait()
                    tg.start_soon(writer)
                    await until(lambda: store.stats().evicted_blocks >= 1 or "put" in got)
                    gate.open()
            assert got["put"] is True
            assert same(got["read"], block(0))
            assert store.stats().evicted_blocks == 1  # what the put needed, not the cache
            assert sum(await store.contains_many(ks)) == 10
            assert store.used_bytes <= 10 * SLOT

    run_within(scenario, backend)


@pytest.mark.parametrize("stage", ["write", "datasync"])
def test_cancelling_a_put_ends_promptly_and_leaves_it_whole_or_absent(
        tmp_path: Path, kind: str, backend: str, stage: str) -> None:
    """Bug 2: cancelling the scope around a store while a put's ops are in the kernel hung
    shutdown on io_uring.  It must end, and the put is then fully stored or absent."""
    k, value = keys(1)[0], block(7)

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        with anyio.fail_after(DEADLINE_IN):
            with anyio.CancelScope() as outer:
                async with opener(tmp_path, engine) as store:
                    gate = engine.gate(stage, hold=False)  # the op goes straight to the kernel
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(store.put, k, value)
                        await gate.entered.wait()
                        outer.cancel()
            assert outer.cancel_called  # and it ended: nothing waited on a dead reaper
        async with opener(tmp_path, "threads") as store:
            got = await store.get(k)
            assert got is None or same(got, value)

    run_within(scenario, backend)
    assert no_damage(tmp_path) == []


def test_a_batch_whose_blocks_each_fit_the_arena_completes(tmp_path: Path, kind: str,
                                                            backend: str) -> None:
    """Bug 3: with a 64 KiB arena, a batch of an 8 KiB and a 64 KiB slot deadlocked on its
    own arena runs, in put_many and in get_many.  A block larger than the arena is refused
    before any I/O, with a clear error."""
    small, big = block(1, 4096), block(2, (64 << 10) - 256)  # slots of 8 KiB and 64 KiB
    ks = keys(4)

    async def scenario() -> None:
        with anyio.fail_after(DEADLINE_IN):
            async with opener(tmp_path, real_engine(kind, tmp_path)) as store:  # 1 MiB arena
                await store.put_many(ks[:2], [small, big])
            async with opener(tmp_path, real_engine(kind, tmp_path),
                              staging_bytes=64 << 10) as store:
                got = await store.get_many(ks[:2])
                assert same(got[0], small) and same(got[1], big)
                await store.put_many(ks[2:], [small, big])
                got = await store.get_many(ks[2:] + ks[:2])
                assert all(same(g, v) for g, v in zip(got, [small, big, small, big]))
                with pytest.raises(BlockTooLargeError, match="staging_bytes"):
                    await store.put(keys(1, 100)[0], block(3, 64 << 10))
                assert not await store.contains(keys(1, 100)[0])

    run_within(scenario, backend)


def test_eviction_spares_the_parent_of_an_inflight_put(tmp_path: Path, kind: str,
                                                        backend: str) -> None:
    """Bug 4: child C (parent P) is being written while another put needs space: P was
    evicted, leaving C stored without its parent (a hole fsck did not see)."""
    p, c = keys(2)
    other, x = keys(2, 50)

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with opener(tmp_path, engine, capacity_bytes=3 * SLOT) as store:
            await store.put(p, block(0))       # least recently used ...
            await store.put(other, block(1))   # ... then this one
            gate = engine.gate("write")
            with anyio.fail_after(DEADLINE_IN):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: store.put(c, block(2), parent=p))
                    await gate.entered.wait()  # C holds its slot: the store is full
                    assert await store.put(x, block(3))  # must evict, but not P
                    gate.open()
            assert await store.match_prefix([p, c]) == 2
            assert await store.contains(x)
            assert not await store.contains(other)
        report = fsck.check(str(tmp_path / "store"))
        assert report.problems == [] and report.chain_holes == 0

    run_within(scenario, backend)


def test_an_eviction_chosen_before_a_put_decided_cannot_leave_its_chain_holed(
        tmp_path: Path, kind: str, backend: str) -> None:
    """Bug 7 (found by the slow state machine): a put's eviction chooses the leaf P
    before another put of P's chain decides; the second put deduplicates P, writes P's
    children and commits after the eviction: the children were stored without P.  The
    commit now checks what it deduplicated against and the put is redone."""
    chain = keys(6)
    other = keys(5, 50)
    holding, released = threading.Event(), threading.Event()

    def hold_the_writer(txn: Any) -> bool:
        holding.set()
        return released.wait(DEADLINE_IN)

    async def scenario() -> None:
        engine = real_engine(kind, tmp_path)
        async with opener(tmp_path, engine, capacity_bytes=7 * SLOT) as store:
            await store.put_many(chain[:3], [block(i) for i in range(3)],
                                 parents=[None, *chain[:2]])
            got: dict[str, Any] = {}

            async def evicting_put() -> None:  # 3 + 5 > 7 slots: evicts P = chain[2]
                got["other"] = await store.put_many(other, [block(9)] * 5,
                                                    parents=[None, *other[:4]])

            async def child_put() -> None:  # 3 + 3 <= 7: no eviction of its own
                got["chain"] = await store.put_many(chain, [block(i) for i in range(6)],
                                                    parents=[None, *chain[:5]])

            holder = parts(store).writer.submit(hold_the_writer)
            try:
                await until(holding.is_set)  # the writer thread is inside our job
                with anyio.fail_after(DEADLINE_IN):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(evicting_put)
                        await until(lambda: parts(store).writer.queued() == 1)  # eviction chosen
                        tg.start_soon(child_put)
                        await until(lambda: parts(store).writer.queued() == 2)  # its commit waits
                        released.set()
            finally:
                released.set()
            assert holder.result() is True
            # P was redone: it wrote P itself (and whatever else was evicted meanwhile)
            assert got["chain"].written >= 4
            assert got["chain"].written + got["chain"].deduplicated == 6
            assert store.stats().put_retries >= 1
            # 5 + 6 blocks exceed 7 slots: whichever put reserved last evicted from the
            # other's tail (the redone put reserves after the other one, which is in
            # line by then: the allocator serves waiting reserves in arrival order);
            # what is left of each chain is a prefix
            assert got["other"].written == 5
            assert await store.match_prefix(other) == sum(await store.contains_many(other))
            assert await store.match_prefix(chain) == sum(await store.contains_many(chain))
        report = fsck.check(str(tmp_path / "store"))
        assert report.problems == [] and report.chain_holes == 0

    run_within(scenario, backend)


def test_a_full_index_map_grows_then_fails_with_a_store_error(
        tmp_path: Path, kind: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug 5: lmdb.MapFullError escaped raw from group-commit jobs.  The map grows (between
    transactions) up to ``index_map_bytes``; past that a StoreFullError names the limit,
    and reads keep working."""
    import kvstore.index.index

    monkeypatch.setattr(kvstore.index.index, "INITIAL_MAP_BYTES", 128 << 10, raising=False)
    limit = 512 << 10
    tiny = [make_tensor(torch.uint8, (16,), i) for i in range(64)]

    async def scenario() -> None:
        stored = 0
        with anyio.fail_after(DEADLINE_IN):
            async with opener(tmp_path, real_engine(kind, tmp_path), sync=False,
                              index_map_bytes=limit, extent_bytes=8 << 20) as store:
                with pytest.raises(StoreFullError, match="index_map_bytes") as err:
                    for batch in range(10_000):
                        ks = keys(64, 1000 * batch)
                        await store.put_many(ks, tiny)
                        stored = 64 * (batch + 1)
                assert "reopen" in str(err.value)
                assert parts(store).index.env.info()["map_size"] == limit  # it grew to the limit
                assert not store.read_only and stored > 0
                got = await store.get_many(keys(64, 0))
                assert all(same(g, v) for g, v in zip(got, tiny))
                assert await store.delete(keys(1, 0)[0])

    run_within(scenario, backend)
    assert no_damage(tmp_path) == []


def test_close_drains_gets_in_flight_and_later_calls_say_closed(tmp_path: Path, kind: str,
                                                                backend: str) -> None:
    """Bug 6: aclose() did not wait for gets: a racing get failed with a raw ValueError or
    EBADF.  Close waits for it (it then returns its bytes); later calls raise
    StoreClosedError."""
    k, value = keys(1)[0], block(5)

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with opener(tmp_path, engine) as store:
            await store.put(k, value)
            gate = engine.gate("read")
            got: dict[str, Any] = {}

            async def reader() -> None:
                try:
                    got["read"] = await store.get(k)
                except StoreClosedError as e:
                    got["read"] = e

            async def closer() -> None:
                await store.aclose()
                got["closed"] = True

            with anyio.fail_after(DEADLINE_IN):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(reader)
                    await gate.entered.wait()
                    tg.start_soon(closer)
                    await until(lambda: "closed" in got or _draining(store))
                    gate.open()
            result = got["read"]
            assert isinstance(result, StoreClosedError) or same(result, value), result
            for call in (store.get(k), store.put(k, value), store.contains(k),
                         store.delete(k), store.match_prefix([k])):
                with pytest.raises(StoreClosedError):
                    await call
            with pytest.raises(StoreClosedError):
                store.stats()

    run_within(scenario, backend)
    assert no_damage(tmp_path) == []


DEADLINE_IN = 45.0
"""``fail_after`` inside a scenario (below ``run_within``'s), so a hang that cancellation
can reach fails with a traceback of where it waited."""


def _draining(store: kvstore.Store) -> bool:
    """Whether ``aclose`` is waiting for operations in flight (white box: the test must
    let the held read go once close has started waiting for it)."""
    ops = getattr(store, "_ops", None)
    return bool(getattr(ops, "draining", False))


def test_a_delete_waits_for_a_put_of_the_same_key_in_flight(tmp_path: Path, kind: str,
                                                            backend: str) -> None:
    """A put (or a remote-tier promotion, a background put) of K is on the device when K
    is deleted: the put lands first and the delete removes it; before, the delete found
    nothing, returned, and the put made K reappear after it."""
    k, other = keys(2)

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with opener(tmp_path, engine) as store:
            await store.put(other, block(1))
            gate = engine.gate("write")
            deleted: list[int] = []

            async def delete() -> None:
                deleted.append(await store.delete_many([k, other]))

            with anyio.fail_after(DEADLINE_IN):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: store.put(k, block(0)))
                    await gate.entered.wait()
                    tg.start_soon(delete)
                    # the delete waits for the put (on the old code it ran to the end)
                    await until(lambda: waiting_on(parts(store).puts.order, k) == 1)
                    assert deleted == []
                    gate.open()
            assert deleted == [2]
            assert not await store.contains(k) and not await store.contains(other)
        assert no_damage(tmp_path) == []

    run_within(scenario, backend)
