"""The verification backstop of slot reuse across owners (kvstore/core/reads.py,
``VerifiedReads._raced``; issue 43): a read whose slot fails verification because its
block moved after the lookup (another owner deleted it and wrote into its slot) is a
miss counted ``raced_reads``, never a quarantine or a corruption report; a failure
under an unchanged entry is still damage.

The race is real and made deterministic: owner A's read is held at a gate of its engine
between its lookup and its slot read while owner B (a second Store of this process on
the same path) deletes the block and writes another into its
slot.  A's read marks are turned off (a test seam, ``ReadMarks.enabled``): with them B
would not reuse the slot (tests/core/test_read_marks.py); without them B does, which is
the case the backstop exists for (a bug in the marks)."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
import kvstore.core.owners
from kvstore.disk.format import IndexEntry
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.concurrency import DEADLINE, GatedEngine, real_engine
from tests.conformance import NS, flip_payload_bit, keys, same

OPEN = {"namespace": NS, "extent_bytes": 1 << 20}
OLD = torch.arange(4096, dtype=torch.float32)
NEW = torch.arange(4096, dtype=torch.float32) + 0.5  # same size: B's best fit is the old slot


def place(entry: IndexEntry | None) -> tuple[int, int, int]:
    assert entry is not None
    return entry.extent, entry.offset, entry.slot_len


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvstore.store" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("rewrite", ["another key", "the same key"])
@pytest.mark.parametrize("form", ["get", "scrub"])
def test_a_read_racing_a_reuse_by_another_owner_is_a_miss_not_a_quarantine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        rewrite: str, form: str) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.store")
    k, other = keys(2)
    again = k if rewrite == "the same key" else other

    async def scenario() -> None:
        engine = GatedEngine(real_engine("threads", tmp_path))
        async with kvstore.open(tmp_path, engine=engine, **OPEN) as a, \
                kvstore.open(tmp_path, engine="threads", **OPEN) as b:
            parts(a).owner.marks.enabled = False  # the marks' bug the backstop catches
            await b.put(k, OLD)
            old = place(parts(b).index.get_entries([k])[0])
            gate = engine.gate("read")
            got: list[torch.Tensor | None] = []
            failed: list[int] = []

            async def read() -> None:
                if form == "get":
                    got.append(await a.get(k))
                else:
                    failed.append((await a.scrub(rate_bytes_per_s=None)).failed_blocks)

            with anyio.fail_after(DEADLINE):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read)
                    await gate.entered.wait()  # A looked k up and holds its old entry
                    assert await b.delete(k)
                    await b.put(again, NEW)
                    assert place(parts(b).index.get_entries([again])[0]) == old  # reused
                    gate.open()
            stats = a.stats()
            assert got == [None] if form == "get" else failed == [0]
            assert (stats.corrupt_blocks, stats.quarantined_blocks, stats.quarantined) == (0, 0, 0)
            assert warnings_of(caplog) == []
            assert stats.raced_reads == 1
            # B's block is intact and stays a hit, in both owners
            assert same(await a.get(again), NEW) and same(await b.get(again), NEW)
        report = fsck.check(str(tmp_path))
        assert report.findings == [] and report.quarantined == 0

    anyio.run(scenario)


def test_a_failure_under_an_unchanged_entry_is_still_quarantined(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.store")
    k = keys(1)[0]
    with kvstore.open_blocking(tmp_path, engine="threads", **OPEN) as store:
        store.put_many([k], [OLD])
        flip_payload_bit(tmp_path, parts(store).index.get_entries([k])[0])
        assert store.get_many([k]) == [None]
        assert store.get_many([k]) == [None]  # a miss now: not read, not counted again
        stats = store.stats()
        assert (stats.raced_reads, stats.corrupt_blocks, stats.quarantined_blocks,
                stats.quarantined) == (0, 1, 1, 1)
        assert len(warnings_of(caplog)) == 1
