"""fsck and format 2's space state (issue 43): the claims and pending tables own space
in the allocation map, the space counters are checked against their tables and
recounted by --repair, a version-1 store is noted and upgraded by --repair, and an
owner that did not close is recovered by --repair."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

import kvstore
from kvstore.disk.format import free_key, pack_u64, unpack_u64
from kvstore.disk.layout import MARKS_FILE
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, same
from tests.core.test_claims_returned import CLAIMER
from tests.core.test_owners import killed_at
from tests.index.test_space_counters import downgrade_to_version_1, recorded_format
from tests.tools.test_fsck import VALUES, N, build, read_back


def edit(path: Path, fn: Callable[[Any, dict[bytes, Any]], None]) -> None:
    env = lmdb.open(str(path / "index"), max_dbs=16)
    dbs = {n: env.open_db(n) for n in (b"meta", b"free", b"claims", b"pending")}
    with env.begin(write=True) as txn:
        fn(txn, dbs)
    env.close()


def add(txn: Any, meta: Any, name: bytes, delta: int) -> None:
    txn.put(name, pack_u64(unpack_u64(txn.get(name, db=meta)) + delta), db=meta)


def kinds(report: fsck.Report) -> set[str]:
    return {f.kind for f in report.findings}


def repaired_then_clean(path: Path) -> None:
    fixed = fsck.check(str(path), repair=True)
    assert fixed.findings and all(f.fixed for f in fixed.findings)
    again = fsck.check(str(path))
    assert again.findings == [] and again.exit_code == 0, again.findings
    assert all(same(g, v) for g, v in zip(read_back(path), VALUES))


def test_claims_and_pending_rows_own_their_space(tmp_path: Path) -> None:
    """Space moved from the free table into a claim and into a pending run, counters
    moved with it (as the store's transactions do): no leak, no damage."""
    entries = build(tmp_path)
    tail = max(e.offset + e.slot_len for e in entries)
    extent = entries[0].extent

    def carve(txn: Any, dbs: dict[bytes, Any]) -> None:
        run = unpack_u64(txn.pop(free_key(extent, tail), db=dbs[b"free"]))
        txn.put(struct.pack(">IIQ", 7, extent, tail), pack_u64(8192), db=dbs[b"claims"])
        txn.put(struct.pack(">QIQ", 3, extent, tail + 8192), pack_u64(4096), db=dbs[b"pending"])
        txn.put(free_key(extent, tail + 12288), pack_u64(run - 12288), db=dbs[b"free"])
        add(txn, dbs[b"meta"], b"free_bytes", -12288)
        add(txn, dbs[b"meta"], b"claimed_bytes", 8192)
        add(txn, dbs[b"meta"], b"pending_bytes", 4096)

    edit(tmp_path, carve)
    report = fsck.check(str(tmp_path))
    assert report.findings == [] and report.exit_code == 0


def test_a_pending_run_over_a_stored_block_is_damage_and_repair_drops_it(
        tmp_path: Path) -> None:
    entries = build(tmp_path)
    e = entries[2]

    def overlap(txn: Any, dbs: dict[bytes, Any]) -> None:
        txn.put(struct.pack(">QIQ", 9, e.extent, e.offset), pack_u64(e.slot_len),
                db=dbs[b"pending"])
        add(txn, dbs[b"meta"], b"pending_bytes", e.slot_len)

    edit(tmp_path, overlap)
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"overlap"} and report.damage
    repaired_then_clean(tmp_path)


def test_counter_drift_is_damage_and_repair_recounts(tmp_path: Path) -> None:
    build(tmp_path)
    edit(tmp_path, lambda txn, dbs: add(txn, dbs[b"meta"], b"free_bytes", -4096))
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"counter-drift"} and report.damage
    assert "free_bytes" in report.findings[0].detail
    repaired_then_clean(tmp_path)


def test_a_claims_counter_without_rows_is_drift(tmp_path: Path) -> None:
    build(tmp_path)
    edit(tmp_path, lambda txn, dbs: add(txn, dbs[b"meta"], b"claimed_bytes", 8192))
    assert kinds(fsck.check(str(tmp_path))) == {"counter-drift"}
    repaired_then_clean(tmp_path)


def test_a_version_1_store_is_noted_and_upgraded_by_repair(tmp_path: Path) -> None:
    build(tmp_path)
    downgrade_to_version_1(tmp_path)
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"old-format"} and report.exit_code == 0
    assert recorded_format(tmp_path) == 1  # a check changes nothing
    repaired_then_clean(tmp_path)
    assert recorded_format(tmp_path) == 2


def test_rebuild_index_counts_the_free_space(tmp_path: Path) -> None:
    build(tmp_path)
    report = fsck.rebuild_index(str(tmp_path))
    assert report.blocks == N
    again = fsck.check(str(tmp_path))
    assert again.findings == [] and again.exit_code == 0, again.findings


def test_an_owner_that_did_not_close_is_reclaimable_and_repair_recovers_it(
        tmp_path: Path) -> None:
    """A real process SIGKILLed while it holds a claim: fsck (exclusive: no owner is
    live) reports it; --repair returns its claim and removes its row and lock file, as
    the next open would have."""
    build(tmp_path)
    killed_at(CLAIMER, tmp_path, "claimed\n")
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"dead-owner"} and not report.damage and report.exit_code == 1
    assert "16384 bytes claimed" in report.findings[0].detail
    repaired_then_clean(tmp_path)
    # no lock file is left (the marks file is made again by read_back's open)
    assert [n for n in os.listdir(tmp_path / "owners") if n != MARKS_FILE] == []
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads") as store:
        assert parts(store).owner.recovered == 0  # nothing left for the open


def test_a_lock_file_of_no_owner_is_a_note_and_repair_removes_it(tmp_path: Path) -> None:
    build(tmp_path)
    # what a registration or close killed between its transaction and the file's removal
    # leaves: a lock file, not held, with no owners row
    left = tmp_path / "owners" / "00000099.lock"
    fd = os.open(left, os.O_CREAT | os.O_WRONLY, 0o600)  # (the store's mode)
    os.write(fd, b"12345\n")
    os.close(fd)
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"stale-owner-lock"} and report.exit_code == 0
    repaired_then_clean(tmp_path)
    assert not left.exists()
