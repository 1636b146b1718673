"""A delete is never undone by a promotion that started before it (issue 31, item 6): a
get (or lookup, or prefetch) fetching blocks from the remote tier, then a local delete
of them that returns, then the fetch lands.  Before, the promotion stored the blocks
locally after the delete had returned: they were back.  A real SeaweedFS cluster; the
GETs are held at a gate (no sleeps)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.concurrency import DEADLINE, until
from tests.remote.cluster import SeaweedCluster
from tests.remote.test_adapter import bucket_with, hold_gets
from tests.remote.test_tier import open_store

pytestmark = pytest.mark.anyio


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
        # a fetch that begins after the delete promotes as usual
        assert all(v is not None for v in await b.get_many(ks))
        with anyio.fail_after(DEADLINE):
            await until(lambda: b.remote.stats().promoting_blocks == 0)
        assert await b.contains_many(ks) == [True, True]
