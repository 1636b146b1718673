"""The snapshot (kvstore/core/snapshot.py): every stored block, in pages of short read
transactions; taken after a subscription, it and the subscription's events give the
store's exact content however puts, deletes and evictions interleave with its pages
(property-based); ``parents_first`` lists each block after its stored parent."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore import BlockEvent, Store, StoredBlock
from kvstore.core.events import fold
from kvstore.core.snapshot import parents_first
from kvstore.testing import parts
from tests.core.test_events import SLOT, chain, drain, opened, value

CHAINS = [chain(5, 100 * c) for c in range(5)]
_dirs = itertools.count()

# An operation: ("put", chain, length) stores the chain's first blocks (evicting leaves
# when the store is full); ("delete", chain, block) deletes one block (a hole, maybe).
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 4), st.integers(1, 5)),
    st.tuples(st.just("delete"), st.integers(0, 4), st.integers(0, 4))), max_size=12)


async def apply(store: Store, op: tuple[str, int, int]) -> None:
    what, c, n = op
    if what == "put":
        ks = CHAINS[c][:n]
        await store.put_many(ks, [value(100 * c + i) for i in range(n)],
                             parents=[None, *ks[:-1]])
    else:
        await store.delete_many([CHAINS[c][n]])


def stored(store: Store) -> dict[bytes, bytes | None]:
    """What the index holds, read without the snapshot's code."""
    return {k: e.parent for k, e in parts(store).index.iter_entries()}


def fresh(tmp_path: Path) -> Path:
    path = tmp_path / f"s{next(_dirs)}"
    path.mkdir()
    return path


@given(before=ops, during=st.lists(ops, max_size=8), after=ops,
       page=st.integers(1, 4))
def test_snapshot_and_events_fold_to_the_exact_content(
        tmp_path: Path, before: list[Any], during: list[list[Any]], after: list[Any],
        page: int) -> None:
    """Operations run between the snapshot's pages (``during[i]`` after page ``i``), so
    each page reads another state of the store."""
    async def scenario() -> None:
        async with opened(fresh(tmp_path), capacity_bytes=8 * SLOT) as store:
            for op in before:
                await apply(store, op)
            async with store.subscribe() as sub:
                view: dict[bytes, bytes | None] = {}
                keys: list[bytes] = []
                pages = store.snapshot(page_blocks=page)
                for i, _ in enumerate(iter(int, 1)):
                    try:
                        got = await pages.__anext__()
                    except StopAsyncIteration:
                        break
                    assert 1 <= len(got) <= page
                    keys += [b.key for b in got]
                    view.update((b.key, b.parent) for b in got)
                    for op in during[i] if i < len(during) else ():
                        await apply(store, op)
                assert keys == sorted(set(keys))  # key order, each block once
                for op in after:
                    await apply(store, op)
                for item in drain(sub):
                    assert isinstance(item, BlockEvent)  # the buffer never overflowed
                    fold(view, item)
                assert view == stored(store)

    anyio.run(scenario)


@given(before=ops, racing=ops, page=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_parents_first_with_puts_and_evictions_racing_the_pages(
        tmp_path: Path, before: list[Any], racing: list[Any], page: int, seed: int) -> None:
    """A task changes the store while the snapshot reads its pages on a worker thread."""
    async def scenario() -> None:
        async with opened(fresh(tmp_path), capacity_bytes=8 * SLOT) as store:
            for op in before:
                await apply(store, op)
            async with store.subscribe() as sub:
                blocks: list[StoredBlock] = []

                async def changer() -> None:
                    rng = random.Random(seed)
                    for op in racing:
                        for _ in range(rng.randrange(3)):
                            await anyio.sleep(0)
                        await apply(store, op)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(changer)
                    async for got in store.snapshot(page_blocks=page, order="parents_first"):
                        assert 1 <= len(got) <= page
                        blocks += got
                where = {b.key: i for i, b in enumerate(blocks)}
                assert len(where) == len(blocks)
                assert all(where[b.parent] < i for i, b in enumerate(blocks)
                           if b.parent in where)
                view = {b.key: b.parent for b in blocks}
                for item in drain(sub):
                    assert isinstance(item, BlockEvent)
                    fold(view, item)
                assert view == stored(store)

    anyio.run(scenario)


@given(st.data())
def test_parents_first_orders_any_forest_and_loses_nothing(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 30))
    keys = [i.to_bytes(16, "big") for i in range(n)]
    # a parent drawn among earlier keys, or outside the set (not stored), or none
    parents = [data.draw(st.sampled_from([None, b"\xff" * 16, *keys[:i]])) for i in range(n)]
    blocks = [StoredBlock(k, p) for k, p in zip(keys, parents)]
    shuffled = data.draw(st.permutations(blocks))
    out = parents_first(list(shuffled))
    assert sorted(out, key=lambda b: b.key) == blocks
    where = {b.key: i for i, b in enumerate(out)}
    assert all(where[b.parent] < i for i, b in enumerate(out) if b.parent in where)


def test_parents_first_keeps_a_cycle_it_cannot_order() -> None:
    a, b = b"\x01" * 16, b"\x02" * 16
    out = parents_first([StoredBlock(a, b), StoredBlock(b, a), StoredBlock(b"\x03" * 16, None)])
    assert out[0].key == b"\x03" * 16  # what can be ordered first, then the rest
    assert sorted(x.key for x in out) == [a, b, b"\x03" * 16]


@pytest.mark.anyio
async def test_an_empty_store_has_no_page_and_a_full_one_every_block(tmp_path: Path) -> None:
    async with opened(tmp_path) as store:
        assert [p async for p in store.snapshot()] == []
        ks = chain(10)
        await store.put_many(ks, [value(i) for i in range(10)], parents=[None, *ks[:-1]])
        pages = [p async for p in store.snapshot(page_blocks=4)]
        assert [len(p) for p in pages] == [4, 4, 2]
        assert {b.key: b.parent for p in pages for b in p} == stored(store)
        pages = [p async for p in store.snapshot(page_blocks=3, order="parents_first")]
        assert [len(p) for p in pages] == [3, 3, 3, 1]
        assert [b.key for p in pages for b in p] == ks  # the chain, from its start
