"""The test suite cleans up after itself: stores live under pytest's base temp directory,
which tests/conftest.py removes at the end of the run, failed or not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_temporary_files_land_under_pytest_basetemp(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp().resolve()
    with tempfile.TemporaryDirectory() as d:
        assert Path(d).resolve().is_relative_to(base)
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert Path(child.stdout.strip()).resolve().is_relative_to(base)  # TMPDIR for subprocesses


def test_a_failing_run_leaves_no_temp_directory(tmp_path: Path) -> None:
    """A run whose test fails (and whose session-scoped dir holds a store-sized file)
    leaves nothing in its base temp: tests/conftest.py removes it at the end."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(Path(__file__).parent / "conftest.py", project / "conftest.py")
    (project / "test_it.py").write_text(
        "import tempfile\n"
        "def test_fails(tmp_path_factory):\n"
        "    d = tmp_path_factory.mktemp('store')\n"
        "    (d / 'extent').write_bytes(bytes(1 << 20))\n"
        "    assert tempfile.gettempdir().startswith(str(tmp_path_factory.getbasetemp()))\n"
        "    print('BASETEMP', tmp_path_factory.getbasetemp())\n"
        "    assert False\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          "test_it.py"], cwd=project, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("BASETEMP"))
    base = Path(line.split(" ", 1)[1])
    assert not base.exists()
