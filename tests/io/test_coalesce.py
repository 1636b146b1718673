"""kvstore.io.coalesce: which ops merge, and how merged results map back per op."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.disk.format import PAGE
from kvstore.io.arena import Arena
from kvstore.io.coalesce import coalesce, spread
from kvstore.io.protocol import IoOp


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(64 * PAGE)
    yield a
    a.close()


def test_adjacent_in_file_and_arena_merge_into_one_view(arena: Arena) -> None:
    runs = [arena.try_acquire(2 * PAGE) for _ in range(3)]
    assert all(r is not None for r in runs)
    for i, r in enumerate(runs):
        assert r is not None
        r.array[:] = i + 1
    ops = [IoOp(7, 10 * PAGE + i * 2 * PAGE, r) for i, r in enumerate(runs) if r is not None]
    (m,) = coalesce(ops)
    assert (m.fd, m.offset, m.length, m.ops) == (7, 10 * PAGE, 6 * PAGE, ops)
    assert bytes(m.view) == bytes([1]) * 2 * PAGE + bytes([2]) * 2 * PAGE + bytes([3]) * 2 * PAGE


def test_gaps_other_files_other_arena_order_and_size_cap_split(arena: Arena) -> None:
    a, b, c, d = (arena.try_acquire(PAGE) for _ in range(4))
    assert a and b and c and d
    # file gap between a and b; b->c in another file; d before c in the arena
    ops = [IoOp(1, 0, a), IoOp(1, 2 * PAGE, b), IoOp(2, 3 * PAGE, c), IoOp(2, 4 * PAGE, d)]
    assert [len(m.ops) for m in coalesce(ops)] == [1, 1, 2]
    swapped = [IoOp(1, 0, b), IoOp(1, PAGE, a)]  # adjacent in the file, not in the arena
    assert [len(m.ops) for m in coalesce(swapped)] == [1, 1]
    chain = [IoOp(1, i * PAGE, r) for i, r in enumerate((a, b, c, d))]
    assert [len(m.ops) for m in coalesce(chain, max_bytes=2 * PAGE)] == [2, 2]
    assert coalesce([]) == []


def test_spread_reports_errors_to_every_op_and_short_reads_at_the_end(arena: Arena) -> None:
    runs = [arena.try_acquire(PAGE) for _ in range(3)]
    ops = [IoOp(1, i * PAGE, r) for i, r in enumerate(runs) if r is not None]
    merged = coalesce(ops)
    assert spread(merged, [3 * PAGE]) == [PAGE, PAGE, PAGE]
    assert spread(merged, [PAGE + 100]) == [PAGE, 100, 0]
    err = OSError(5, "EIO")
    assert spread(merged, [err]) == [err, err, err]
