"""``python -m kvstore`` (kvstore/tools/cli/main.py): plain-text help, --version, errors in the
CLI user's words (JSON under --json); kvstore/tools/cli/paths.py says what is wrong with a path."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import kvstore
from tests.tools.cli.conftest import Run


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
