"""The subscriber example of docs/events.md runs as printed: its view of a store follows
puts, deletes and evictions, resynchronises after a gap, and ends when the store closes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvstore
from kvstore.testing import parts
from tests.concurrency import DEADLINE, until
from tests.conformance import NS
from tests.core.test_events import SLOT, chain, opened, put_chain, value

PAGE = Path(__file__).resolve().parent.parent / "docs" / "events.md"


def example(heading: str, name: str) -> Any:
    """The first code block after ``heading`` in docs/events.md, run; its ``name``."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace[name]


def stored(store: Any) -> dict[bytes, bytes | None]:
    return {k: e.parent for k, e in parts(store).index.iter_entries()}


@pytest.mark.anyio
async def test_the_example_follows_the_store_through_a_gap_until_it_closes(
        tmp_path: Path) -> None:
    view = example("## A subscriber", "NodeView")()
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


def test_the_synchronous_example_follows_a_blocking_store(tmp_path: Path) -> None:
    polled_view = example("### From synchronous code", "PolledView")
    with kvstore.open_blocking(tmp_path / "store", namespace=NS, extent_bytes=1 << 20,
                               staging_bytes=1 << 20, capacity_bytes=6 * SLOT) as blocking:
        ks = chain(3)
        blocking.put_many(ks[:2], [value(0), value(1)], parents=[None, ks[0]])
        view = polled_view(blocking)
        assert view.blocks == {ks[0]: None, ks[1]: ks[0]}
        blocking.put_many(ks[2:], [value(2)], parents=[ks[1]])
        blocking.delete_many(ks[:1])
        view.poll()
        assert view.blocks == stored(blocking) and not view.stale
        assert ks[2] in view.blocks and ks[0] not in view.blocks
        view.close()
        assert blocking.stats().event_subscribers == 0

