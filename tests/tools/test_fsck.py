"""fsck finds every kind of damage and leftover, ``--repair`` fixes it, and a second run
finds nothing; ``--rebuild-index`` recreates the index from the extents alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import lmdb
import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import (
    PAGE,
    SLOT_HEADER_BYTES,
    IndexEntry,
    free_key,
    pack_u64,
    unpack_u64,
)
from kvstore.index.index import META_SEQ
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor, same

N = 12
VALUES = [make_tensor(torch.float16, (3000 + 7 * i,), i) for i in range(N)]


def build(path: Path, *, delete: int = 0) -> list[IndexEntry]:
    """A store with N blocks (the first ``delete`` of them deleted again)."""
    async def run() -> list[IndexEntry]:
        async with kvstore.open(path, namespace=NS, extent_bytes=1 << 20) as store:
            await store.put_many(keys(N), VALUES, parents=kvstore.chain_parents(keys(N)))
            entries = parts(store).index.get_entries(keys(N))
            await store.delete_many(keys(N)[:delete])
        return [e for e in entries if e is not None]

    return anyio.run(run)


def read_back(path: Path) -> list[torch.Tensor | None]:
    async def run() -> list[torch.Tensor | None]:
        async with kvstore.open(path, namespace=NS) as store:
            return await store.get_many(keys(N))

    return anyio.run(run)


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def lmdb_edit(path: Path, fn: object) -> None:
    """``fn`` edits the tables behind the index's back; the free-space counter is kept
    equal to the free table (a finding about the edit, not about the counter)."""
    env = lmdb.open(str(path / "index"), max_dbs=8)
    dbs = {n: env.open_db(n) for n in (b"meta", b"blocks", b"free", b"extents")}
    with env.begin(write=True) as txn:
        fn(txn, dbs)  # type: ignore[operator]
        free = sum(unpack_u64(v) for _, v in txn.cursor(dbs[b"free"]))
        txn.put(b"free_bytes", pack_u64(free), db=dbs[b"meta"])
    env.close()


def kinds(report: fsck.Report) -> set[str]:
    return {f.kind for f in report.findings}


def assert_repair_is_idempotent(path: Path, deep: bool = True) -> fsck.Report:
    fixed = fsck.check(str(path), repair=True, deep=deep)
    assert fixed.findings and all(f.fixed for f in fixed.findings)
    again = fsck.check(str(path), deep=deep)
    assert again.findings == [] and again.exit_code == 0, again.findings
    return fixed


def test_a_healthy_store_is_clean(tmp_path: Path) -> None:
    build(tmp_path)
    report = fsck.check(str(tmp_path), deep=True)
    assert report.findings == [] and report.exit_code == 0
    assert (report.blocks, report.payloads_verified, report.extents) == (N, N, report.extents)


def test_flipped_payload_bit_is_found_by_deep_check_and_repaired(tmp_path: Path) -> None:
    entries = build(tmp_path)
    victim = entries[4]
    flip(extent_path(str(tmp_path), victim.extent), victim.offset + SLOT_HEADER_BYTES + 11)
    assert fsck.check(str(tmp_path)).findings == []  # headers only: not seen
    report = fsck.check(str(tmp_path), deep=True)
    assert kinds(report) == {"bad-payload"} and report.exit_code == 1
    assert_repair_is_idempotent(tmp_path)
    got = read_back(tmp_path)
    assert got[4] is None
    assert all(same(g, v) for i, (g, v) in enumerate(zip(got, VALUES)) if i != 4)


def test_torn_slot_header_is_found_and_repaired(tmp_path: Path) -> None:
    entries = build(tmp_path)
    victim = entries[7]
    with open(extent_path(str(tmp_path), victim.extent), "r+b") as f:
        f.seek(victim.offset)  # the header's first 512-byte sector never reached the disk
        f.write(b"\0" * 512)
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"bad-slot"}
    assert_repair_is_idempotent(tmp_path, deep=False)
    assert read_back(tmp_path)[7] is None


def test_orphan_extent_file_is_reclaimable(tmp_path: Path) -> None:
    build(tmp_path)
    orphan = Path(extent_path(str(tmp_path), 99))
    orphan.write_bytes(bytes(PAGE))
    orphan.chmod(0o600)  # as create_extent_file leaves it (a wider mode is its own finding)
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"orphan-extent-file"} and not report.damage
    assert_repair_is_idempotent(tmp_path)
    assert not orphan.exists()


def test_repair_never_deletes_a_file_it_did_not_create(tmp_path: Path) -> None:
    """Only ``NNNNNNNN.kvx`` files in extents/ are the store's; anything else is listed as
    a note and left alone by --repair."""
    build(tmp_path)
    notes = tmp_path / "extents" / "notes.txt"
    notes.write_text("mine")
    notes.chmod(0o600)  # a wider mode is a finding of its own (loose-permissions)
    report = fsck.check(str(tmp_path), repair=True, deep=True)
    assert [(f.kind, f.severity, f.fixed) for f in report.findings] == \
        [("foreign-file", fsck.NOTE, False)]
    assert report.exit_code == 0
    assert notes.read_text() == "mine"


def test_rebuild_index_refuses_a_directory_without_extents(tmp_path: Path) -> None:
    """An empty or foreign directory is not turned into a store (no LOCK, no index/)."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "extents").mkdir()
    (tmp_path / "extents" / "readme").write_text("not an extent")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(FileNotFoundError, match="nothing to rebuild from"):
        fsck.rebuild_index(str(tmp_path))
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    with pytest.raises(FileNotFoundError, match="no such directory"):
        fsck.rebuild_index(str(tmp_path / "absent"))
    assert not (tmp_path / "absent").exists()


