"""Page-locking the staging arena: the store calls whatever locker is installed; its own
(CUDA host registration) loads kvstore.cuda only when a store asks for page-locking; ``pin_staging`` is the
deprecated old name of ``page_lock_staging``."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import kvstore
import kvstore.store
from kvstore import _cuda_path
from kvstore.io import page_locking
from kvstore.io.arena import Arena
from kvstore.options import StoreOptions
from tests.conformance import NS

ROOT = Path(__file__).resolve().parents[2]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, bool | None]] = []
        self.closed = 0
        self.status = "test locker: locked nothing"

    def __call__(self, arena: Arena, mode: bool | None) -> page_locking.ArenaPageLock:
        self.calls.append((arena.size, mode))
        return self

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    rec = _Recorder()
    page_locking.set_default_page_locker(rec)
    try:
        yield rec
    finally:
        page_locking.set_default_page_locker(None)


def _open_and_stat(path: Path, **options: object) -> str:
    async def main() -> str:
        async with kvstore.open(path, namespace=NS, extent_bytes=1 << 20,
                                staging_bytes=1 << 20, **options) as store:
            return store.stats().cuda

    return anyio.run(main)


def test_the_stores_own_locker_is_cudas_loaded_on_first_use() -> None:
    assert page_locking.default_page_locker() is None  # none installed
    assert _cuda_path.page_locker() is _cuda_path.page_lock


def test_the_store_locks_through_the_installed_hook(tmp_path: Path, recorder: _Recorder) -> None:
    assert _open_and_stat(tmp_path / "s", page_lock_staging=None) == "test locker: locked nothing"
    assert recorder.calls == [(1 << 20, None)]
    assert recorder.closed == 1  # unlocked at close, before the arena is unmapped


@pytest.mark.parametrize(("mode", "loaded"), [(False, False), (None, True)])
def test_kvstore_cuda_loads_only_for_a_store_that_page_locks(tmp_path: Path, mode: bool | None,
                                                             loaded: bool) -> None:
    code = ("import sys, anyio, kvstore\n"
            "async def main():\n"
            f"    async with kvstore.open({str(tmp_path / 's')!r}, extent_bytes=1 << 20,\n"
            f"                            staging_bytes=1 << 20, page_lock_staging={mode}) as s:\n"
            "        print(s.stats().cuda)\n"
            "anyio.run(main)\n"
            "print('kvstore.cuda' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    status, cuda_loaded = out.stdout.split("\n")[:2]
    assert cuda_loaded == str(loaded)
    if mode is False:
        assert status == "cuda: not used (page_lock_staging=False)"


def test_pin_staging_is_a_deprecated_alias(tmp_path: Path, recorder: _Recorder) -> None:
    with pytest.warns(DeprecationWarning, match="pin_staging is deprecated.*page_lock_staging"):
        opts = StoreOptions.of(pin_staging=False)
    assert opts.page_lock_staging is False
    assert opts.pin_staging is False  # reading the old name still works, silently
    with pytest.warns(DeprecationWarning, match="pin_staging"):
        _open_and_stat(tmp_path / "s", pin_staging=True)
    assert recorder.calls == [(1 << 20, True)]
    with pytest.raises(TypeError, match="pass only page_lock_staging"):
        StoreOptions.of(pin_staging=True, page_lock_staging=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StoreOptions.of(page_lock_staging=True)  # the new name does not warn


def test_the_old_module_names_still_work(recorder: _Recorder) -> None:
    sys.modules.pop("kvstore.pinning", None)
    with pytest.warns(DeprecationWarning, match="kvstore.io.page_locking"):
        pinning = importlib.import_module("kvstore.pinning")
    assert pinning.default_pinner() is recorder
    pinning.set_default_pinner(None)
    assert pinning.default_pinner() is None
    assert _cuda_path.page_locker() is _cuda_path.page_lock
    assert pinning.ArenaPin is page_locking.ArenaPageLock


def test_the_store_does_not_import_the_cuda_package() -> None:
    for module in (kvstore.store, _cuda_path, page_locking):
        source = Path(module.__file__ or "").read_text()
        imported = {node.module for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.ImportFrom) and node.module
                    and node.col_offset == 0}  # module level: deferred ones load on use
        assert not {m for m in imported if m.startswith("kvstore.cuda")}, module

