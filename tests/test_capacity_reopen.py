"""Capacity is a bound at every instant, reopen included: a store opened with a smaller
``capacity_bytes`` than it uses evicts down to it before it serves (least-recently-used
chain tails first, never a pinned block or one a pinned block's chain needs), and a
store whose pinned blocks alone exceed the new capacity is refused, evicting nothing."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvstore
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, make_tensor

SLOT = 8192  # every block below is 6000 bytes: one 8 KiB slot


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (6000,), i)


def chain(c: int, n: int) -> list[bytes]:
    return NS.chain_keys(list(range(1000 * c, 1000 * c + 4 * n)))


def opener(path: Path, capacity: int | None, **options: Any) -> Any:
    return kvstore.open(path, namespace=NS, capacity_bytes=capacity, extent_bytes=256 << 10,
                        staging_bytes=1 << 20, engine="threads", **options)


async def fill(path: Path, chains: int, length: int, pin: int = 0) -> None:
    """``chains`` chains of ``length`` blocks, the first ``pin`` blocks of chain 0 pinned."""
    async with opener(path, None) as store:
        for c in range(chains):
            keys = chain(c, length)
            await store.put_many(keys, [block(100 * c + i) for i in range(length)],
                                 parents=kvstore.chain_parents(keys))
        if pin:
            await store.pin(chain(0, length)[:pin])


def test_reopening_with_a_smaller_capacity_evicts_before_serving(tmp_path: Path) -> None:
    anyio.run(fill, tmp_path, 6, 10)  # 60 blocks, 480 KiB

    async def reopen() -> tuple[int, kvstore.StoreStats, list[int]]:
        async with opener(tmp_path, 20 * SLOT) as store:
            used = store.used_bytes  # before any call: the open already fitted it
            lengths = [await store.match_prefix(chain(c, 10)) for c in range(6)]
            return used, store.stats(), lengths

    used, stats, lengths = anyio.run(reopen)
    assert used <= 20 * SLOT
    assert stats.evicted_blocks == 40 and stats.peak_used_bytes <= 20 * SLOT
    # Tails first: what is left of every chain is a prefix (no holes).
    stored = sum(1 for _ in _entries(tmp_path))
    assert sum(lengths) == stored == 20
    report = fsck.check(str(tmp_path))
    assert report.exit_code == 0 and report.chain_holes == 0, report.findings


def _entries(path: Path) -> list[bytes]:
    async def run() -> list[bytes]:
        async with opener(path, None) as store:
            return [k for k, _ in parts(store).index.iter_entries()]

    return anyio.run(run)


def test_pinned_blocks_over_the_new_capacity_refuse_the_open_and_evict_nothing(
        tmp_path: Path) -> None:
    anyio.run(fill, tmp_path, 3, 10, 8)  # 8 pinned blocks of chain 0: 64 KiB

    with pytest.raises(kvstore.CapacityError, match=r"capacity_bytes >= 65536"):
        anyio.run(_open_and_close, tmp_path, 5 * SLOT)
    assert len(_entries(tmp_path)) == 30  # nothing evicted

    async def fits_the_pins() -> tuple[int, int]:
        async with opener(tmp_path, 8 * SLOT) as store:
            return store.used_bytes, await store.match_prefix(chain(0, 10))

    used, prefix = anyio.run(fits_the_pins)
    assert used == 8 * SLOT and prefix == 8  # the pinned chain, nothing else


async def _open_and_close(path: Path, capacity: int) -> None:
    async with opener(path, capacity):
        pass


@given(st.lists(st.tuples(st.integers(4, 40), st.integers(0, 3), st.integers(1, 8),
                          st.booleans()), min_size=1, max_size=4))
def test_used_bytes_never_exceed_capacity_across_reopens(
        tmp_path_factory: pytest.TempPathFactory, lives: list[tuple[int, int, int, bool]]) -> None:
    """Each life: reopen with a capacity of ``slots`` slots, put ``chains`` chains of
    ``length`` blocks, maybe pin a chain's head; used <= capacity after the open and
    after every call (a pin over capacity is refused at the open, as the test expects)."""
    path = tmp_path_factory.mktemp("reopen")
    pinned = 0

    async def life(n: int, slots: int, chains: int, length: int, pin: bool) -> int:
        capacity = slots * SLOT
        async with opener(path, capacity) as store:
            assert store.used_bytes <= capacity
            for c in range(chains):
                keys = chain(10 * n + c, length)
                # CapacityError: the rest is pinned; the batch is refused whole, nothing lost
                with contextlib.suppress(kvstore.CapacityError):
                    await store.put_many(keys, [block(i) for i in range(length)],
                                         parents=kvstore.chain_parents(keys))
                assert store.used_bytes <= capacity
            if pin and chains:
                keys = chain(10 * n, length)[:2]
                await store.pin(keys)
                return len(parts(store).index.pinned(keys)) if all(
                    await store.contains_many(keys)) else 0
            return 0

    for n, (slots, chains, length, pin) in enumerate(lives):
        try:
            pinned += anyio.run(life, n, slots, chains, length, pin)
        except kvstore.CapacityError:
            # Refused only when what cannot be evicted (pinned chains) exceeds the capacity.
            assert pinned * SLOT > slots * SLOT
    report = fsck.check(str(path))
    assert not report.damage, report.findings


def test_capacity_is_recorded_and_applies_to_an_open_that_gives_none(tmp_path: Path) -> None:
    """capacity_bytes is the store's (issue 43: every process sharing it applies one): an
    open that gives it records it, the last one wins, an open without it takes it."""
    def capacity(**given: Any) -> int:
        with kvstore.open_blocking(tmp_path, extent_bytes=1 << 20, engine="threads",
                                   **given) as store:
            return store.stats().capacity_bytes

    default = capacity()  # never given: the default rule, not recorded
    assert default > 64 << 20
    assert capacity(capacity_bytes=8 << 20) == 8 << 20
    assert capacity() == 8 << 20
    assert capacity(capacity_bytes=16 << 20) == 16 << 20
    assert capacity() == 16 << 20
