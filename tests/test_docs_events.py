"""The subscriber example of docs/events.md runs as printed: its view of a store follows
puts, deletes and evictions, resynchronises after a gap, and ends when the store closes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvstore.testing import parts
from tests.concurrency import DEADLINE, until
from tests.core.test_events import SLOT, chain, opened, put_chain

PAGE = Path(__file__).resolve().parent.parent / "docs" / "events.md"


def example() -> Any:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## A subscriber"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace["NodeView"]


def stored(store: Any) -> dict[bytes, bytes | None]:
    return {k: e.parent for k, e in parts(store).index.iter_entries()}


@pytest.mark.anyio
async def test_the_example_follows_the_store_through_a_gap_until_it_closes(
        tmp_path: Path) -> None:
    view = example()()
    with anyio.fail_after(DEADLINE):  # a view that never catches up fails, not hangs
        await follow_through_a_gap(view, tmp_path)


async def follow_through_a_gap(view: Any, tmp_path: Path) -> None:
    async with opened(tmp_path, capacity_bytes=6 * SLOT) as store:
        await put_chain(store, chain(2))  # before the view starts: from the snapshot
        async with anyio.create_task_group() as tg:
            tg.start_soon(view.follow, store, 3)
            await until(lambda: view.blocks == stored(store))
            assert len(view.blocks) == 2
            await put_chain(store, chain(3, 10))
            await store.delete_many([chain(3, 10)[2]])
            await until(lambda: view.blocks == stored(store))
            assert view.resyncs == 0
            await put_chain(store, chain(5, 20))  # 5 stored + evictions: past 3, a gap
            await until(lambda: view.resyncs == 1 and view.blocks == stored(store))
            assert chain(5, 20)[4] in view.blocks
            await store.aclose()  # the view's loop ends: the task group exits
