"""``python -m kvstore`` (kvstore/cli/main.py): plain-text help, --version, errors in the
CLI user's words (JSON under --json), stats in human units with the store's totals."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.cli.main import main
from kvstore.cli.progress import Progress
from kvstore.cli.units import human_bytes
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """``python -m kvstore ARGS`` in this process (subprocesses cost seconds of imports)."""
    def run(*args: str) -> Run:
        try:
            code = main(list(args))
        except SystemExit as e:  # --help, --version
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def test_help_is_plain_text_and_version_is_there(cli: Callable[..., Run]) -> None:
    run = cli("--help")
    assert run.returncode == 0
    for markup in ("``", ":mod:", ":func:", ":class:"):
        assert markup not in run.stdout
    assert "fsck PATH [--repair]" in run.stdout
    version = cli("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == \
        f"kvstore {kvstore.__version__} (on-disk format {kvstore.FORMAT_VERSION})"


@pytest.mark.parametrize("command", [["stats"], ["fsck"], ["fsck", "--deep"]])
def test_errors_name_the_problem_in_cli_words(cli: Callable[..., Run], tmp_path: Path,
                                              command: list[str]) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {
        tmp_path / "absent": f"{tmp_path / 'absent'} does not exist",
        tmp_path / "file": f"{tmp_path / 'file'} is a file, not a store directory",
        tmp_path / "empty": f"{tmp_path / 'empty'} is not a kvstore store (it has no index/ "
                            "directory)",
    }
    for path, message in cases.items():
        run = cli(*command[:1], str(path), *command[1:])
        assert (run.returncode, run.stdout, run.stderr) == (2, "", f"error: {message}\n")
        as_json = cli(*command[:1], str(path), *command[1:], "--json")
        assert as_json.returncode == 2 and as_json.stderr == ""
        assert json.loads(as_json.stdout) == {"error": message, "exit_code": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]  # nothing created
    assert list((tmp_path / "empty").iterdir()) == []


def test_rebuild_index_refuses_where_there_is_no_store(cli: Callable[..., Run],
                                                      tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    run = cli("fsck", str(tmp_path), "--rebuild-index")
    assert (run.returncode, run.stderr) == (2, f"error: no kvstore at {tmp_path}: nothing to "
                                               f"rebuild from (no extent files in "
                                               f"{tmp_path / 'extents'})\n")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # no LOCK, no index/
    absent = tmp_path / "absent"
    run = cli("fsck", str(absent), "--rebuild-index", "--json")
    assert run.returncode == 2
    assert json.loads(run.stdout) == {"error": f"{absent} does not exist (no such directory)",
                                      "exit_code": 2}
    assert not absent.exists()


def test_an_index_less_store_points_at_rebuild_index(cli: Callable[..., Run],
                                                     tmp_path: Path) -> None:
    (tmp_path / "extents").mkdir()
    run = cli("stats", str(tmp_path))
    assert run.returncode == 2
    assert f"python -m kvstore fsck {tmp_path} --rebuild-index" in run.stderr


def test_stats_human_units_totals_and_json(cli: Callable[..., Run], tmp_path: Path) -> None:
    ks = keys(3)
    values = [make_tensor(torch.float16, (65536,), i) for i in range(3)]  # 128 KiB each

    async def fill() -> None:
        async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
            await store.put_many(ks, values)
            await store.put_many(ks[:2], values[:2])  # deduplicated

    anyio.run(fill)
    text = cli("stats", str(tmp_path))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "since the store was created (all processes; kept in the index):" in lines
    assert "  puts       2 batches, 3 blocks written (384 KiB)" in lines
    assert "  dedup      2 blocks (256 KiB) not written again; offered / written 1.67x" in lines
    assert any(line.startswith("this process") for line in lines)
    assert "4.00 MiB on disk in 1 extent file(s) of 4.00 MiB" in text.stdout

    doc = json.loads(cli("stats", str(tmp_path), "--json").stdout)
    assert doc["namespaces"] == [json.loads(NS.canonical_json())]
    assert doc["totals"]["put_bytes"] == 3 * 131072 and doc["totals"]["dedup_blocks"] == 2
    assert doc["disk_bytes"] == SMALL_EXTENT  # exact numbers in JSON
    assert doc["this_process"]["puts"] == 0 and "puts" not in doc


def test_human_units() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 4 << 20, 123 << 30, 2 << 40)] == \
        ["0 B", "1023 B", "1.00 KiB", "1.50 KiB", "4.00 MiB", "123 GiB", "2.00 TiB"]


def test_byte_progress_bar_prints_human_units(capsys: pytest.CaptureFixture[str]) -> None:
    bar = Progress("fsck --deep: payloads", 3 << 30, "bytes")
    bar.advance(1 << 30)
    bar.close()
    err = capsys.readouterr().err
    assert "1.00 GiB of 3.00 GiB" in err and str(1 << 30) not in err
