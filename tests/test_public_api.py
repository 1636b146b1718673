"""The public surface is explicit (anyio's test_all_attributes idea) and type-clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import kvstore

ROOT = Path(__file__).resolve().parent.parent


def test_all_matches_the_public_names() -> None:
    # submodules are reachable as attributes once imported; they are not API
    public = {n for n, v in vars(kvstore).items()
              if not n.startswith("_") and not isinstance(v, ModuleType)}
    assert set(kvstore.__all__) - {"__version__"} == public
    for name in kvstore.__all__:
        assert hasattr(kvstore, name), name


def test_every_error_is_a_kvstore_error() -> None:
    for name in kvstore.errors.__all__:
        assert issubclass(getattr(kvstore.errors, name), kvstore.KVStoreError)
    assert issubclass(kvstore.StoreFullError, OSError)
    assert issubclass(kvstore.InvalidKeyError, TypeError)


def test_package_ships_py_typed() -> None:
    assert (ROOT / "kvstore" / "py.typed").exists()


@pytest.mark.skipif(shutil.which("mypy") is None and not (Path(sys.executable).parent / "mypy").exists(),
                    reason="mypy not installed (pip install -e '.[test]')")
def test_mypy_strict_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
