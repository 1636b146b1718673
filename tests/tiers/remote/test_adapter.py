"""Where the remote tier meets the local store (kvstore/tiers/remote/adapter.py), under
concurrency: reads of the same blocks at once send one request per block, a read whose
fetcher is cancelled fetches for itself, and a get that a promotion overtakes is served
from the fetched block, not fetched again.  A real SeaweedFS cluster; the S3 requests
and the store's reads are held at gates (no sleeps)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvstore
from kvstore.remote import RemoteConfig
from kvstore.testing import parts
from kvstore.tiers.remote.client import ObjectClient
from tests.concurrency import DEADLINE, GatedEngine, real_engine, until
from tests.conformance import NS, SMALL_EXTENT, keys, same
from tests.tiers.remote.cluster import SeaweedCluster
from tests.tiers.remote.test_tier import config, fresh_prefix, open_store, parents, value

pytestmark = pytest.mark.anyio


class HeldClient:
    """The tier's real S3 client, with every GET held until ``release`` is set (and
    counted): a test learns that a fetch is in its request from ``entered``."""

    def __init__(self, inner: ObjectClient) -> None:
        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self.gets = 0

    def get(self, name: str) -> Any:
        with self._lock:
            self.gets += 1
        self.entered.set()
        assert self.release.wait(DEADLINE), "a held GET was never released"
        return self.inner.get(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def bucket_with(seaweed: SeaweedCluster, path: Path, n: int) -> tuple[RemoteConfig,
                                                                          list[bytes]]:
    """A fresh prefix holding a chain of ``n`` blocks, uploaded by another store."""
    remote, ks = config(seaweed, fresh_prefix()), keys(n)
    async with open_store(path, remote) as a:
        await a.put_many(ks, [value(i) for i in range(n)], parents=parents(ks))
        await a.remote.flush()
        assert a.remote.stats().uploaded_blocks == n
    return remote, ks


class Cancellable:
    """A call run as a task (``await it()``) that the test cancels from outside
    (``await it.cancel()`` returns once the call has ended)."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self._fn, self._args = fn, args
        self.scope, self.over = anyio.CancelScope(), anyio.Event()

    async def __call__(self) -> None:
        try:
            with self.scope:
                await self._fn(*self._args)
        finally:
            self.over.set()

    async def cancel(self) -> None:
        self.scope.cancel()
        await self.over.wait()
        assert self.scope.cancelled_caught


def hold_gets(store: Any) -> HeldClient:
    store.remote.client = held = HeldClient(store.remote.client)
    return held


async def test_concurrent_reads_of_one_prefix_send_one_request_per_block(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """Two lookups and a get of the same chain, the later ones started while the first
    one's GETs are in flight: they wait for it, and every block is requested once."""
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 3)
    async with open_store(tmp_path / "b", remote) as b:
        held = hold_gets(b)
        probes = b.remote.stats().requests  # the access check at open
        hits: list[int] = []
        got: list[Any] = []

        async def lookup() -> None:
            hits.append(await b.match_prefix(ks))

        async def get() -> None:
            got.extend(await b.get_many(ks))

        async with anyio.create_task_group() as tg:
            tg.start_soon(lookup)
            await until(held.entered.is_set)  # the first lookup is in its requests
            tg.start_soon(lookup)
            tg.start_soon(get)
            await until(lambda: b.remote.stats().joined == 6)  # both wait for it
            held.release.set()
        assert hits == [3, 3]
        assert all(same(g, value(i)) for i, g in enumerate(got))
        st = b.remote.stats()
        assert (held.gets, st.requests - probes, st.hits, st.gets) == (3, 3, 3, 3)
        await b.remote.flush()
        assert st.promoted_blocks + b.remote.stats().promoted_blocks >= 3
        assert await b.contains_many(ks) == [True] * 3


async def test_a_key_twice_in_one_get_is_fetched_once(seaweed: SeaweedCluster,
                                                      tmp_path: Path) -> None:
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 2)
    async with open_store(tmp_path / "b", remote) as b:
        got = await b.get_many([ks[0], ks[1], ks[0]])
        assert same(got[0], value(0)) and same(got[1], value(1)) and same(got[2], value(0))
        assert got[0] is not got[2]  # each its own tensor
        st = b.remote.stats()
        assert (st.gets, st.hits, st.joined) == (2, 2, 0)
        found = await b.match_prefix([ks[0], ks[0]])  # (not a chain, but asked)
        assert found == 2 and not b.remote.fetching


async def test_a_read_whose_fetcher_is_cancelled_fetches_the_blocks_itself(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """A get waits for a lookup's fetch; the lookup is cancelled before its answers
    came: the get asks for the blocks itself and gets them."""
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 3)
    async with open_store(tmp_path / "b", remote) as b:
        held = hold_gets(b)
        got: list[Any] = []
        lookup = Cancellable(b.match_prefix, ks)

        async def get() -> None:
            got.extend(await b.get_many(ks))

        async with anyio.create_task_group() as tg:
            tg.start_soon(lookup)
            await until(held.entered.is_set)  # the lookup is in its requests
            tg.start_soon(get)
            await until(lambda: b.remote.stats().joined == 3)  # the get waits for it
            await lookup.cancel()
            held.release.set()
        assert len(got) == 3 and all(same(g, value(i)) for i, g in enumerate(got))
        st = b.remote.stats()
        assert st.hits == 3  # the get's own fetch; the lookup's answers were dropped
        assert not b.remote.fetching


