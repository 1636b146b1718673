"""Backpressure (``put_many(background=True)``, ``open(backlog_bytes=...)``): a background
put that finds the backlog full is dropped whole and counted; one that fits goes; a
foreground put waits for the backlog to drain and is then stored."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from tests.concurrency import GatedEngine, real_engine
from tests.conformance import NS, keys, make_tensor, same

pytestmark = pytest.mark.anyio

BLOCK = 64 << 10


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (BLOCK,), i)


async def test_background_puts_drop_whole_and_foreground_puts_wait(tmp_path: Path) -> None:
    a, b1, b2, c, d1, d2 = keys(6)
    engine = GatedEngine(real_engine("threads", tmp_path / "probe"))
    async with kvstore.open(tmp_path / "s", namespace=NS, engine=engine, extent_bytes=4 << 20,
                            backlog_bytes=2 * BLOCK) as store:
        gate = engine.gate("write")
        results: dict[str, kvstore.PutResult] = {}

        async def put(name: str, ks: list[bytes], background: bool) -> None:
            results[name] = await store.put_many(
                ks, [block(i) for i in range(len(ks))], background=background)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(put, "a", [a], False)
                await gate.entered.wait()  # a's bytes are the backlog now (held)
                await put("b", [b1, b2], True)  # would exceed 2 blocks: dropped at once
                await put("c", [c], True)  # fits beside a: stored
                tg.start_soon(put, "d", [d1, d2], False)
                await anyio.wait_all_tasks_blocked()
                assert "d" not in results  # waits for the backlog, not dropped
                assert store.stats().backlog_bytes == BLOCK
                gate.open()
        st = store.stats()
        assert results["b"] == kvstore.PutResult(0, 0, 0, dropped=2)
        assert results["c"].written == 1 and results["d"].written == 2
        assert await store.contains_many([a, b1, b2, c, d1, d2]) == [
            True, False, False, True, True, True]
        assert st.dropped_puts == 1 and st.dropped_blocks == 2 and st.backlog_bytes == 0
        assert same(await store.get(d2), block(1))


async def test_a_bad_backlog_bound_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backlog_bytes must be > 0"):
        async with kvstore.open(tmp_path, namespace=NS, backlog_bytes=0):
            pass
