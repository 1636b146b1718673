"""A full disk is not a broken disk: on a real 48 MiB ext4 file system (loop-mounted),
a put that finds no room (for a new extent, or for the index to grow ``data.mdb`` at
its commit) fails with :class:`~kvstore.StoreFullError` (errno ENOSPC), nothing of it
is applied or leaked (its reservation returns, no extent file is left behind, fsck
finds nothing), the store does not turn read-only, and puts succeed again once space
is freed.  (A failed fdatasync still makes the store read-only: tests/test_failed_sync.py.)

Mounting needs root (CI runs as root); elsewhere these tests skip, saying why.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.extents import EXTENT_DIR
from kvstore.io.probe import probe
from kvstore.tools import fsck
from tests.conformance import NS, make_tensor, same

EXTENT = 16 << 20
SMALL = make_tensor(torch.uint8, (16,), 0)  # one 4 KiB slot


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 48 MiB ext4 file system, mounted on a loop device for this test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop file system needs root")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    image, mount = tmp_path / "fs.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(48 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop file system here: {mounted.stderr.strip()}")
    try:
        yield mount
    finally:  # lazily if a failed test left a file open there
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


class Filler:
    """A file that takes every free block of the file system (root ignores the reserved
    blocks too), and gives back exactly as many bytes as asked."""

    def __init__(self, mount: Path) -> None:
        self.path = mount / "filler"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for chunk in (1 << 20, 4096):
                data = b"\xff" * chunk
                try:
                    while True:
                        os.write(fd, data)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
            os.fsync(fd)
        finally:
            os.close(fd)

    def give_back(self, nbytes: int | None = None) -> None:
        """Free ``nbytes`` (all of it if None)."""
        if nbytes is None:
            self.path.unlink()
        else:
            os.truncate(self.path, max(0, self.path.stat().st_size - nbytes))


def opener(path: Path, engine: str, **options: Any) -> Any:
    return kvstore.open(path, namespace=NS, extent_bytes=EXTENT, staging_bytes=24 << 20,
                        engine=engine, **options)


def keys(start: int, n: int) -> list[bytes]:
    return NS.chain_keys(list(range(4 * start, 4 * (start + n))))


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_no_room_for_the_index_commit_is_store_full_and_the_store_goes_on(
        small_fs: Path, engine: str) -> None:
    if probe(str(small_fs), engine if engine == "threads" else "auto").engine != engine:
        pytest.skip(f"{engine} is not usable on this file system")
    path = small_fs / "store"

    async def run() -> None:
        async with opener(path, engine) as store:
            await store.put_many(keys(0, 1), [SMALL])  # extent 1: 4095 free slots
            filler = Filler(small_fs)
            used = store.used_bytes
            with pytest.raises(kvstore.StoreFullError) as full:
                for batch in range(1, 60):  # 64 slots a batch: extent 1 never runs out
                    await store.put_many(keys(64 * batch, 64), [SMALL] * 64)
                    used = store.used_bytes
            assert not isinstance(full.value, kvstore.StoreIOError)
            assert full.value.errno == errno.ENOSPC and "index" in str(full.value)
            assert not store.read_only and store.used_bytes == used  # reservation returned
            assert os.listdir(path / EXTENT_DIR) == ["00000001.kvx"]
            stored = await store.match_prefix(keys(0, 1))
            assert stored == 1

            filler.give_back()
            await store.put_many(keys(10_000, 64), [SMALL] * 64)
            got = await store.get_many(keys(10_000, 64) + keys(0, 1))
            assert all(same(g, SMALL) for g in got)

    anyio.run(run)
    report = fsck.check(str(path), deep=True)  # orphan slots of the failed put: notes
    assert report.exit_code == 0 and not report.problems, report.findings


def test_a_new_extent_whose_commit_finds_no_room_leaves_no_file(small_fs: Path) -> None:
    """The extent file was preallocated but the index could not record it: the file
    goes (it held the very space the index needs), nothing is acknowledged."""
    path = small_fs / "store"
    big = make_tensor(torch.uint8, (EXTENT - 8192,), 1)  # needs a fresh extent each

    async def run() -> None:
        async with opener(path, "threads") as store:
            await store.put_many(keys(0, 1), [SMALL])
            filler = Filler(small_fs)
            with pytest.raises(kvstore.StoreFullError):  # the index cannot grow
                for batch in range(1, 200):
                    await store.put_many(keys(64 * batch, 64), [SMALL] * 64)
            # Exactly one extent's worth of room: the preallocation takes it, and the
            # commit that would record the extent finds none.
            filler.give_back(EXTENT)
            with pytest.raises(kvstore.StoreFullError):
                await store.put_many(keys(50_000, 1), [big])
            assert os.listdir(path / EXTENT_DIR) == ["00000001.kvx"]
            assert not store.read_only
            filler.give_back()
            await store.put_many(keys(50_000, 1), [big])
            assert same((await store.get_many(keys(50_000, 1)))[0], big)

    anyio.run(run)
    report = fsck.check(str(path))
    assert report.exit_code == 0, report.findings


def test_a_read_only_file_system_is_a_typed_error_with_its_errno(small_fs: Path) -> None:
    """Not a full disk, a sibling: every errno the store's files give is kept in a
    typed error (the LOCK file's open on a read-only mount was a raw OSError)."""
    path = small_fs / "store"

    async def put() -> None:
        async with opener(path, "threads") as store:
            await store.put_many(keys(0, 1), [SMALL])

    anyio.run(put)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(kvstore.StoreIOError) as refused:
        anyio.run(put)
    assert refused.value.errno == errno.EROFS and str(path) in str(refused.value)
