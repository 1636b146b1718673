"""fsck reads every quarantined slot again: what verifies goes back (``--repair``), never
zeroed; what fails again is reclaimed; what cannot be read stays quarantined.

Before, a block quarantined by one transient read error was listed as "failed
verification while serving" and ``fsck --repair`` zeroed its header and freed it: a
valid block lost for good.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
import kvstore.io.threads
import kvstore.tools.fsck
from kvstore.disk.extents import extent_path
from kvstore.disk.format import IndexEntry
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.read_faults import ReadFaults, _FaultyOs, open_faulty

KEYS = [bytes([0x21 + i]) * 16 for i in range(4)]
OPEN = dict(extent_bytes=2 << 20, staging_bytes=4 << 20)


def _value(i: int) -> torch.Tensor:
    return torch.arange(8192, dtype=torch.float32) * (i + 1)


def _slot_bytes(path: Path, e: IndexEntry) -> bytes:
    with open(extent_path(str(path), e.extent), "rb") as f:
        f.seek(e.offset)
        return f.read(e.slot_len)


async def _quarantine_by_eio(path: Path, monkeypatch: pytest.MonkeyPatch, bad: int = 1,
                             put_again: bool = False) -> IndexEntry:
    """Four blocks; ``KEYS[bad]`` quarantined by a read error (it reads whole again
    afterwards); ``put_again``: the key stored again meanwhile."""
    faults = ReadFaults()
    async with open_faulty("threads", path, faults, monkeypatch, **OPEN) as store:
        parts(store).rechecks.delays = (3600.0,)
        await store.put_many(KEYS, [_value(i) for i in range(4)])
        entry = parts(store).index.get_entries([KEYS[bad]])[0]
        assert entry is not None
        faults.aim(store.path, entry)
        assert (await store.get_many(KEYS))[bad] is None
        assert store.stats().quarantined == 1
        faults.clear()
        if put_again:
            await store.put(KEYS[bad], _value(bad))
    return entry


async def _read_all(path: Path) -> list[bool]:
    async with kvstore.open(path, engine="threads", **OPEN) as store:
        parts(store).rechecks.cancel()  # no background re-read of the quarantined one meanwhile
        got = await store.get_many(KEYS)
    for i, g in enumerate(got):
        assert g is None or torch.equal(g, _value(i))
    return [g is not None for g in got]


def _repair_unable_to_read(path: Path, entry: IndexEntry, monkeypatch: pytest.MonkeyPatch
                           ) -> fsck.Report:
    """``fsck --repair`` while every read of ``entry``'s slot fails with EIO."""
    faults = ReadFaults()
    faults.aim(str(path), entry)
    with monkeypatch.context() as m:
        m.setattr(kvstore.io.threads, "os", _FaultyOs(faults))
        return fsck.check(str(path), repair=True)


def test_a_quarantined_block_that_verifies_is_restored_not_zeroed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = anyio.run(_quarantine_by_eio, tmp_path, monkeypatch)
    before = _slot_bytes(tmp_path, entry)
    report = fsck.check(str(tmp_path))
    (finding,) = report.findings
    assert (finding.kind, finding.severity, finding.key) == \
        ("restorable", "reclaimable", KEYS[1].hex())
    assert report.exit_code == 1 and report.payloads_verified == 1
    fixed = fsck.check(str(tmp_path), repair=True)
    assert [f.fixed for f in fixed.findings] == [True]
    assert _slot_bytes(tmp_path, entry) == before  # nothing written over it
    assert fsck.check(str(tmp_path), deep=True).findings == []
    assert anyio.run(_read_all, tmp_path) == [True] * 4


def test_a_quarantined_copy_of_a_key_stored_again_is_freed_never_zeroed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = anyio.run(lambda: _quarantine_by_eio(tmp_path, monkeypatch, put_again=True))
    before = _slot_bytes(tmp_path, entry)
    assert [f.kind for f in fsck.check(str(tmp_path)).findings] == ["restorable"]
    fsck.check(str(tmp_path), repair=True)
    assert _slot_bytes(tmp_path, entry) == before
    again = fsck.check(str(tmp_path))
    assert again.findings == [] and again.quarantined == 0 and again.blocks == 4
    assert anyio.run(_read_all, tmp_path) == [True] * 4


def test_a_quarantined_slot_fsck_cannot_read_stays_quarantined(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = anyio.run(_quarantine_by_eio, tmp_path, monkeypatch)
    fixed = _repair_unable_to_read(tmp_path, entry, monkeypatch)
    (finding,) = fixed.findings
    assert (finding.kind, finding.severity, finding.fixed) == ("unreadable", "damage", False)
    assert fixed.exit_code == 1
    assert [f.kind for f in fsck.check(str(tmp_path)).findings] == ["restorable"]


def test_a_stored_slot_fsck_cannot_read_is_quarantined_by_repair_not_erased(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def fill() -> IndexEntry:
        async with kvstore.open(tmp_path, engine="threads", **OPEN) as store:
            await store.put_many(KEYS, [_value(i) for i in range(4)])
            entry = parts(store).index.get_entries([KEYS[2]])[0]
        assert entry is not None
        return entry

    entry = anyio.run(fill)
    before = _slot_bytes(tmp_path, entry)
    (finding,) = _repair_unable_to_read(tmp_path, entry, monkeypatch).findings
    assert (finding.kind, finding.severity, finding.fixed) == ("unreadable", "damage", True)
    assert _slot_bytes(tmp_path, entry) == before
    assert anyio.run(_read_all, tmp_path) == [True, True, False, True]  # quarantined
    assert [f.kind for f in fsck.check(str(tmp_path), repair=True).findings] == ["restorable"]
    assert anyio.run(_read_all, tmp_path) == [True] * 4


def test_fsck_without_repair_changes_nothing(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    anyio.run(_quarantine_by_eio, tmp_path, monkeypatch)
    data = tmp_path / "index" / "data.mdb"
    stamp = os.stat(data).st_mtime_ns, data.read_bytes()
    fsck.check(str(tmp_path))
    assert (os.stat(data).st_mtime_ns, data.read_bytes()) == stamp
    assert anyio.run(_read_all, tmp_path) == [True, False, True, True]
