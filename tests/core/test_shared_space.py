"""Several owners on one path allocate only inside their own claims (issue 43,
kvstore/core/claiming.py): one capacity for all of them, evictions by any owner in
LMDB's LRU order, no two owners ever placing slots in overlapping ranges, and a killed
claimer's claims back in the pool; a child whose parent another owner removed while
its put was writing is not indexed.  Two Stores of one process are two owners (the
interim guard turned off here); the killed claimer is a real process."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore
import kvstore.core.owners
from kvstore.index.claims import used_bytes
from kvstore.index.index import Index
from kvstore.index.space_counters import CLAIMED
from kvstore.io.slots import PutItem
from kvstore.testing import parts
from kvstore.tools import fsck
from kvstore.tools.fsck import _Checker
from kvstore.tools.fsck_report import Report
from tests.conformance import NS, keys, same
from tests.core.test_owners import killed_at

EXTENT = 64 << 10
BLOCK = 2048  # floats: a 12 KiB slot (8 KiB of payload and the header, page-rounded)


def open_here(path: Path, capacity: int | None = None) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=EXTENT, engine="threads",
                                 capacity_bytes=capacity)


@contextmanager
def owners(path: Path, n: int, capacity: int, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[list[kvstore.BlockingStore]]:
    with ExitStack() as stack:
        yield [stack.enter_context(open_here(path, capacity)) for _ in range(n)]


def value(i: int) -> torch.Tensor:
    return torch.full((BLOCK,), float(i))


def store_used(index: Index) -> int:
    """The store's used bytes as every owner's capacity check sees them: the counters,
    read in one read transaction."""
    with index.begin() as txn:
        return used_bytes(txn, index)


def allocation_findings(index: Index, path: Path) -> list[str]:
    """fsck's allocation step (kvstore/tools/fsck.py step 3, with the claims and pending
    runs of kvstore/tools/fsck_space.py) over the live index: entries, free runs,
    claims and pending runs must tile every extent, none owned twice."""
    checker = _Checker(str(path), index, None, None, Report(path=str(path), deep=False, repair=False),  # type: ignore[arg-type]
                       repair=False, deep=False, progress=None)
    checker.check_allocation(index.extents_list(), checker.load_entries())
    return [f"{f.kind}: {f.detail}" for f in checker.report.findings]


def test_two_owners_share_one_capacity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    """Puts of two owners in turn, far past the capacity: used <= capacity after every
    put (as the counters say, in a read transaction), both owners evict, and what each
    reports stays within it too."""
    capacity = 10 * 12288
    ks = keys(40)
    with owners(tmp_path, 2, capacity, monkeypatch) as (a, b):
        index = parts(a).index
        for i, key in enumerate(ks):
            (a if i % 2 else b).put_many([key], [value(i)])
            assert store_used(index) <= capacity
            assert a.used_bytes <= capacity and b.used_bytes <= capacity
        assert parts(a).counters["evicted_blocks"] > 0
        assert parts(b).counters["evicted_blocks"] > 0
        stored = [k for k, hit in zip(ks, a.contains_many(ks)) if hit]
        assert len(stored) * 12288 <= capacity
        assert stored == ks[-len(stored):]  # the least recently put went first
        assert allocation_findings(index, tmp_path) == []
    assert fsck.check(str(tmp_path)).findings == []


def test_one_owners_puts_evict_the_others_blocks_in_lru_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fills the capacity; B's puts evict A's least recently used blocks (LMDB's
    order, which every owner sees), never B's own newer ones, and A sees them gone."""
    ks = keys(12)
    with owners(tmp_path, 2, 8 * 12288, monkeypatch) as (a, b):
        for i in range(8):
            a.put_many([ks[i]], [value(i)])
        for i in range(8, 12):
            b.put_many([ks[i]], [value(i)])
        assert parts(b).counters["evicted_blocks"] == 4
        assert parts(a).counters["evicted_blocks"] == 0
        assert a.contains_many(ks) == [False] * 4 + [True] * 8
        got = a.get_many(ks[4:])
        assert all(same(g, value(i)) for i, g in zip(range(4, 12), got))
        assert allocation_findings(parts(a).index, tmp_path) == []


@settings(max_examples=12, deadline=None)
@given(n_owners=st.integers(2, 3),
       ops=st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 15),
                              st.integers(1, 3)), min_size=4, max_size=30))
