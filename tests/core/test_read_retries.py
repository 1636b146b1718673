"""One read error is one block's problem, and a transient one is nobody's.

Eight adjacent 64 KiB blocks are read by one merged request (threads: one ``preadv``;
io_uring: one SQE).  When that request failed once with EIO, every block in it was a miss
and quarantined for good (a second get, a reopen: 8 misses; fsck --repair zeroed them).
Now a failed read is split and retried alone: a transient error costs a retry, a
persistent one costs its own block only.  On io_uring, the thread pool and the simulated
engine (its fault queue for the transient error: it merges nothing, so there one op
fails, and is retried).  Also: ``quarantined_blocks`` counts blocks, not failed reads.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import IndexEntry
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine
from kvstore.testing import parts
from tests.read_faults import ENGINES, ReadFaults, _FailingOps, faulty_engine, open_faulty

FLOATS = 16 << 10  # 64 KiB blocks: 68 KiB slots
KEYS = [bytes([0x40 + i]) * 16 for i in range(8)]
OPEN = dict(extent_bytes=4 << 20, staging_bytes=8 << 20)
BAD = 3  # the block whose sector fails


def _value(i: int) -> torch.Tensor:
    return torch.arange(FLOATS, dtype=torch.float32) + 1000 * i


async def _fill(store: kvstore.Store) -> list[IndexEntry]:
    """One batch: the eight slots land back to back in one extent."""
    await store.put_many(KEYS, [_value(i) for i in range(8)],
                         parents=kvstore.chain_parents(KEYS))
    entries = [e for e in parts(store).index.get_entries(KEYS) if e is not None]
    assert len({e.extent for e in entries}) == 1
    assert [e.offset for e in entries] == [entries[0].offset + i * entries[0].slot_len
                                           for i in range(8)]
    return entries


def _hits(got: list[torch.Tensor | None]) -> list[bool]:
    for i, g in enumerate(got):
        assert g is None or torch.equal(g, _value(i))
    return [g is not None for g in got]


@pytest.mark.parametrize("kind", ENGINES)
def test_a_transient_eio_in_a_merged_read_loses_nothing(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        faults = ReadFaults()
        engine = faulty_engine(kind, tmp_path, faults, monkeypatch)
        async with kvstore.open(tmp_path, engine=engine, **OPEN) as store:
            entries = await _fill(store)
            if kind == "simulated":  # its own fault hook: the next read op fails, once
                assert isinstance(engine, _FailingOps)
                assert isinstance(engine.inner, SimulatedEngine)
                engine.inner.disk.faults.append(("read", errno.EIO))
            else:
                faults.aim(store.path, entries[BAD], times=1)
            assert _hits(await store.get_many(KEYS)) == [True] * 8  # the same get
            stats = store.stats()
            if kind != "simulated":  # the fault hit the merged request: all 8 in it
                assert faults.failed == [8 * entries[0].slot_len]
                assert stats.read_retries == 8
            else:
                assert not engine.inner.disk.faults and stats.read_retries == 1
            assert (stats.quarantined, stats.quarantined_blocks, stats.read_errors) == (0, 0, 0)
            assert _hits(await store.get_many(KEYS)) == [True] * 8
        async with open_faulty(kind, tmp_path, ReadFaults(), monkeypatch, **OPEN) as store:
            assert await store.match_prefix(KEYS) == 8
            assert _hits(await store.get_many(KEYS)) == [True] * 8

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_persistent_eio_costs_its_own_block_only(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        faults = ReadFaults()
        async with open_faulty(kind, tmp_path, faults, monkeypatch, **OPEN) as store:
            entries = await _fill(store)
            faults.aim(store.path, entries[BAD])
            assert _hits(await store.get_many(KEYS)) == [i != BAD for i in range(8)]
            stats = store.stats()
            assert (stats.quarantined, stats.quarantined_blocks, stats.read_errors) == (1, 1, 1)
            assert await store.contains_many(KEYS) == [i != BAD for i in range(8)]
            (record,) = parts(store).index.quarantine_records.of(KEYS).items()
            assert record == (KEYS[BAD], (entries[BAD], True))  # recorded as unreadable
            assert _hits(await store.get_many(KEYS)) == [i != BAD for i in range(8)]
            assert store.stats().read_errors == 1  # not promised, not read again

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_quarantined_blocks_counts_each_block_once(tmp_path: Path, kind: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40: deleting an extent of 20 blocks counted 33; failed reads keep their own
    counter (``read_errors``, ``corrupt_blocks``)."""
    async def scenario() -> None:
        ks = [bytes([0x60 + i]) * 16 for i in range(20)]
        opened = dict(extent_bytes=2 << 20, staging_bytes=8 << 20)
        async with open_faulty(kind, tmp_path, ReadFaults(), monkeypatch, **opened) as store:
            await store.put_many(ks, [_value(i) for i in range(20)])
            entries = parts(store).index.get_entries(ks)
        (extent,) = {e.extent for e in entries if e is not None}
        os.unlink(extent_path(str(tmp_path), extent))
        async with open_faulty(kind, tmp_path, ReadFaults(), monkeypatch, **opened) as store:
            async with anyio.create_task_group() as tg:  # three loads of the same blocks
                for _ in range(3):
                    tg.start_soon(store.get_many, ks + ks)
            stats = store.stats()
            assert stats.quarantined_blocks == 20 == stats.quarantined
            assert stats.read_errors >= 40  # each get asked twice: every failed read

    anyio.run(scenario)


def test_a_read_only_store_counts_each_block_once(tmp_path: Path) -> None:
    """A store that failed closed cannot record a quarantine: the block stays indexed
    and fails on every get, still one block."""
    async def scenario() -> None:
        disk = SimulatedDisk(seed=5)
        faults = ReadFaults()
        engine = _FailingOps(SimulatedEngine(disk), faults)
        async with kvstore.open(tmp_path, engine=engine, **OPEN) as store:
            entries = await _fill(store)
            disk.faults.append(("datasync", errno.EIO))
            with pytest.raises(kvstore.StoreIOError):
                await store.put(b"\x99" * 16, _value(9))
            assert store.read_only
            faults.aim(store.path, entries[BAD])
            for _ in range(3):
                assert _hits(await store.get_many(KEYS)) == [i != BAD for i in range(8)]
            stats = store.stats()
            assert (stats.quarantined_blocks, stats.read_errors) == (1, 3)

    anyio.run(scenario)
