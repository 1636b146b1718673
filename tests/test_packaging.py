"""The build: ``pip install -e .`` reads pyproject.toml through setuptools, which warns
(SetuptoolsDeprecationWarning) about a TOML-table ``project.license`` and stops building
such projects after 2027-02-18.  The metadata is built here with the warning made an
error, as pip's build backend would run it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUILD_METADATA = """
import sys, warnings
import setuptools.build_meta as backend
from setuptools.warnings import SetuptoolsDeprecationWarning
warnings.simplefilter("error", SetuptoolsDeprecationWarning)
print(backend.prepare_metadata_for_build_editable(sys.argv[1]))
"""


def test_metadata_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build writes kvstore.egg-info next to pyproject
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvstore", src / "kvstore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run([sys.executable, "-c", BUILD_METADATA, str(out)], cwd=src,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Deprecat" not in run.stdout + run.stderr
    metadata = (out / run.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