def test_leaked_space_is_reclaimable(tmp_path: Path) -> None:
    entries = build(tmp_path)
    last = max(entries, key=lambda e: e.offset)
    lmdb_edit(tmp_path, lambda txn, dbs: txn.delete(
        free_key(last.extent, last.offset + last.slot_len), db=dbs[b"free"]))
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"leaked-space"} and not report.damage
    assert_repair_is_idempotent(tmp_path)


def test_space_both_free_and_referenced_is_damage(tmp_path: Path) -> None:
    entries = build(tmp_path)
    e = entries[2]
    lmdb_edit(tmp_path, lambda txn, dbs: txn.put(free_key(e.extent, e.offset), pack_u64(PAGE),
                                                 db=dbs[b"free"]))
    report = fsck.check(str(tmp_path))
    assert "free-and-referenced" in kinds(report) and report.damage
    assert_repair_is_idempotent(tmp_path)
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))  # the block won


def test_missing_extent_file_is_damage_and_drops_its_blocks(tmp_path: Path) -> None:
    entries = build(tmp_path)
    lost = {e.extent for e in entries}
    gone = max(lost)
    os.unlink(extent_path(str(tmp_path), gone))
    report = fsck.check(str(tmp_path))
    assert "missing-extent" in kinds(report)
    # The store still opens (issue 35): the lost blocks are misses, quarantined as read.
    before = read_back(tmp_path)
    for g, v, e in zip(before, VALUES, entries):
        assert g is None if e.extent == gone else same(g, v)
    assert_repair_is_idempotent(tmp_path)
    got = read_back(tmp_path)
    for g, v, e in zip(got, VALUES, entries):
        assert g is None if e.extent == gone else same(g, v)


def test_bad_extent_header_is_rewritten(tmp_path: Path) -> None:
    entries = build(tmp_path)
    flip(extent_path(str(tmp_path), entries[0].extent), 10)
    assert kinds(fsck.check(str(tmp_path))) == {"bad-extent-header"}
    assert_repair_is_idempotent(tmp_path)
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))


def test_sequence_counter_behind_the_entries_is_repaired(tmp_path: Path) -> None:
    build(tmp_path)
    lmdb_edit(tmp_path, lambda txn, dbs: txn.put(META_SEQ, pack_u64(1), db=dbs[b"meta"]))
    assert kinds(fsck.check(str(tmp_path))) == {"meta"}
    assert_repair_is_idempotent(tmp_path)


def test_quarantined_blocks_are_reclaimed(tmp_path: Path) -> None:
    entries = build(tmp_path)
    flip(extent_path(str(tmp_path), entries[1].extent), entries[1].offset + SLOT_HEADER_BYTES)
    assert read_back(tmp_path)[1] is None  # served as a miss and quarantined
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"quarantined"} and not report.damage
    assert_repair_is_idempotent(tmp_path)


def test_deleted_slots_are_notes_and_repair_erases_them(tmp_path: Path) -> None:
    build(tmp_path, delete=3)
    report = fsck.check(str(tmp_path), deep=True)
    assert [f.kind for f in report.findings] == ["orphan-slot"] * 3
    assert report.exit_code == 0  # deleted blocks in free space are not a problem
    fixed = fsck.check(str(tmp_path), repair=True, deep=True)
    assert all(f.fixed for f in fixed.findings)
    assert fsck.check(str(tmp_path), deep=True).findings == []


