"""Quarantine records (kvstore/index/quarantine.py): why a block left the index, and what
happens when a key has two copies that failed.

A key has one record.  When its newer copy fails while an older one is still
quarantined, the older one is read again at once: if it verifies it serves the key
again (nothing lost), if not its space is freed (it just failed; the newer copy keeps
the record).  A quarantined copy whose key was stored again is freed when it is read
again and verifies: the block lives on in its newer slot.  A record says "could not be
read" with a flag bit an older build ignores.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.format import (
    ENTRY_FLAG_UNREADABLE,
    IndexEntry,
    encode_quarantined,
    quarantined_unreadable,
)
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import flip_payload_bit
from tests.read_faults import ENGINES, ReadFaults, open_faulty

KEY = b"\x11" * 16
OPEN = dict(extent_bytes=2 << 20, staging_bytes=4 << 20)
VALUE = torch.arange(8192, dtype=torch.float32)


def _entry(store: kvstore.Store) -> IndexEntry:
    (entry,) = parts(store).index.get_entries([KEY])
    assert entry is not None
    return entry


async def _lose_a_copy(store: kvstore.Store, faults: ReadFaults) -> IndexEntry:
    """KEY put and quarantined by a read error; the engine stores it again (a second
    copy).  Returns the first copy's entry."""
    parts(store).rechecks.delays = (3600.0,)  # no background re-read here
    await store.put(KEY, VALUE)
    older = _entry(store)
    faults.aim(store.path, older)
    assert await store.get(KEY) is None  # quarantined: could not be read
    assert _record(store) == (older, True)
    await store.put(KEY, VALUE)
    assert _entry(store).offset != older.offset
    return older


def _record(store: kvstore.Store) -> tuple[IndexEntry, bool] | None:
    return parts(store).index.quarantine_records.of([KEY]).get(KEY)


@pytest.mark.parametrize("kind", ENGINES)
def test_an_older_copy_that_verifies_serves_the_key_when_the_newer_one_fails(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        faults = ReadFaults()
        async with open_faulty(kind, tmp_path, faults, monkeypatch, **OPEN) as store:
            older = await _lose_a_copy(store, faults)
            newer = _entry(store)
            faults.aim(store.path, newer)  # now the newer one fails, the older one reads
            got = await store.get(KEY)
            assert got is None  # this get's copy failed...
            assert _entry(store) == older and _record(store) == (newer, True)
            again = await store.get(KEY)  # ...but the key is served again, from the older
            assert again is not None and torch.equal(again, VALUE)
            stats = store.stats()
            assert (stats.quarantined_blocks, stats.restored_blocks, stats.quarantined) == \
                (2, 1, 1)

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_an_older_copy_that_fails_again_is_freed_for_the_newer_record(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with open_faulty(kind, tmp_path, ReadFaults(), monkeypatch, **OPEN) as store:
            await store.put(KEY, VALUE)
            older = _entry(store)
        flip_payload_bit(tmp_path, older)
        faults = ReadFaults()
        async with open_faulty(kind, tmp_path, faults, monkeypatch, **OPEN) as store:
            parts(store).rechecks.delays = (3600.0,)
            assert await store.get(KEY) is None
            assert _record(store) == (older, False)  # failed verification
            await store.put(KEY, VALUE)
            newer = _entry(store)
            used = store.used_bytes
            faults.aim(store.path, newer)
            assert await store.get(KEY) is None
            assert _record(store) == (newer, True) and not await store.contains(KEY)
            assert store.used_bytes == used - older.slot_len  # the older copy's space freed
        # the index and the space agree; the newer copy reads whole now: restorable
        faults.clear()  # (fsck reads through the thread-pool engine, faulty until now)
        report = fsck.check(str(tmp_path))
        assert [f.kind for f in report.findings] == ["restorable"]

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_reread_copy_of_a_key_stored_again_is_freed_not_restored(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        faults = ReadFaults()
        async with open_faulty(kind, tmp_path, faults, monkeypatch, **OPEN) as store:
            older = await _lose_a_copy(store, faults)
            newer = _entry(store)
            used = store.used_bytes
            faults.clear()
            assert await parts(store).rechecks.once() == 0
            assert _record(store) is None and _entry(store) == newer
            assert store.used_bytes == used - older.slot_len
            assert store.stats().restored_blocks == 0
            got = await store.get(KEY)
            assert got is not None and torch.equal(got, VALUE)
        assert fsck.check(str(tmp_path)).findings == []

    anyio.run(scenario)


def test_the_unreadable_flag_is_a_flag_bit_older_builds_ignore() -> None:
    entry = IndexEntry(extent=1, offset=4096, slot_len=8192, payload_len=100, raw_len=100,
                       codec=0, dtype=6, payload_crc=7, seq=9, last_use=11, parent=b"\x01" * 16)
    plain, flagged = encode_quarantined(entry, False), encode_quarantined(entry, True)
    assert plain == entry.encode() and not quarantined_unreadable(plain)
    assert quarantined_unreadable(flagged) and flagged[3] == plain[3] | ENTRY_FLAG_UNREADABLE
    assert flagged[:3] == plain[:3] and flagged[4:] == plain[4:]
    assert IndexEntry.decode(flagged) == entry  # what any build decodes
