"""A store reads and writes nothing outside its directory: no path under it is followed
through a symbolic link, and only regular files are used as its files (extent files,
``index/`` and LMDB's two files, ``LOCK``, ``extents/``, the I/O probe's scratch files,
the demo's manifest).  ``open()`` refuses with :class:`~kvstore.UnsafePathError` naming
the path and the fix, the link's target is never read or written, fsck reports a linked
extent file and ``--repair`` removes the link (never the target), losing that extent's
blocks; a link or other file where LOCK or the index should be stops fsck (exit 2)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.io.probe import probe
from kvstore.io.protocol import EngineWrapper, IOEngine
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine
from kvstore.tools import fsck
from kvstore.tools.cli.demo import DemoPathError, check_removable, write_manifest
from tests.conformance import NS, make_tensor, same

EXTENT = 256 << 10
N = 40  # 40 blocks of one 8 KiB slot: extents 1 (31 slots) and 2
VALUES = [make_tensor(torch.uint8, (6000,), i) for i in range(N)]
KEYS = NS.chain_keys(list(range(4 * N)))
ENGINES = ["io_uring", "threads", "simulated"]


def engine_of(kind: str) -> Any:
    return SimulatedEngine(SimulatedDisk()) if kind == "simulated" else kind


def need(kind: str, path: Path) -> None:
    """Skip where io_uring cannot run (the others always can)."""
    if kind == "io_uring":
        path.mkdir(parents=True, exist_ok=True)
        result = probe(str(path), "auto")
        if result.engine != "io_uring":
            pytest.skip(f"io_uring is not usable here: {result.reason}")


def opener(path: Path, kind: str = "threads", **options: Any) -> Any:
    return kvstore.open(path, namespace=NS, extent_bytes=EXTENT, staging_bytes=1 << 20,
                        engine=engine_of(kind), **options)


def build(path: Path, kind: str = "threads") -> None:
    async def run() -> None:
        async with opener(path, kind) as store:
            await store.put_many(KEYS, VALUES)

    anyio.run(run)


def read_back(path: Path, kind: str = "threads") -> list[torch.Tensor | None]:
    async def run() -> list[torch.Tensor | None]:
        async with opener(path, kind) as store:
            return await store.get_many(KEYS)

    return anyio.run(run)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def outside_copy(tmp_path: Path, inside: str) -> Path:
    """A copy of ``inside`` outside the store, and ``inside`` replaced by a link to it:
    a valid file, so a store that followed the link would use it without a word."""
    target = tmp_path / "outside" / os.path.basename(inside)
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(inside, target)
    os.unlink(inside)
    os.symlink(target, inside)
    return target


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", "fsck", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_linked_extent_file_refuses_the_open_and_fsck_repair_removes_only_the_link(
        tmp_path: Path, kind: str) -> None:
    store = tmp_path / "store"
    need(kind, store)
    build(store, kind)
    linked = extent_path(str(store), 1)
    target = outside_copy(tmp_path, linked)
    before = digest(target)

    with pytest.raises(kvstore.UnsafePathError, match="symbolic link") as refused:
        read_back(store, kind)
    assert linked in str(refused.value) and "fsck" in str(refused.value)
    assert digest(target) == before

    found = cli(str(store), "--json")
    assert found.returncode == 1 and '"unsafe-extent-file"' in found.stdout
    assert digest(target) == before  # fsck reads nothing through it either

    report = fsck.check(str(store), repair=True)
    assert [f.kind for f in report.findings if f.kind == "unsafe-extent-file"] == \
        ["unsafe-extent-file"] and all(f.fixed for f in report.findings)
    assert not os.path.lexists(linked) and digest(target) == before
    assert fsck.check(str(store)).exit_code == 0
    got = read_back(store, kind)  # extent 1's blocks are lost, extent 2's are served
    assert 0 < sum(g is None for g in got) < N
    assert all(same(g, v) for g, v in zip(got, VALUES) if g is not None)


class SwapsInALink(EngineWrapper):
    """Replaces the file by a link to ``target`` just before the engine opens it: the
    race between the store's check and the engine's open by path."""

    def __init__(self, inner: IOEngine, target: Path) -> None:
        super().__init__(inner)
        self.target = target

    def open_file(self, path: str) -> int:
        if not os.path.islink(path):
            shutil.copyfile(path, self.target)
            os.unlink(path)
            os.symlink(self.target, path)
        return self.inner.open_file(path)


def test_a_link_swapped_in_while_the_engine_opens_the_file_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    target = tmp_path / "outside.kvx"
    engine = SwapsInALink(SimulatedEngine(SimulatedDisk()), target)

    async def run() -> None:
        async with kvstore.open(store, namespace=NS, engine=engine):
            pass

    with pytest.raises(kvstore.UnsafePathError, match="replaced"):
        anyio.run(run)


def _replace_with_link(path: Path, tmp_path: Path) -> Path:
    target = tmp_path / "outside" / path.name
    target.parent.mkdir(exist_ok=True)
    if path.is_dir():
        shutil.move(str(path), str(target))
    else:
        shutil.copyfile(path, target)
        path.unlink()
    path.symlink_to(target)
    return target


@pytest.mark.parametrize("name", ["LOCK", "index", "index/data.mdb", "index/lock.mdb",
                                  "extents"])
def test_a_link_in_place_of_a_store_file_refuses_open_and_fsck(tmp_path: Path,
                                                                name: str) -> None:
    store = tmp_path / "store"
    build(store)
    target = _replace_with_link(store / name, tmp_path)
    files = sorted(target.rglob("*")) if target.is_dir() else [target]
    before = [digest(f) for f in files if f.is_file()]

    with pytest.raises(kvstore.UnsafePathError, match="symbolic link") as refused:
        read_back(store)
    assert str(store / name) in str(refused.value)
    found = cli(str(store))
    assert found.returncode == 2 and "symbolic link" in found.stderr
    assert [digest(f) for f in files if f.is_file()] == before


@pytest.mark.parametrize("name", ["LOCK", "extents/00000001.kvx"])
def test_a_fifo_in_place_of_a_store_file_is_refused_without_blocking(tmp_path: Path,
                                                                      name: str) -> None:
    store = tmp_path / "store"
    build(store)
    (store / name).unlink()
    os.mkfifo(store / name)
    with pytest.raises(kvstore.UnsafePathError, match="FIFO"):
        read_back(store)


def test_a_link_where_a_new_extent_file_goes_is_replaced_not_written_through(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)  # extents 1 and 2: the next one is 3
    target = tmp_path / "victim"
    target.write_bytes(b"not the store's" * 100)
    before = digest(target)
    os.symlink(target, extent_path(str(store), 3))
    more = NS.chain_keys(list(range(10_000, 10_000 + 4 * N)))

    async def grow() -> list[torch.Tensor | None]:
        async with opener(store) as s:
            await s.put_many(more, VALUES)
            return await s.get_many(more)

    got = anyio.run(grow)
    assert digest(target) == before
    assert os.path.isfile(extent_path(str(store), 3))
    assert not os.path.islink(extent_path(str(store), 3))
    assert all(same(g, v) for g, v in zip(got, VALUES))


def test_the_io_probe_never_writes_through_a_link(tmp_path: Path) -> None:
    store = tmp_path / "store"
    need("io_uring", tmp_path / "probe")
    store.mkdir()
    victims = []
    for name in (f".probe-direct-{os.getpid()}", f".probe-uring-{os.getpid()}"):
        victim = tmp_path / f"victim{name}"
        victim.write_bytes(b"\x00precious" * 1024)
        os.symlink(victim, store / name)
        victims.append((victim, digest(victim)))
    build(store, "io_uring")
    assert [digest(v) for v, _ in victims] == [d for _, d in victims]


def test_the_demo_manifest_is_never_read_through_a_link(tmp_path: Path) -> None:
    store = tmp_path / "demo"
    store.mkdir()
    write_manifest(str(store), "tiny", {})
    _replace_with_link(store / "kvstore-demo.json", tmp_path)
    with pytest.raises(DemoPathError, match="symbolic link"):
        check_removable(str(store))
    tmp = store / "kvstore-demo.json.tmp"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    tmp.symlink_to(victim)
    write_manifest(str(store), "tiny", {})  # replaces the link, never writes through it
    assert victim.read_text() == "precious"


def test_rebuild_index_leaves_a_linked_extent_file_out(tmp_path: Path) -> None:
    store = tmp_path / "store"
    build(store)
    outside_copy(tmp_path, extent_path(str(store), 1))
    report = fsck.rebuild_index(str(store))
    assert "unsafe-extent-file" in {f.kind for f in report.findings}
    assert report.extents == 1
