"""A block whose read fails for any reason stops being a hit in the pass that found it.

A lookup (``contains_many``, ``match_prefix``) that keeps promising a block a load cannot
deliver makes an engine retry that load for ever (vLLM did: ~50,000 "Recovered from KV
load failure" lines in 150 s for one request).  So a short read (an extent truncated
while the store was closed), an I/O error, and a missing extent file each quarantine the
block, as a checksum failure does: answered as a miss, out of every lookup, counted,
reported by fsck, and still out after a restart.  On io_uring, the thread pool and the
simulated engine.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.io.protocol import EngineWrapper, IOEngine, IoOp
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine
from kvstore.testing import parts
from kvstore.tools.fsck import check
from tests.concurrency import real_engine

ENGINES = ["io_uring", "threads", "simulated"]
BLOCK_FLOATS = 80 << 10  # 320 KiB blocks: three fill a 1 MiB extent, the fourth starts another
OPEN = dict(extent_bytes=1 << 20, staging_bytes=4 << 20)
CHAIN = [bytes([i + 1]) * 16 for i in range(4)]


def _value(i: int) -> torch.Tensor:
    return torch.full((BLOCK_FLOATS,), float(i), dtype=torch.float32)


class FailingReads(EngineWrapper):
    """A real engine whose reads at the given offsets (of the given files: ``fds``, None
    for any) fail with EIO."""

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner)
        self.bad: set[int] = set()  # slot offsets whose reads fail
        self.fds: set[int] | None = None

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        results = await self.inner.read(ops)
        return [OSError(errno.EIO, "Input/output error (injected)")
                if op.offset in self.bad and (self.fds is None or op.fd in self.fds) else r
                for op, r in zip(ops, results)]


def _engine(kind: str, path: Path) -> IOEngine:
    if kind == "simulated":
        return SimulatedEngine(SimulatedDisk(seed=1))
    return real_engine(kind, path)


async def _fill(path: Path, kind: str) -> list[kvstore.disk.format.IndexEntry]:
    """A chain of four blocks, the second and third in the second extent."""
    async with kvstore.open(path, engine=_engine(kind, path), **OPEN) as store:
        for i, key in enumerate(CHAIN):
            await store.put(key, _value(i), parent=CHAIN[i - 1] if i else None)
        entries = parts(store).index.get_entries(CHAIN)
    assert all(e is not None for e in entries)
    return [e for e in entries if e is not None]


async def _assert_quarantined(store: kvstore.Store, bad: int, caplog: pytest.LogCaptureFixture
                              ) -> None:
    """CHAIN[bad] fails to read: a miss now, out of every lookup at once, counted once."""
    with caplog.at_level(logging.WARNING, logger="kvstore.store"):
        got = await store.get_many(CHAIN)
    assert [g is not None for g in got] == [i != bad for i in range(len(CHAIN))]
    for i, g in enumerate(got):
        if g is not None:
            assert torch.equal(g, _value(i))
    stats = store.stats()
    assert stats.read_errors == 1 and stats.quarantined_blocks == 1
    assert stats.quarantined == 1 and stats.corrupt_blocks == 0
    warnings = [r for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(warnings) == 1 and store.path in warnings[0].getMessage()
    # The same pass took it out of the lookups: no second read is ever tried.
    assert await store.contains_many(CHAIN) == [i != bad for i in range(len(CHAIN))]
    assert await store.match_prefix(CHAIN) == bad
    assert (await store.get_many([CHAIN[bad]])) == [None]
    assert store.stats().read_errors == 1


async def _after_restart(path: Path, kind: str, bad: int, engine: FailingReads | None = None,
                         fsck_finds: str = "quarantined") -> None:
    """After a restart (the fault still there: ``engine``) the block is still out; put
    again, it is stored again.  fsck reads the quarantined slot again: ``fsck_finds``
    is what it makes of it (a slot that reads whole now is restorable)."""
    async with kvstore.open(path, engine=engine or _engine(kind, path), **OPEN) as store:
        if engine is not None:  # only the quarantined slot's file: not the re-put's
            (e,) = parts(store).index.quarantine_records.of([CHAIN[bad]]).values()
            engine.fds = {parts(store).fds[e[0].extent]}
        assert await store.match_prefix(CHAIN) == bad
        assert store.stats().quarantined == 1
        # The recompute's put of the same key is stored again and reads back.
        await store.put(CHAIN[bad], _value(bad), parent=CHAIN[bad - 1] if bad else None)
        (got,) = await store.get_many([CHAIN[bad]])
        assert got is not None and torch.equal(got, _value(bad))
    report = check(str(path))
    assert fsck_finds in {f.kind for f in report.findings}


@pytest.mark.parametrize("kind", ENGINES)
def test_a_short_read_past_a_truncated_extent_quarantines_the_block(
        tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        entries = await _fill(tmp_path, kind)
        last = max(range(len(CHAIN)), key=lambda i: (entries[i].extent, entries[i].offset))
        e = entries[last]
        os.truncate(extent_path(str(tmp_path), e.extent), e.offset + e.slot_len // 2)
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **OPEN) as store:
            await _assert_quarantined(store, last, caplog)
        await _after_restart(tmp_path, kind, last)

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_an_io_error_quarantines_the_block(tmp_path: Path, kind: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        entries = await _fill(tmp_path, kind)
        bad = 1
        engine = FailingReads(_engine(kind, tmp_path))
        engine.bad.add(entries[bad].offset)
        async with kvstore.open(tmp_path, engine=engine, **OPEN) as store:
            await _assert_quarantined(store, bad, caplog)
        again = FailingReads(_engine(kind, tmp_path))  # the sector still fails
        again.bad.add(entries[bad].offset)
        await _after_restart(tmp_path, kind, bad, again, fsck_finds="restorable")

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_missing_extent_opens_and_quarantines_its_blocks_as_they_are_read(
        tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        entries = await _fill(tmp_path, kind)
        last = max(range(len(CHAIN)), key=lambda i: (entries[i].extent, entries[i].offset))
        lost = entries[last].extent
        in_lost = [i for i, e in enumerate(entries) if e.extent == lost]
        assert in_lost == [last], "the test wants one block in the last extent"
        os.unlink(extent_path(str(tmp_path), lost))
        with caplog.at_level(logging.WARNING, logger="kvstore.store"):
            async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **OPEN) as store:
                assert any("missing" in r.getMessage() for r in caplog.records)
                assert parts(store).lost_extents == {lost}
                caplog.clear()
                await _assert_quarantined(store, last, caplog)
                # New puts never land in the lost extent.
                for i in range(6):
                    key = bytes([0x80 + i]) * 16
                    await store.put(key, _value(10 + i))
                    (e,) = parts(store).index.get_entries([key])
                    assert e is not None and e.extent != lost
        report = check(str(tmp_path))
        assert any(f.kind == "missing-extent" for f in report.findings)

    anyio.run(scenario)
