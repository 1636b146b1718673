"""The staging-arena pinning hook: the store calls whatever pinner is installed."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import kvstore
import kvstore.store
from kvstore import pinning
from kvstore.cuda.pinned import pin_arena
from kvstore.io.arena import Arena
from tests.conformance import NS


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, bool | None]] = []
        self.closed = 0
        self.status = "test pinner: pinned nothing"

    def __call__(self, arena: Arena, mode: bool | None) -> pinning.ArenaPin:
        self.calls.append((arena.size, mode))
        return self

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    rec = _Recorder()
    pinning.set_default_pinner(rec)
    try:
        yield rec
    finally:
        pinning.set_default_pinner(pin_arena)


def test_the_package_installs_the_cuda_pinner() -> None:
    assert pinning.default_pinner() is pin_arena


def test_the_store_pins_through_the_installed_hook(tmp_path: Path, recorder: _Recorder) -> None:
    async def main() -> str:
        async with kvstore.open(tmp_path / "s", namespace=NS, extent_bytes=1 << 20,
                                staging_bytes=1 << 20, pin_staging=None) as store:
            return store.stats().cuda

    assert anyio.run(main) == "test pinner: pinned nothing"
    assert recorder.calls == [(1 << 20, None)]
    assert recorder.closed == 1  # unpinned at close, before the arena is unmapped


def test_the_store_module_does_not_import_the_cuda_package() -> None:
    source = Path(kvstore.store.__file__).read_text()
    imported = {node.module for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if m.startswith("kvstore.cuda")}
