"""A delete is never undone by a promotion that started before it (issue 31, item 6): a
get (or lookup, or prefetch) fetching blocks from the remote tier, then a local delete
of them that returns, then the fetch lands.  Before, the promotion stored the blocks
locally after the delete had returned: they were back.  A real SeaweedFS cluster; the
GETs are held at a gate (no sleeps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import kvstore
from tests.concurrency import DEADLINE, GatedEngine, real_engine, until
from tests.conformance import NS, SMALL_EXTENT, keys, same
from tests.tiers.remote.cluster import SeaweedCluster
from tests.tiers.remote.test_adapter import Cancellable, bucket_with, hold_gets
from tests.tiers.remote.test_tier import open_store, value

pytestmark = pytest.mark.anyio


async def promoted_after_the_delete(b: Any, ks: list[bytes]) -> None:
    """A get that begins after the delete promotes the blocks as usual."""
    assert all(v is not None for v in await b.get_many(ks))
    with anyio.fail_after(DEADLINE):
        await until(lambda: b.remote.stats().promoting_blocks == 0)
    assert await b.contains_many(ks) == [True, True]


@pytest.mark.parametrize("call", ["get_many", "match_prefix", "prefetch"])
async def test_a_delete_during_a_promotions_fetch_is_not_undone(
        seaweed: SeaweedCluster, tmp_path: Path, call: str) -> None:
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 2)
    async with open_store(tmp_path / "b", remote, memory_bytes=4 << 20) as b:
        held = hold_gets(b)
        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                if call == "prefetch":
                    handle = b.prefetch(ks)
                else:
                    tg.start_soon(getattr(b, call), ks)
                await until(held.entered.is_set)  # the fetch has begun
                assert await b.delete_many(ks) == 0  # returned: nothing stored locally
                held.release.set()
                if call == "prefetch":
                    await handle
            await until(lambda: b.remote.stats().promoting_blocks == 0)
        assert await b.contains_many(ks) == [False, False]  # not brought back
        assert b.remote.stats().promoted_blocks == 0
        assert len(b._deletes) == 0  # every watch ended
        await promoted_after_the_delete(b, ks)


async def test_a_delete_right_after_prefetch_returned_is_not_undone(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """``prefetch(ks)`` returns at once; a delete of ks right after it, before the
    prefetch's background task has begun its fetch, returns (nothing is stored
    locally).  Before, the prefetch then fetched and promoted the blocks: back again."""
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 2)
    async with open_store(tmp_path / "b", remote, memory_bytes=4 << 20) as b:
        with anyio.fail_after(DEADLINE):
            handle = b.prefetch(ks)  # (no await between: its task has not run yet)
            assert await b.delete_many(ks) == 0
            await handle
            await until(lambda: b.remote.stats().promoting_blocks == 0)
        assert await b.contains_many(ks) == [False, False]
        assert b.remote.stats().promoted_blocks == 0
        assert len(b._deletes) == 0


async def test_a_delete_while_a_get_reads_its_local_blocks_is_not_undone(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """A get of a local block and two remote-only ones, held reading the local one; a
    delete of the remote ones returns meanwhile (nothing local).  The get still returns
    all three (fetched), but its promotion must not store the two: the delete came after
    the get began.  Before, the get's fetch registered its watch only after its local
    read, so the promotion stored them after the delete."""
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 2)
    local = keys(1, start=500)
    engine = GatedEngine(real_engine("threads", tmp_path / "probe"))
    async with kvstore.open(tmp_path / "b", namespace=NS, extent_bytes=SMALL_EXTENT,
                            staging_bytes=8 << 20, remote=remote, engine=engine) as b:
        await b.put_many(local, [value(100)])
        gate = engine.gate("read")
        got: list[Any] = []

        async def get() -> None:
            got.extend(await b.get_many([*local, *ks]))

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(get)
                await gate.entered.wait()  # looked up, reading ``local``
                assert await b.delete_many(ks) == 0
                gate.open()
            await until(lambda: b.remote.stats().promoting_blocks == 0)
        assert same(got[0], value(100))
        assert all(same(g, value(i)) for i, g in enumerate(got[1:]))
        assert await b.contains_many(ks) == [False, False]
        assert len(b._deletes) == 0
        await promoted_after_the_delete(b, ks)


async def test_a_lookup_that_fetches_after_its_fetcher_gave_up_skips_a_delete_made_meanwhile(
        seaweed: SeaweedCluster, tmp_path: Path) -> None:
    """Lookup A fetches (GETs held); lookup B joins A's fetch; the blocks are deleted
    (nothing local: 0); A is cancelled, so B fetches them itself and promotes them.  B
    started before the delete: its promotion must skip them.  Before, B's watch began
    only with its own fetch, after the delete, and the blocks came back."""
    remote, ks = await bucket_with(seaweed, tmp_path / "a", 2)
    async with open_store(tmp_path / "b", remote) as b:
        held = hold_gets(b)
        lookup_a = Cancellable(b.match_prefix, ks)
        found: list[int] = []

        async def lookup_b() -> None:
            found.append(await b.match_prefix(ks))

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lookup_a)
                await until(held.entered.is_set)  # A is in its requests
                tg.start_soon(lookup_b)
                await until(lambda: b.remote.stats().joined == 2)  # B waits for A
                assert await b.delete_many(ks) == 0
                await lookup_a.cancel()
                held.release.set()  # B's own GETs (and A's abandoned ones) answer
            await until(lambda: b.remote.stats().promoting_blocks == 0)
        assert found == [2]
        assert await b.contains_many(ks) == [False, False]
        assert len(b._deletes) == 0
