"""The in-memory free map, the durable LMDB free map, and read epochs agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.allocator import FreeSpace, ReadEpochs
from kvstore.errors import IndexCorruptionError
from kvstore.format import PAGE
from kvstore.index import Index, IndexWriter

ops = st.lists(st.tuples(st.booleans(), st.integers(1, 8)), min_size=1, max_size=60)


@given(ops)
def test_allocations_never_overlap_and_frees_coalesce(script: list[tuple[bool, int]]) -> None:
    space = FreeSpace()
    space.free(1, PAGE, 64 * PAGE)
    space.free(2, PAGE, 16 * PAGE)
    held: list[tuple[int, int, int]] = []
    for alloc, pages in script:
        if alloc or not held:
            where = space.allocate(pages * PAGE)
            if where is not None:
                held.append((*where, pages * PAGE))
        else:
            space.free(*held.pop(len(held) // 2))
        spans = sorted(held + space.runs())
        for (e1, o1, n1), (e2, o2, _) in zip(spans, spans[1:]):
            assert e1 != e2 or o1 + n1 <= o2, "a range is both free and allocated"
        assert space.free_bytes + sum(h[2] for h in held) == 80 * PAGE
    for h in held:
        space.free(*h)
    assert space.runs() == [(1, PAGE, 64 * PAGE), (2, PAGE, 16 * PAGE)]  # fully coalesced


def test_double_free_is_caught() -> None:
    space = FreeSpace()
    space.free(1, PAGE, PAGE)
    with pytest.raises(AssertionError, match="double free"):
        space.free(1, PAGE, PAGE)


@given(ops)
def test_durable_free_map_mirrors_memory(tmp_path_factory: pytest.TempPathFactory,
                                         script: list[tuple[bool, int]]) -> None:
    """take_range/give_range on LMDB produce exactly the in-memory runs."""
    index = Index(str(tmp_path_factory.mktemp("idx")), map_size=1 << 26, sync=False)
    writer = IndexWriter(index)
    try:
        space = FreeSpace()
        space.free(1, PAGE, 64 * PAGE)
        writer.run_sync(lambda txn: index.give_range(txn, 1, PAGE, 64 * PAGE))
        held: list[tuple[int, int, int]] = []
        for alloc, pages in script:
            if alloc or not held:
                where = space.allocate(pages * PAGE)
                if where is None:
                    continue
                rng = (*where, pages * PAGE)
                held.append(rng)
                writer.run_sync(lambda txn, r=rng: index.take_range(txn, *r))
            else:
                rng = held.pop(0)
                space.free(*rng)
                writer.run_sync(lambda txn, r=rng: index.give_range(txn, *r))
            assert index.free_runs() == space.runs()
    finally:
        writer.close()
        index.close()


def test_taking_space_that_is_not_free_is_index_corruption(tmp_path: Path) -> None:
    index = Index(str(tmp_path), map_size=1 << 24, sync=False)
    writer = IndexWriter(index)
    try:
        writer.run_sync(lambda txn: index.give_range(txn, 1, PAGE, 4 * PAGE))
        with pytest.raises(IndexCorruptionError, match="fsck"):
            writer.run_sync(lambda txn: index.take_range(txn, 1, 4 * PAGE, 2 * PAGE))
        with pytest.raises(IndexCorruptionError):
            writer.run_sync(lambda txn: index.give_range(txn, 1, 2 * PAGE, PAGE))
        assert index.free_runs() == [(1, PAGE, 4 * PAGE)]  # failed jobs changed nothing
    finally:
        writer.close()
        index.close()


def test_freed_space_waits_for_earlier_readers() -> None:
    space = FreeSpace()
    epochs = ReadEpochs(space)
    early = epochs.begin()
    epochs.free(1, PAGE, PAGE)          # a reader may still be transferring this slot
    late = epochs.begin()
    assert space.allocate(PAGE) is None and epochs.held_bytes == PAGE
    epochs.end(late)                    # a later reader cannot have seen the old block
    assert space.allocate(PAGE) is None
    epochs.end(early)
    assert epochs.held_bytes == 0
    assert space.allocate(PAGE) == (1, PAGE)