def test_rebuild_index_from_extents_alone(tmp_path: Path) -> None:
    build(tmp_path, delete=2)
    fsck.check(str(tmp_path), repair=True, deep=True)  # erase the deleted slots first
    shutil.rmtree(tmp_path / "index")
    with pytest.raises(kvstore.IndexCorruptionError, match="rebuild-index"):
        read_back(tmp_path)  # and nothing was created over the extents
    report = fsck.rebuild_index(str(tmp_path))
    assert report.blocks == N - 2
    assert fsck.check(str(tmp_path), deep=True).findings == []
    got = read_back(tmp_path)
    assert got[:2] == [None, None]
    assert all(same(g, v) for g, v in zip(got[2:], VALUES[2:]))

    async def chain() -> int:
        async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
            return await store.match_prefix(keys(N)[2:])

    assert anyio.run(chain) == N - 2


def test_damaged_lmdb_file_is_a_clear_error(tmp_path: Path) -> None:
    build(tmp_path)
    data = tmp_path / "index" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[0:2 * PAGE] = b"\xa5" * (2 * PAGE)  # both LMDB meta pages
    data.write_bytes(bytes(raw))
    with pytest.raises(kvstore.IndexCorruptionError, match="rebuild-index"):
        read_back(tmp_path)
    fsck.rebuild_index(str(tmp_path))
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", "fsck", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    entries = build(tmp_path)
    assert cli(str(tmp_path)).returncode == 0
    flip(extent_path(str(tmp_path), entries[0].extent), entries[0].offset + 5)
    found = cli(str(tmp_path), "--json")
    assert found.returncode == 1
    doc = json.loads(found.stdout)
    assert doc["exit_code"] == 1 and doc["findings"][0]["kind"] == "bad-slot"
    fixed = cli(str(tmp_path), "--repair")
    assert fixed.returncode == 1 and "fixed" in fixed.stdout
    assert cli(str(tmp_path)).returncode == 0
    assert cli(str(tmp_path / "nothing-here")).returncode == 2


def test_cli_checks_a_store_that_is_open_and_refuses_to_repair_it(tmp_path: Path) -> None:
    build(tmp_path)

    async def run() -> list[subprocess.CompletedProcess[str]]:
        async with kvstore.open(tmp_path, namespace=NS):
            return [await anyio.to_thread.run_sync(cli, str(tmp_path), *flags)
                    for flags in ((), ("--repair",), ("--rebuild-index",))]

    checked, repaired, rebuilt = anyio.run(run)
    # the store is held shared: the check shares it and names the process using it
    assert checked.returncode == 0, checked.stderr
    assert "live-owners" in checked.stdout and f"pid {os.getpid()}" in checked.stdout
    # a repair needs it alone: it names the process and says what can run beside it
    for refused in (repaired, rebuilt):
        assert refused.returncode == 2
        assert f"open in 1 process(es) (pid {os.getpid()}); this needs it alone" \
            in refused.stderr
    assert "run fsck without --repair for a read-only check" in repaired.stderr


def test_chain_holes_are_counted_not_reported_as_problems(tmp_path: Path) -> None:
    """A delete may cut a chain (the caller's choice); fsck counts the holes it left, so a
    hole nobody made by hand (eviction never makes one) is visible."""
    build(tmp_path, delete=1)
    report = fsck.check(str(tmp_path))
    assert report.chain_holes == 1 and report.problems == []
    assert keys(N)[1].hex() in report.chain_hole_examples[0]
    build(tmp_path / "whole")
    assert fsck.check(str(tmp_path / "whole")).chain_holes == 0


def test_an_extent_cut_short_loses_only_the_blocks_past_its_end(tmp_path: Path) -> None:
    """The extents table's size is not trusted: the file is looked at.  Its blocks past
    the cut are bad slots (dropped by --repair), the file gets its size back (zeroes),
    and a second run finds nothing (before: short-extent was listed as fixed and found
    again by every later run, the blocks past the end as out-of-bounds)."""
    entries = build(tmp_path)
    p = extent_path(str(tmp_path), entries[0].extent)
    size = os.path.getsize(p)
    os.truncate(p, entries[6].offset)  # blocks 6 and after: past the end
    report = fsck.check(str(tmp_path))
    assert sorted(kinds(report)) == ["bad-slot", "short-extent"]
    assert sorted(f.offset for f in report.findings if f.kind == "bad-slot") == \
        [e.offset for e in entries[6:]]
    assert_repair_is_idempotent(tmp_path)
    assert os.path.getsize(p) == size
    got = read_back(tmp_path)
    assert [g is not None for g in got] == [True] * 6 + [False] * (N - 6)
    assert all(same(g, v) for g, v in zip(got[:6], VALUES))
