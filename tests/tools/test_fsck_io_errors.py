"""fsck on a device that returns I/O errors: an operator's tool reports, it does not crash,
and ``--repair`` never writes over what it could not read.

The reads fail through the seam the engine tests use (``tests/read_faults.py``: the
``preadv`` of the thread-pool engine fsck reads through fails with EIO where a
:class:`ReadFaults` aims).
Before, an unreadable extent header or a page of free space under ``--deep`` ended the
check with the raw ``OSError`` (the command: "error: Input/output error", exit 2, no
report), and so did ``--rebuild-index``.  Writes that fail (``--repair`` on an
immutable file) were the same crash, half-way through a repair.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import kvstore.io.threads
from kvstore.disk.extents import extent_path
from kvstore.disk.format import PAGE, IndexEntry
from kvstore.tools import fsck
from kvstore.tools.cli.main import main
from tests.conformance import same
from tests.read_faults import ReadFaults, _FaultyOs
from tests.tools.test_fsck import VALUES, N, build, read_back


@contextmanager
def failing(path: Path, extent: int, offset: int, length: int) -> Iterator[ReadFaults]:
    """fsck's reads of ``[offset, offset + length)`` of the extent file fail with EIO."""
    faults = ReadFaults(extent_path(str(path), extent), offset, length)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kvstore.io.threads, "os", _FaultyOs(faults))
        yield faults


def raw(path: Path, extent: int, offset: int, length: int) -> bytes:
    with open(extent_path(str(path), extent), "rb") as f:
        f.seek(offset)
        return f.read(length)


def unreadable(report: fsck.Report) -> list[fsck.Finding]:
    return [f for f in report.findings if f.kind == "unreadable"]


def test_an_unreadable_extent_header_is_a_finding_and_repair_leaves_it(tmp_path: Path) -> None:
    entries = build(tmp_path)
    extent = entries[0].extent
    header = raw(tmp_path, extent, 0, PAGE)
    with failing(tmp_path, extent, 0, PAGE) as faults:
        report = fsck.check(str(tmp_path))
        (f,) = unreadable(report)
        assert (f.severity, f.extent, f.offset, f.errno) == (fsck.DAMAGE, extent, 0, errno.EIO)
        assert report.exit_code == 1 and report.blocks == N
        assert [x.kind for x in report.findings] == ["unreadable"]  # the blocks all check out
        repaired = fsck.check(str(tmp_path), repair=True)
        assert [(x.kind, x.fixed) for x in repaired.findings] == [("unreadable", False)]
        assert faults.failed  # it was tried, and failed
    assert raw(tmp_path, extent, 0, PAGE) == header  # never rewritten
    assert fsck.check(str(tmp_path)).findings == []  # it reads again: nothing to say
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))


def test_an_unreadable_page_of_free_space_is_narrowed_and_left_alone(tmp_path: Path) -> None:
    """``--deep`` scans free space in 8 MiB reads: the failed one is read again page by
    page, the bad page reported with its errno, the scan goes on (a deleted block's
    slot past it is still found); a deleted slot that touches the bad page cannot be
    verified, so repair does not zero its header."""
    entries = build(tmp_path, delete=2)  # blocks 0 and 1: orphan slots in free space
    hit, clear = entries[0], entries[1]
    bad = hit.offset + PAGE  # a page of block 0's payload
    before = raw(tmp_path, hit.extent, hit.offset, hit.slot_len)
    with failing(tmp_path, hit.extent, bad, PAGE):
        report = fsck.check(str(tmp_path), deep=True)
        (f,) = unreadable(report)
        assert (f.offset, f.length, f.errno) == (bad, PAGE, errno.EIO)
        orphans = [x.offset for x in report.findings if x.kind == "orphan-slot"]
        assert orphans == [clear.offset] and report.exit_code == 1
        repaired = fsck.check(str(tmp_path), deep=True, repair=True)
        assert {(x.kind, x.fixed) for x in repaired.findings} == {
            ("unreadable", False), ("orphan-slot", True)}
    assert raw(tmp_path, hit.extent, hit.offset, hit.slot_len) == before
    assert raw(tmp_path, clear.extent, clear.offset, PAGE) == bytes(PAGE)  # zeroed
    report = fsck.check(str(tmp_path), deep=True)  # readable again: block 0's slot is found
    assert [(x.kind, x.offset) for x in report.findings] == [("orphan-slot", hit.offset)]


