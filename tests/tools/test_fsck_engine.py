"""fsck reads extent files through the I/O engine it is handed, as the store does: a read
fault of that engine (each engine's own read call: ``tests/read_faults.py``; the
simulated disk's fault queue) reaches fsck's findings, and a simulated crash stops it
like any other I/O of the store, leaving the store as it was."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvstore.disk.extents import extent_path
from kvstore.disk.format import PAGE
from kvstore.io.simulated import SimulatedCrash, SimulatedDisk, SimulatedEngine
from kvstore.tools import fsck
from tests.conformance import keys, same
from tests.read_faults import ENGINES, ReadFaults, _FailingOps, faulty_engine
from tests.tools.test_fsck import VALUES, N, build, read_back


def unreadable(report: fsck.Report) -> list[tuple[str, int | None, int | None, int | None]]:
    return [(f.severity, f.offset, f.length, f.errno) for f in report.findings
            if f.kind == "unreadable"]


@pytest.mark.parametrize("kind", ENGINES)
def test_a_read_fault_of_the_engine_is_an_unreadable_finding_for_its_page(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of free space fails with EIO on every read of the engine fsck is handed:
    ``--deep``'s scan (8 MiB reads) narrows the failed read to exactly that page,
    reported with EIO; the scan goes on past it (the other deleted block's slot is
    found) and every stored block's payload verifies."""
    store = tmp_path / "store"  # (the engine's probe runs beside it, not in it)
    entries = build(store, delete=2)  # blocks 0 and 1: orphan slots in free space
    hit, clear = entries[0], entries[1]
    bad = hit.offset + PAGE  # a page of block 0's payload
    faults = ReadFaults(extent_path(str(store), hit.extent), bad, PAGE)
    engine = faulty_engine(kind, tmp_path / "probe", faults, monkeypatch)
    report = fsck.check(str(store), deep=True, engine=engine)
    assert faults.failed  # read through the engine, and failed there
    assert unreadable(report) == [(fsck.DAMAGE, bad, PAGE, errno.EIO)]
    assert [x.offset for x in report.findings if x.kind == "orphan-slot"] == [clear.offset]
    assert report.payloads_verified == N - 2 == report.blocks


@pytest.mark.parametrize("kind", ENGINES)
def test_a_fault_in_a_stored_block_and_in_the_rebuilds_scan(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored block whose payload fails to read is that block's unreadable finding
    alone: fsck reads slots in batches, and a read the engine merged with its
    neighbours' is read again alone, so they verify.  The rebuild's scan, through the
    engine too, narrows the same fault to its page and keeps it out of the free space."""
    store = tmp_path / "store"  # (the engine's probe runs beside it, not in it)
    entries = build(store)
    hit = entries[5]
    bad = hit.offset + PAGE
    faults = ReadFaults(extent_path(str(store), hit.extent), bad, PAGE)
    report = fsck.check(str(store), deep=True,
                        engine=faulty_engine(kind, tmp_path / "probe", faults, monkeypatch))
    assert [(f.kind, f.key, f.errno) for f in report.findings] == [
        ("unreadable", keys(N)[5].hex(), errno.EIO)]
    assert report.payloads_verified == N - 1
    disk = SimulatedDisk(seed=5)
    report = fsck.rebuild_index(str(store), engine=_FailingOps(SimulatedEngine(disk), faults))
    assert unreadable(report) == [(fsck.DAMAGE, bad, PAGE, errno.EIO)]
    assert report.blocks == N - 1 and disk.ops > 0
    got = read_back(store)
    assert got[5] is None and all(same(g, v) for g, v in zip(got[:5] + got[6:],
                                                             VALUES[:5] + VALUES[6:]))


def test_the_simulated_disks_fault_queue_reaches_fsck(tmp_path: Path) -> None:
    """One transient EIO queued on the simulated disk: fsck's first read (the extent
    header) fails with it, and a second check, the fault spent, finds nothing."""
    build(tmp_path)
    disk = SimulatedDisk(seed=1, faults=[("read", errno.EIO)])
    report = fsck.check(str(tmp_path), engine=SimulatedEngine(disk))
    assert unreadable(report) == [(fsck.DAMAGE, 0, PAGE, errno.EIO)]
    assert report.blocks == N and disk.faults == []
    reads = disk.ops
    assert reads == 1 + N  # the header, then one page per slot
    assert fsck.check(str(tmp_path), engine=SimulatedEngine(disk)).findings == []
    assert disk.ops == 2 * reads


def test_a_simulated_crash_stops_fsck_and_leaves_the_store(tmp_path: Path) -> None:
    """The machine stops at fsck's fifth read: fsck ends with the crash (its lock, its
    event loop and the engine's files let go), the store opens and reads back."""
    build(tmp_path)
    disk = SimulatedDisk(seed=2, crash_at=5)
    with pytest.raises(SimulatedCrash):
        fsck.check(str(tmp_path), deep=True, repair=True, engine=SimulatedEngine(disk))
    assert disk.ops == 5
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))
    assert fsck.check(str(tmp_path), deep=True).findings == []


def test_a_file_system_that_refuses_o_direct_is_read_buffered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an engine handed in, fsck reads with O_DIRECT; where the open is refused
    (EINVAL, as tmpfs did before Linux 6.6), the same file is read buffered."""
    import os

    import kvstore.io.threads

    build(tmp_path, delete=1)
    refused: list[str] = []

    class NoDirect:
        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        def open(self, path: str, flags: int, *args: int) -> int:
            if flags & os.O_DIRECT:
                refused.append(path)
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
            return os.open(path, flags, *args)

    monkeypatch.setattr(kvstore.io.threads, "os", NoDirect())
    report = fsck.check(str(tmp_path), deep=True)
    assert refused and [f.kind for f in report.findings] == ["orphan-slot"]
    assert report.payloads_verified == N - 1
