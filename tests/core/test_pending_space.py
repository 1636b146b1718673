"""Space a store unindexes (a delete, an eviction) is a ``pending`` row in the index
until no read of the owner that freed it can still copy it; that owner's next commit
moves it into its claims, before it takes any slot placed there; the last owner
to leave (its close, or the next open after it was killed) moves every pending run
back (kvstore/index/space_counters.py, kvstore/core/free_space.py; issue 43)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import kvstore
import kvstore.core.owners
from kvstore.disk.format import IndexEntry
from kvstore.index.index import Index
from kvstore.index.space_counters import CLAIMED, FREE, PENDING
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, keys, same
from tests.core.test_owners import killed_at

EXTENT = 1 << 20
VALUES = [torch.arange(1000 * (i + 1), dtype=torch.float32) for i in range(4)]

DELETER = textwrap.dedent("""
    import sys, torch, kvstore
    from tests.conformance import NS, keys
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                                  engine="threads")
    store.put_many(keys(4), [torch.arange(1000 * (i + 1), dtype=torch.float32)
                             for i in range(4)])
    store.delete_many(keys(4)[2:])
    print("deleted", flush=True)
    sys.stdin.readline()  # killed meanwhile
""")


def pending(index: Index) -> list[tuple[int, int, int]]:
    """(extent, offset, length) of every pending row."""
    with index.begin() as txn:
        return sorted((e, o, n) for _, e, o, n in index.space.pending_runs(txn))


def tiled(index: Index) -> bool:
    """Counters equal their tables, and free + claimed + pending + stored tile the
    extents."""
    with index.begin() as txn:
        have, want = index.space.read(txn), index.space.actual(txn)
    stored = sum(e.slot_len for _, e in index.iter_entries())
    usable = sum(size - 4096 for size in index.extents_list().values())
    return have == want and want[FREE] + want[CLAIMED] + want[PENDING] + stored == usable


def slot(entry: IndexEntry | None) -> tuple[int, int, int]:
    assert entry is not None
    return entry.extent, entry.offset, entry.slot_len


@pytest.mark.anyio
async def test_a_freed_slot_is_pending_until_no_read_can_copy_it(tmp_path: Path) -> None:
    ks = keys(3)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=EXTENT,
                            engine="threads") as store:
        p = parts(store)
        await store.put(ks[0], VALUES[0])
        first = slot(p.index.get_entries([ks[0]])[0])
        epoch = p.allocator.begin_read()  # a get that looked ks[0] up, still copying
        await store.delete(ks[0])
        assert pending(p.index) == [first] and tiled(p.index)
        assert first not in p.index.free_runs()
        await store.put(ks[1], VALUES[0])  # the read holds it: not reused, still pending
        assert slot(p.index.get_entries([ks[1]])[0]) != first
        assert pending(p.index) == [first] and tiled(p.index)
        p.allocator.end_read(epoch)
        await store.put(ks[2], VALUES[0])  # same size: best fit is the freed slot
        assert slot(p.index.get_entries([ks[2]])[0]) == first
        assert pending(p.index) == [] and tiled(p.index)
        got = await store.get(ks[2])
        assert got is not None and same(got, VALUES[0])
    assert fsck.check(str(tmp_path)).findings == []


def test_what_a_puts_eviction_freed_ripens_in_its_own_commit(tmp_path: Path) -> None:
    """No read in flight: the eviction's runs are ripe at once, and the put that
    evicted for room writes into them and moves them out of ``pending`` in its commit."""
    ks = keys(12)
    big = torch.ones(8000, dtype=torch.float32)  # 32 KiB: four fit the capacity
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=EXTENT,
                               engine="threads", capacity_bytes=4 * 36864) as store:
        p = parts(store)
        for k in ks:
            store.put_many([k], [big])
            assert pending(p.index) == [] and tiled(p.index)
        assert store.stats().evicted_blocks == len(ks) - 4
        assert store.contains_many(ks[-4:]) == [True] * 4


def test_the_last_close_ripens_every_pending_run(tmp_path: Path) -> None:
    with kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=EXTENT,
                               engine="threads") as store:
        store.put_many(keys(4), VALUES)
        store.delete_many(keys(4)[1:])
        index = parts(store).index
        assert len(pending(index)) == 3 and tiled(index)
    index = Index(str(tmp_path / "index"), map_size=1 << 30, sync=True)
    try:
        assert pending(index) == [] and tiled(index)
    finally:
        index.close()
    assert fsck.check(str(tmp_path)).findings == []


def test_a_killed_owners_pending_runs_ripen_at_the_next_open(tmp_path: Path) -> None:
    killed_at(DELETER, tmp_path, "deleted\n")
    index = Index(str(tmp_path / "index"), map_size=1 << 30, sync=True)
    try:
        assert len(pending(index)) == 2 and tiled(index)  # as the killed owner left them
    finally:
        index.close()
    report = fsck.check(str(tmp_path))  # pending runs are owned space, not leaks
    assert {f.kind for f in report.findings} == {"dead-owner"}
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads") as store:
        index = parts(store).index
        assert parts(store).owner.recovered == 1
        assert pending(index) == [] and tiled(index)
        assert all(same(g, v) for g, v in zip(store.get_many(keys(4)[:2]), VALUES))
        assert store.contains_many(keys(4)[2:]) == [False, False]
    assert fsck.check(str(tmp_path)).findings == []


def test_an_owner_closing_beside_another_ripens_what_it_freed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its reads have all ended when it closes: its own pending runs go back to the
    pool in its close, while the other owner stays (that one only reads here: the
    allocator does not claim yet)."""
    a = open_here(tmp_path)
    with a:
        a.put_many(keys(4), VALUES)
        b = open_here(tmp_path)
        a.delete_many(keys(4)[2:])
        index = parts(a).index
        assert len(pending(index)) == 2
    with b:
        assert pending(index) == [] and tiled(index)  # b keeps the environment open
        assert all(same(g, v) for g, v in zip(b.get_many(keys(4)[:2]), VALUES))
    assert fsck.check(str(tmp_path)).findings == []


def open_here(path: Path) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=EXTENT, engine="threads")