def test_an_unreadable_orphan_extent_file_is_kept(tmp_path: Path) -> None:
    entries = build(tmp_path)
    orphan = extent_path(str(tmp_path), entries[0].extent + 1)
    shutil.copyfile(extent_path(str(tmp_path), entries[0].extent), orphan)
    os.chmod(orphan, 0o600)
    with failing(tmp_path, entries[0].extent + 1, 0, PAGE):
        report = fsck.check(str(tmp_path), repair=True)
        assert [(x.kind, x.fixed, x.errno) for x in report.findings] == [
            ("unreadable", False, errno.EIO)]
    assert os.path.exists(orphan)
    report = fsck.check(str(tmp_path), repair=True)
    assert [(x.kind, x.fixed) for x in report.findings] == [("orphan-extent-file", True)]
    assert not os.path.exists(orphan)


def test_the_command_reports_unreadable_with_exit_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = build(tmp_path)
    with failing(tmp_path, entries[0].extent, 0, PAGE):
        assert main(["fsck", str(tmp_path)]) == 1
        out = capsys.readouterr()
        assert "unreadable" in out.out and "Input/output error" in out.out and not out.err
        assert main(["fsck", str(tmp_path), "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["exit_code"] == 1
        assert [(f["kind"], f["errno"]) for f in doc["findings"]] == [("unreadable", errno.EIO)]
        assert main(["fsck", str(tmp_path), "--repair"]) == 1
        assert "0 problem(s) fixed, 1 left as it was" in capsys.readouterr().out


def test_rebuild_takes_an_extent_whose_header_cannot_be_read(tmp_path: Path) -> None:
    """Rebuilt from its name and size: its blocks are not lost for one sector."""
    entries = build(tmp_path)
    with failing(tmp_path, entries[0].extent, 0, PAGE):
        report = fsck.rebuild_index(str(tmp_path))
    assert [(f.kind, f.offset, f.errno) for f in report.findings] == [
        ("unreadable", 0, errno.EIO)]
    assert report.blocks == N and report.extents == 1
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))
    # Its header reads again.  It was the only extent: no other header told the store's
    # uuid, so the rebuilt index has a new one, which the header does not name.  Once it
    # reads, repair rewrites it (nothing unread is written over).
    report = fsck.check(str(tmp_path), repair=True)
    assert [(f.kind, f.fixed) for f in report.findings] == [("bad-extent-header", True)]
    assert fsck.check(str(tmp_path)).findings == []


def test_rebuild_keeps_an_unreadable_slot_out_of_the_free_space(tmp_path: Path) -> None:
    entries = build(tmp_path)
    bad: IndexEntry = entries[5]
    with failing(tmp_path, bad.extent, bad.offset + PAGE, PAGE):
        report = fsck.rebuild_index(str(tmp_path))
    (f,) = unreadable(report)
    assert (f.offset, f.length) == (bad.offset + PAGE, PAGE)
    assert report.blocks == N - 1
    got = read_back(tmp_path)
    assert got[5] is None and all(same(g, v) for i, (g, v) in enumerate(zip(got, VALUES))
                                  if i != 5)
    # The page is neither free nor indexed: the next check says so; nothing wrote there.
    report = fsck.check(str(tmp_path))
    assert [(x.kind, x.offset, x.length) for x in report.findings] == [
        ("leaked-space", bad.offset + PAGE, PAGE)]


def _immutable(path: str) -> Iterator[None]:
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable files (or this is not root)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=True)


def test_a_repair_whose_write_fails_says_so_and_fixes_the_rest(tmp_path: Path) -> None:
    """An extent file that cannot be written (immutable: EPERM at its open): the repair
    reports that fix failed, with its errno, does the others, and exits 1."""
    entries = build(tmp_path, delete=1)  # an orphan slot whose header repair zeroes
    os.chmod(tmp_path, 0o755)  # and loose permissions, fixed by a chmod of the directory
    with contextmanager(_immutable)(extent_path(str(tmp_path), entries[0].extent)):
        report = fsck.check(str(tmp_path), deep=True, repair=True)
    kinds = {(f.kind, f.fixed, f.errno) for f in report.findings}
    assert kinds == {("orphan-slot", False, None), ("loose-permissions", True, None),
                     ("repair-failed", False, errno.EPERM)}
    assert report.exit_code == 1
    report = fsck.check(str(tmp_path), deep=True, repair=True)  # writable again
    assert [(f.kind, f.fixed) for f in report.findings] == [("orphan-slot", True)]
    assert fsck.check(str(tmp_path), deep=True).findings == []