def test_owners_never_place_slots_in_overlapping_ranges(
        tmp_path_factory: pytest.TempPathFactory, n_owners: int,
        ops: list[tuple[int, bool, int, int]]) -> None:
    """Interleaved puts (batches of 1-3 chained blocks of several sizes) and deletes of
    2-3 owners under a small capacity, opened on a store whose pool holds free runs: after every operation the entries, free runs,
    claims and pending runs tile the extents (fsck's allocation check) and used <=
    capacity; at the end fsck finds nothing, and every block still indexed reads back."""
    path = tmp_path_factory.mktemp("owners")
    capacity = 24 * 4096
    ks = keys(16)
    with open_here(path, capacity) as first:  # the pool holds free runs when they open
        first.put_many(ks[:4], [torch.ones(512 * (i + 1)) for i in range(4)])
        first.delete_many(ks[:4])
    with pytest.MonkeyPatch.context() as mp, owners(path, n_owners, capacity, mp) as stores:
        index = parts(stores[0]).index
        for who, put, at, n in ops:
            store = stores[who % n_owners]
            batch = ks[at:at + n]
            if put:
                store.put_many(batch, [torch.full((512 * (1 + (at + j) % 4),), float(at + j))
                                       for j in range(len(batch))],
                               parents=kvstore.chain_parents(batch, ks[at - 1] if at else None))
            else:
                store.delete_many(batch)
            assert allocation_findings(index, path) == []
            assert store_used(index) <= capacity
        for i, got in enumerate(stores[0].get_many(ks)):
            assert got is None or same(got, torch.full((512 * (1 + i % 4),), float(i)))
    assert fsck.check(str(path)).findings == []


CLAIMER = textwrap.dedent("""
    import sys, torch, kvstore
    from tests.conformance import NS, keys
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=64 << 10,
                                  engine="threads")
    store.put_many(keys(2), [torch.ones(1000), torch.zeros(1000)])
    print("claimed", flush=True)
    sys.stdin.readline()  # killed meanwhile
""")


def test_a_killed_claimers_claims_come_back(tmp_path: Path) -> None:
    """A process whose puts claimed space is SIGKILLed: the next open recovers it, its
    claims go back to the pool (the counters and the tables agree), its committed
    blocks stay."""
    killed_at(CLAIMER, tmp_path, "claimed\n")
    index = Index(str(tmp_path / "index"), map_size=1 << 30, sync=True)
    try:  # as the killed owner left it: holding claims
        with index.begin() as txn:
            assert index.space.read(txn)[CLAIMED] > 0
    finally:
        index.close()
    with open_here(tmp_path) as store:
        index = parts(store).index
        assert parts(store).owner.recovered == 1
        with index.begin() as txn:
            assert index.space.read(txn)[CLAIMED] == 0 == index.space.actual(txn)[CLAIMED]
        assert all(same(g, v) for g, v in
                   zip(store.get_many(keys(2)), [torch.ones(1000), torch.zeros(1000)]))
    assert fsck.check(str(tmp_path)).findings == []


@pytest.mark.anyio
async def test_a_child_whose_parent_another_owner_removed_meanwhile_is_not_indexed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B's put of a chain under A's block decided while the parent was stored; A removes
    the parent while B's put writes (B's own protections do not reach A): B's commit
    indexes neither child (no chain hole), gives their slots back to its claims and
    counts them evicted at once (``evicted_at_commit``, DESIGN 8.2 step 2)."""
    ks = keys(3)
    held, go = anyio.Event(), anyio.Event()
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=EXTENT,
                            engine="threads") as a, \
            kvstore.open(tmp_path, namespace=NS, extent_bytes=EXTENT, engine="threads") as b:
        await a.put(ks[0], value(0))
        write = parts(b).transfers.write

        async def held_write(items: list[PutItem]) -> None:
            held.set()
            await go.wait()
            await write(items)

        monkeypatch.setattr(parts(b).transfers, "write", held_write)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(b.put_many, ks[1:], [value(1), value(2)],
                                  parents=kvstore.chain_parents(ks[1:], ks[0])))
            await held.wait()  # B decided: the parent is stored
            assert await a.delete(ks[0])
            go.set()
        assert await b.contains_many(ks) == [False] * 3
        stats = b.stats()
        assert stats.evicted_at_commit == 2 and stats.evicted_blocks == 2
        assert allocation_findings(parts(b).index, tmp_path) == []
    assert fsck.check(str(tmp_path)).findings == []


def test_the_quantum_is_a_share_of_the_capacity_per_owner(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Alone, an owner's quantum is at most a quarter of the capacity; beside three
    others, a sixteenth: the owners counted in its last claim transaction (so four idle
    owners hold at most half the capacity between them, two quanta each)."""
    capacity = 64 * 4096
    with owners(tmp_path, 1, capacity, monkeypatch) as (a,):
        a.put_many(keys(1), [value(0)])
        assert parts(a).allocator.claims.quantum() == capacity // 4
        with owners(tmp_path, 3, capacity, monkeypatch):
            # 15 pages: more than its claims hold (13 of 16 left): it claims again
            a.put_many(keys(6)[1:], [value(i) for i in range(1, 6)])
            claims = parts(a).allocator.claims
            assert claims.owners == 4
            assert claims.quantum() == capacity // 16
    assert fsck.check(str(tmp_path)).findings == []
