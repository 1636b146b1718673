"""A background put of blocks already stored is deduplicated, never dropped, however
full the backlog (issue 31, item 9): the backlog check ran before the dedup decision and
reported a stored block as ``dropped=1``."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from tests.concurrency import DEADLINE, GatedEngine, real_engine
from tests.conformance import NS, keys, make_tensor

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (BLOCK,), i)


async def test_stored_blocks_are_deduplicated_not_dropped_under_a_full_backlog(
        tmp_path: Path) -> None:
    stored, new, other = keys(3)
    engine = GatedEngine(real_engine("threads", tmp_path / "probe"))
    async with kvstore.open(tmp_path / "s", namespace=NS, engine=engine, sync=False,
                            extent_bytes=4 << 20, backlog_bytes=BLOCK) as store:
        await store.put(stored, block(0))
        gate = engine.gate("write")
        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.put, other, block(2))
                await gate.entered.wait()  # the backlog is full (held)
                again = await store.put_many([stored], [block(0)], background=True)
                mixed = await store.put_many([stored, new], [block(0), block(1)],
                                             background=True)
                gate.open()
        assert again == kvstore.PutResult(0, 1, 0)
        assert mixed == kvstore.PutResult(0, 1, 0, dropped=1)  # only the new block dropped
        st = store.stats()
        assert (st.dropped_puts, st.dropped_blocks, st.dedup_blocks) == (1, 1, 2)
        assert await store.contains_many([stored, new, other]) == [True, False, True]