async def test_keys_past_a_chain_walks_first_miss_are_fetched_by_their_waiter(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """A lookup's chain walk stops at a hole; a get waiting on the lookup for keys past
    the hole gets no answer from it (the walk never used them) and asks itself."""
    remote, ks = config(seaweed, fresh_prefix()), keys(5)
    async with open_store(tmp_path / "a", remote) as a:
        await a.put_many(ks[:2], [value(i) for i in range(2)], parents=parents(ks)[:2])
        await a.put_many(ks[3:], [value(i) for i in range(3, 5)], parents=parents(ks)[3:])
        await a.remote.flush()
    async with open_store(tmp_path / "b", remote) as b:
        held = hold_gets(b)
        hits: list[int] = []
        got: list[Any] = []

        async def lookup() -> None:
            hits.append(await b.match_prefix(ks))

        async def get() -> None:
            got.extend(await b.get_many(ks[3:]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(lookup)
            await until(held.entered.is_set)
            tg.start_soon(get)
            await until(lambda: b.remote.stats().joined == 2)
            held.release.set()
        assert hits == [2]
        assert len(got) == 2 and all(same(g, value(3 + i)) for i, g in enumerate(got))
        assert b.remote.stats().hits == 2 + 2
        assert not b.remote.fetching


async def test_a_lookup_waiting_on_a_prefetchs_fetch_does_not_wait_for_its_local_put(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """A prefetch fetches blocks and stores them locally before it ends; a lookup of the
    same blocks meanwhile takes the prefetch's answers as soon as they came (it does not
    send GETs of its own, nor wait for the prefetch's put, held here at the index
    writer)."""
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 3)
    holding, released = threading.Event(), threading.Event()

    def hold_the_writer(txn: Any) -> bool:
        holding.set()
        return released.wait(DEADLINE)

    async with open_store(tmp_path / "b", remote, memory_bytes=64 << 20) as b:
        tier = b.remote
        holder = parts(b).writer.submit(hold_the_writer)
        try:
            await until(holding.is_set)
            prefetch = b.prefetch(ks)
            await until(lambda: b.stats().backlog_bytes > 0)  # fetched; its put is held
            assert len(tier.fetching) == 3  # still registered: not stored yet
            assert await b.match_prefix(ks) == 3  # answered while the put is held
            assert not prefetch.done
            st = tier.stats()
            assert (st.joined, st.gets, st.hits) == (3, 3, 3)
        finally:
            released.set()
        assert holder.result() is True
        await prefetch.wait()  # its put landed, and with it the blocks in memory
        assert (mem := parts(b).memory) is not None and all(k in mem for k in ks)
        assert not tier.fetching and await b.contains_many(ks) == [True] * 3


async def test_a_get_that_its_promotion_overtakes_is_not_fetched_again(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """The get finds the blocks being promoted at its index lookup; the promotion lands
    while the get reads a local block; the get still serves the fetched copies (before
    this, it saw them neither local nor promoting and fetched them again)."""
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 3)
    local = keys(1, start=500)
    engine = GatedEngine(real_engine("threads", tmp_path / "probe"))
    holding, released = threading.Event(), threading.Event()

    def hold_the_writer(txn: Any) -> bool:
        holding.set()
        return released.wait(DEADLINE)

    async with kvstore.open(tmp_path / "b", namespace=NS, extent_bytes=SMALL_EXTENT,
                            staging_bytes=8 << 20, remote=remote, engine=engine) as b:
        assert b.remote is not None
        tier = b.remote
        await b.put_many(local, [value(100)])
        holder = parts(b).writer.submit(hold_the_writer)
        got: list[Any] = []
        try:
            await until(holding.is_set)  # no promotion can commit now
            first = await b.get_many(ks)
            assert all(same(g, value(i)) for i, g in enumerate(first))
            assert tier.stats().promoting_blocks == 3
            gate = engine.gate("read")

            async def get() -> None:
                got.extend(await b.get_many([*local, *ks]))

            async with anyio.create_task_group() as tg:
                tg.start_soon(get)
                await gate.entered.wait()  # looked up (3 promoting), reading ``local``
                released.set()
                await until(lambda: tier.stats().promoting_blocks == 0)  # landed
                assert await b.contains_many(ks) == [True] * 3
                gate.open()
        finally:
            released.set()
        assert holder.result() is True
        assert same(got[0], value(100))
        assert all(same(g, value(i)) for i, g in enumerate(got[1:]))
        st = tier.stats()
        assert (st.gets, st.hits) == (3, 3)
