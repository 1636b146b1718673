"""``python -m kvstore demo`` (kvstore/tools/cli/demo.py): it never deletes what it did not
create, says where its data is, and ends with one verdict line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.tools import fsck
from kvstore.tools.cli.demo import MANIFEST, WORKLOADS, blocks_bytes, extent_bytes_for, sessions

ROOT = Path(__file__).resolve().parents[3]


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", "demo", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One tiny demo run (4 blocks of 2 MiB), shared by the tests that need a demo store."""
    path = tmp_path_factory.mktemp("demo") / "store"
    run = demo("--path", str(path), "--tiny")
    assert run.returncode == 0, run.stderr
    return path, run.stdout


def test_demo_refuses_a_directory_it_did_not_create(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.bin").write_bytes(b"\x01\x02")
    before = tree(tmp_path)
    run = demo("--path", str(tmp_path), "--tiny")
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f"error: {tmp_path} is not empty and is not a store made by the demo (no {MANIFEST}); "
        "the demo deletes only what it created. Pass --path with a new or empty directory.")
    assert tree(tmp_path) == before  # nothing deleted, nothing created


def test_demo_refuses_a_file(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("my notes")
    run = demo("--path", str(f), "--tiny")
    assert run.returncode == 2
    assert "is a file, not a directory" in run.stderr
    assert f.read_text() == "my notes"
    run = demo("--path", str(f), "--remove")
    assert run.returncode == 2 and f.read_text() == "my notes"


def test_demo_reports_where_its_data_is_and_one_verdict(demo_store: tuple[Path, str]) -> None:
    path, out = demo_store
    lines = out.strip().splitlines()
    assert lines[-1] == "OK: 6/6 blocks bit-exact after restart (0 bad); 96 of 96 prefix tokens found"
    assert sum(line.startswith(("OK:", "FAILED:")) for line in lines) == 1
    assert any(line.startswith(f"data:      {path} (") and "on disk, manifest inside" in line
               for line in lines)
    assert f"python -m kvstore demo --remove --path {path}" in out
    assert sorted(os.listdir(path)) == ["LOCK", "extents", "index", MANIFEST, "owners"]  # manifest inside
    assert not (path.parent / "demo-manifest.json").exists()
    assert fsck.check(str(path), deep=True).findings == []


def test_demo_refuses_its_own_store_once_it_holds_other_files(
        demo_store: tuple[Path, str]) -> None:
    path, _ = demo_store
    notes = path / "notes.txt"
    notes.write_text("mine")
    try:
        before = tree(path)
        for args in (("--tiny",), ("--remove",)):
            run = demo("--path", str(path), *args)
            assert run.returncode == 2
            assert "also holds files the demo did not create (notes.txt)" in run.stderr
            assert tree(path) == before
    finally:
        notes.unlink()


def test_demo_replaces_then_removes_its_own_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    assert demo("--path", str(path), "--tiny").returncode == 0
    again = demo("--path", str(path), "--tiny")  # a rerun replaces the demo's own store
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1].startswith("OK: ")
    removed = demo("--path", str(path), "--remove")
    assert removed.returncode == 0 and removed.stdout.startswith(f"removed the demo store {path}")
    assert not path.exists()
    assert demo("--path", str(path), "--remove").stdout.startswith("nothing to remove")


def test_extents_are_sized_to_the_workload() -> None:
    """--quick writes 80 distinct 2 MiB blocks: one extent that holds exactly them, not
    the store's default 1 GiB; the full run fits in 2 extents of under 1 GiB."""
    for name, distinct, extents in (("quick", 80, 1), ("full", 960, 2)):
        tokens = sessions(WORKLOADS[name])
        size = extent_bytes_for(tokens)
        slot = blocks_bytes() + 4096  # payload + the 256-byte header, page-rounded
        assert size <= 1 << 30
        assert (size - 4096) // slot * extents >= distinct
        assert (size - 4096) // slot * extents < distinct + extents


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the foreground process group) while the reload process starts:
    one line, exit 130, and the store checks clean."""
    path = tmp_path / "store"
    # The signal is sent when the restart line is read; on a loaded machine the tiny
    # reload (a second or two, importing torch) can finish before this process runs
    # again, and the demo then ends normally (exit 0, "OK:").  That run proves nothing
    # about Ctrl-C: run the demo again, a bounded number of times.
    for _attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "demo", "--path", str(path),
                                 "--tiny"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # wait until the offload is done and the restart begins
            seen.append(line)
            if line.startswith("engine restart"):
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if not (proc.returncode == 0 and "OK:" in out):
            break
    assert proc.returncode == 130, "".join(seen) + err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"interrupted; the store is consistent: run `python -m kvstore fsck {path}` to check"]
    assert "OK:" not in out
    report = fsck.check(str(path))
    assert report.problems == []
