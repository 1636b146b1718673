"""The test suite cleans up after itself: stores live under pytest's base temp directory,
which is removed at the end of the run (tests/conftest.py, pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def test_temporary_files_land_under_pytest_basetemp(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp().resolve()
    with tempfile.TemporaryDirectory() as d:
        assert Path(d).resolve().is_relative_to(base)
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert Path(child.stdout.strip()).resolve().is_relative_to(base)  # TMPDIR for subprocesses


def test_the_run_removes_its_temp_directory(pytestconfig: pytest.Config,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """"none": the base temp goes at the end of the run, failed tests' dirs included."""
    assert pytestconfig.getini("tmp_path_retention_policy") == "none"
    assert Path(os.environ["TMPDIR"]).is_relative_to(tmp_path_factory.getbasetemp())
