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


async def _lost_extent_with_a_displaced_copy(path: Path, kind: str) -> int:
    """CHAIN[:2] in one extent, CHAIN[1] quarantined there once (a short read past a
    truncation) and put again (the recompute), then the extent file deleted: its record
    and its current copy both in the lost extent, as an engine's store has them after
    a truncation and a deleted file."""
    opts = dict(OPEN, extent_bytes=4 << 20)  # one extent holds every copy
    async with kvstore.open(path, engine=_engine(kind, path), **opts) as store:
        await store.put_many(CHAIN[:2], [_value(0), _value(1)], parents=[None, CHAIN[0]])
        (e,) = {x.extent for x in parts(store).index.get_entries(CHAIN[:2]) if x is not None}
        second = parts(store).index.get_entries([CHAIN[1]])[0]
    assert second is not None
    os.truncate(extent_path(str(path), e), second.offset + second.slot_len // 2)
    async with kvstore.open(path, engine=_engine(kind, path), **opts) as store:
        assert (await store.get_many([CHAIN[1]])) == [None]
        await store.put(CHAIN[1], _value(1), parent=CHAIN[0])
        again = parts(store).index.get_entries([CHAIN[1]])[0]
        assert again is not None and again.extent == e
    os.unlink(extent_path(str(path), e))
    return e



@pytest.mark.parametrize("kind", ENGINES)
def test_a_quarantined_copy_freed_in_a_missing_extent_never_makes_a_put_open_it(
        tmp_path: Path, kind: str) -> None:
    """What an engine does after the file was deleted: its load quarantines the blocks
    (the older record of CHAIN[1], re-read, fails too and is freed: its slot is in the
    lost extent), it recomputes them and saves them again.  That space is never handed
    out, so every save stores its blocks (elsewhere) instead of failing to open the
    missing file, and after a restart they are hits."""
    async def scenario() -> None:
        lost = await _lost_extent_with_a_displaced_copy(tmp_path, kind)
        opts = dict(OPEN, extent_bytes=4 << 20)
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **opts) as store:
            assert parts(store).lost_extents == {lost}
            assert (await store.get_many(CHAIN[:2])) == [None, None]
            for i in range(len(CHAIN)):  # one save per step, as the connector's
                assert await store.put(CHAIN[i], _value(i), parent=CHAIN[i - 1] if i else None)
            entries = parts(store).index.get_entries(CHAIN)
            assert all(e is not None and e.extent != lost for e in entries)
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **opts) as store:
            assert await store.match_prefix(CHAIN) == len(CHAIN)
            got = await store.get_many(CHAIN)
            assert all(g is not None and torch.equal(g, _value(i)) for i, g in enumerate(got))
        # The lost extent is all fsck finds: the freed space is accounted for.
        assert {f.kind for f in check(str(tmp_path)).findings} == {"missing-extent"}

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_block_deleted_in_a_missing_extent_never_makes_a_put_open_it(
        tmp_path: Path, kind: str) -> None:
    async def scenario() -> None:
        entries = await _fill(tmp_path, kind)
        last = max(range(len(CHAIN)), key=lambda i: (entries[i].extent, entries[i].offset))
        lost = entries[last].extent
        os.unlink(extent_path(str(tmp_path), lost))
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **OPEN) as store:
            assert await store.delete_many([CHAIN[last]]) == 1  # its slot is freed
            keys = [bytes([0x80 + i]) * 16 for i in range(4)]
            result = await store.put_many(keys, [_value(10 + i) for i in range(4)])
            assert result.written == len(keys)
            got = await store.get_many(keys)
            assert all(g is not None and torch.equal(g, _value(10 + i))
                       for i, g in enumerate(got))
        assert {f.kind for f in check(str(tmp_path)).findings} == {"missing-extent"}

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_an_extent_deleted_while_the_store_is_open_fails_one_put_with_a_typed_error(
        tmp_path: Path, kind: str) -> None:
    """Another owner of the store added the extent and closed (its claims back in the
    pool), then the file was deleted while this owner stays open: the first put placed
    in it fails with StoreIOError (ENOENT), stores nothing, and the extent is lost from
    then on as if it had been missing at open: the retry and every later put (claiming
    the rest of the pool, which the extent's free space was part of) store their
    blocks elsewhere, and read back."""
    opts = dict(OPEN, extent_bytes=32 << 20)  # more than one claim (16 MiB): the pool keeps some

    async def scenario() -> None:
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **opts) as store:
            async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **opts) as other:
                await other.put(CHAIN[0], _value(0))
                (e,) = parts(other).index.get_entries([CHAIN[0]])
            assert e is not None
            os.unlink(extent_path(str(tmp_path), e.extent))
            with pytest.raises(kvstore.errors.StoreIOError) as failed:
                await store.put(CHAIN[1], _value(1))
            assert failed.value.errno == errno.ENOENT
            assert extent_path(str(tmp_path), e.extent) in str(failed.value)
            assert await store.contains_many([CHAIN[1]]) == [False]
            keys = [bytes([0x80 + i]) * 16 for i in range(60)]  # ~19 MiB: another claim
            for i, key in enumerate(keys):
                assert await store.put(key, _value(10 + i))
            entries = parts(store).index.get_entries(keys)
            assert all(x is not None and x.extent != e.extent for x in entries)
            got = await store.get_many(keys)
            assert all(g is not None and torch.equal(g, _value(10 + i))
                       for i, g in enumerate(got))
        assert {f.kind for f in check(str(tmp_path)).findings} == {"missing-extent"}

    anyio.run(scenario)


def test_a_batch_that_lacks_room_beside_a_lost_extents_claims_is_refused(
        tmp_path: Path) -> None:
    """After an extent deleted while the store is open is lost, this owner's claims
    there are withdrawn (claimed, unusable: used, as the claim transaction counts
    them).  A batch that fits only if they were free, under a parent nothing may evict,
    is refused with CapacityError; before, the reserve counted them as free, claimed,
    found the capacity short, evicted nothing and tried again for ever."""
    opts = dict(namespace=None, extent_bytes=64 << 10, capacity_bytes=24 * 4096)
    block = [torch.full((2048,), float(i)) for i in range(6)]  # 12 KiB slots

    async def scenario() -> None:
        async with kvstore.open(tmp_path, engine="threads", **opts) as store:
            async with kvstore.open(tmp_path, engine="threads", **opts) as other:
                await other.put(CHAIN[0], block[0])  # extent 1; its claims back at close
            os.unlink(extent_path(str(tmp_path), 1))
            with pytest.raises(kvstore.errors.StoreIOError):
                await store.put(CHAIN[1], block[1])  # claims 6 pages in extent 1: lost
            assert parts(store).allocator.claims.withdrawn == 6 * 4096
            batch = [bytes([0x40 + i]) * 16 for i in range(4)]  # 12 pages; 9 have room
            with anyio.fail_after(60), pytest.raises(kvstore.CapacityError):
                await store.put_many(batch, block[2:6],
                                     parents=kvstore.chain_parents(batch, CHAIN[0]))
            assert await store.contains_many(batch) == [False] * 4

    anyio.run(scenario)
