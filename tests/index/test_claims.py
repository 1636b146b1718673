"""The claim transaction (kvstore/index/claims.py): owners of one index take space from
the pool within one capacity; ``used`` never exceeds it after any sequence of claims,
returns and growth, and the counters stay the sums of their tables (issue 43)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.disk.format import PAGE
from kvstore.index.claims import claim_space, used_bytes
from kvstore.index.index import Index, IndexWriter, Txn, init_meta

EXTENT = 16 * PAGE
USABLE = EXTENT - PAGE


@contextmanager
def index_with(path: Path, extents: int) -> Iterator[tuple[Index, IndexWriter]]:
    index = Index(str(path), map_size=1 << 24, sync=False)
    writer = IndexWriter(index)

    def make(txn: Txn) -> None:
        init_meta(txn, index, store_uuid=bytes(16), extent_bytes=EXTENT)
        for _ in range(extents):
            index.add_extent(txn, index.reserve_extent_id(txn), EXTENT)

    try:
        writer.run_sync(make)
        yield index, writer
    finally:
        writer.close()
        index.close()


def claims(index: Index, owner: int) -> list[tuple[int, int, int]]:
    with index.begin() as txn:
        return index.space.claims_of(txn, owner)


def test_a_claim_takes_the_smallest_run_for_the_largest_slot_first(tmp_path: Path) -> None:
    with index_with(tmp_path, 2) as (index, writer):
        # extent 1: claimed but for 2 pages at its end; extent 2 whole
        writer.run_sync(lambda txn: index.space.claim(txn, index.free_map, 9, 1, PAGE,
                                                      USABLE - 2 * PAGE))
        got = writer.run_sync(lambda txn: claim_space(txn, index, 1, want=3 * PAGE,
                                                      largest=2 * PAGE, capacity=1 << 30))
        assert got.runs == [(1, EXTENT - 2 * PAGE, 2 * PAGE), (2, PAGE, PAGE)]
        assert not got.grow and got.short == 0
        assert claims(index, 1) == got.runs


def test_a_claim_beyond_the_capacity_claims_nothing_and_says_how_much_is_short(
        tmp_path: Path) -> None:
    with index_with(tmp_path, 1) as (index, writer):
        writer.run_sync(lambda txn: claim_space(txn, index, 1, want=4 * PAGE, largest=PAGE,
                                                capacity=6 * PAGE))
        got = writer.run_sync(lambda txn: claim_space(txn, index, 2, want=4 * PAGE,
                                                      largest=PAGE, capacity=6 * PAGE))
        assert got.runs == [] and got.short == 2 * PAGE and claims(index, 2) == []


def test_a_claim_the_pool_cannot_hold_asks_for_growth(tmp_path: Path) -> None:
    with index_with(tmp_path, 1) as (index, writer):
        got = writer.run_sync(lambda txn: claim_space(txn, index, 1, want=PAGE,
                                                      largest=USABLE + PAGE, capacity=1 << 30))
        assert got.grow and got.runs == []
        got = writer.run_sync(lambda txn: claim_space(txn, index, 1, want=USABLE + PAGE,
                                                      largest=PAGE, capacity=1 << 30))
        assert got.grow and got.runs == [(1, PAGE, USABLE)]  # what it held is claimed


def test_lost_extents_count_as_used_and_are_never_claimed(tmp_path: Path) -> None:
    with index_with(tmp_path, 2) as (index, writer):
        with index.begin() as txn:
            assert used_bytes(txn, index) == 0
            assert used_bytes(txn, index, lost=[2]) == USABLE
        got = writer.run_sync(lambda txn: claim_space(txn, index, 1, want=2 * USABLE,
                                                      largest=PAGE, capacity=1 << 30,
                                                      lost=[2]))
        assert got.runs == [(1, PAGE, USABLE)] and got.grow


OPS = st.lists(st.tuples(st.sampled_from(["claim", "return", "grow"]),
                         st.integers(1, 3), st.integers(1, 12), st.integers(1, 6)),
               max_size=25)


@settings(max_examples=40, deadline=None)
@given(ops=OPS, capacity_pages=st.integers(1, 60))
def test_used_never_exceeds_the_capacity_and_counters_stay_true(
        ops: list[tuple[str, int, int, int]], capacity_pages: int) -> None:
    capacity = capacity_pages * PAGE
    with tempfile.TemporaryDirectory() as tmp, index_with(Path(tmp), 1) as (index, writer):
        for op, owner, want, largest in ops:
            if op == "claim":
                got = writer.run_sync(partial(claim_space, index=index, owner=owner,
                                              want=want * PAGE, largest=largest * PAGE,
                                              capacity=capacity))
                assert not (got.runs and got.short)
            elif op == "return":
                writer.run_sync(partial(index.space.return_claims, pool=index.free_map,
                                        owner=owner))
            else:
                writer.run_sync(lambda txn: index.add_extent(
                    txn, index.reserve_extent_id(txn), EXTENT))
            with index.begin() as txn:
                have, actual = index.space.read(txn), index.space.actual(txn)
                used = used_bytes(txn, index)
                extents = txn.stat(index.extents)["entries"]
            assert have == actual
            # only claims take space here: used is exactly what is claimed, within capacity
            assert used == actual[b"claimed_bytes"] <= max(capacity, 0)
            assert actual[b"free_bytes"] + actual[b"claimed_bytes"] == extents * USABLE
