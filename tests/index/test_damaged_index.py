"""A damaged index never kills the process: ``data.mdb`` cut short, overwritten with
garbage or with a page of the wrong kind gives :class:`~kvstore.IndexCorruptionError`
(pointing at ``fsck --rebuild-index``) from ``open()`` or from the first read that
meets it, fsck exits 2 with the message, and ``fsck --rebuild-index`` rebuilds the
index from the extents.  A cut-short ``data.mdb`` used to be a SIGBUS (LMDB maps the
file and followed a page past its end), so opens and fscks run in child processes.

Not damage: ``lock.mdb`` garbage (LMDB rebuilds it), and pages past the end of
``data.mdb`` that nothing references (LMDB never writes a page it allocated and freed
in one transaction, so a healthy file may end before its last page number).
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.index.file import read_meta
from tests.conformance import NS, make_tensor, same

N = 200
VALUES = [make_tensor(torch.uint8, (100 + i,), i) for i in range(N)]
KEYS = NS.chain_keys(list(range(4 * N)))

OPEN_AND_READ = """
import sys, anyio, kvstore
async def main():
    async with kvstore.open(sys.argv[1], create=False, engine="threads") as store:
        await store.contains_many([bytes(16)])
try:
    anyio.run(main)
    print("served")
except kvstore.KVStoreError as e:
    print(type(e).__name__, e)
"""


def build(path: Path) -> None:
    async def run() -> None:
        async with kvstore.open(path, namespace=NS, extent_bytes=1 << 20, engine="threads") \
                as store:
            for i in range(0, N, 20):  # many commits: a data.mdb of many pages
                await store.put_many(KEYS[i:i + 20], VALUES[i:i + 20],
                                     parents=kvstore.chain_parents(KEYS)[i:i + 20])

    anyio.run(run)


def read_back(path: Path) -> list[torch.Tensor | None]:
    async def run() -> list[torch.Tensor | None]:
        async with kvstore.open(path, namespace=NS, create=False, engine="threads") as store:
            return await store.get_many(KEYS)

    return anyio.run(run)


def child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


# MDB_meta follows the 16-byte page header: magic, version (u32), address, mapsize
# (u64), two 48-byte MDB_db records, then mm_last_pg and mm_txnid (u64).
LAST_PG = 16 + 120
TXNID = 16 + 128


def newest_meta(data: Path) -> tuple[int, int]:
    """(offset of the meta page LMDB uses, page size)."""
    with open(data, "rb") as f:
        psize = read_meta(f.fileno(), data.stat().st_size).page_size
        txnids = []
        for offset in (0, psize):
            f.seek(offset + TXNID)
            txnids.append(struct.unpack("=Q", f.read(8))[0])
    return (0 if txnids[0] >= txnids[1] else psize), psize


def table_root(data: Path, name: bytes) -> int:
    """The root page of a named table: its record in the main tree's (one-page) root."""
    with open(data, "rb") as f:
        meta = read_meta(f.fileno(), data.stat().st_size)
        f.seek(meta.roots[1] * meta.page_size)
        page = f.read(meta.page_size)
    lower = struct.unpack_from("=H", page, 12)[0]
    for i in range((lower - 16) // 2):
        node = struct.unpack_from("=H", page, 16 + 2 * i)[0]
        ksize = struct.unpack_from("=H", page, node + 6)[0]
        if page[node + 8:node + 8 + ksize] == name:
            return int(struct.unpack_from("=Q", page, node + 8 + ksize + 40)[0])
    raise AssertionError(f"no table {name!r}")


def cut_to_8k(data: Path) -> None:
    os.truncate(data, 8192)


def cut_to_half(data: Path) -> None:
    os.truncate(data, data.stat().st_size // 2)


def not_an_lmdb_file(data: Path) -> None:
    data.write_bytes(random.Random(1).randbytes(16384))


def garbage_16k_after_the_meta_pages(data: Path) -> None:
    with open(data, "r+b") as f:
        f.seek(8192)
        f.write(random.Random(2).randbytes(16384))


def garbage_after_the_meta_pages(data: Path) -> None:
    raw = data.read_bytes()
    data.write_bytes(raw[:8192] + random.Random(3).randbytes(len(raw) - 8192))


def blocks_root_of_the_wrong_kind(data: Path) -> None:
    root = table_root(data, b"blocks")
    _, psize = newest_meta(data)
    with open(data, "r+b") as f:
        f.seek(root * psize + 10)
        f.write(struct.pack("=H", 0x04))  # P_OVERFLOW where a tree page should be


@pytest.mark.parametrize("damage", [cut_to_8k, cut_to_half, not_an_lmdb_file,
                                    garbage_16k_after_the_meta_pages,
                                    garbage_after_the_meta_pages,
                                    blocks_root_of_the_wrong_kind])
def test_a_damaged_index_is_index_corruption_never_a_dead_process(
        tmp_path: Path, damage: Callable[[Path], None]) -> None:
    build(tmp_path)
    damage(tmp_path / "index" / "data.mdb")

    opened = child("-c", OPEN_AND_READ, str(tmp_path))
    assert opened.returncode == 0, (opened.returncode, opened.stderr[-2000:])
    assert opened.stdout.startswith("IndexCorruptionError"), opened.stdout
    assert f"fsck {tmp_path} --rebuild-index" in opened.stdout

    checked = child("-m", "kvstore", "fsck", str(tmp_path))
    assert checked.returncode == 2, (checked.returncode, checked.stderr[-2000:])
    assert "damaged" in checked.stderr and "--rebuild-index" in checked.stderr
    assert "Traceback" not in checked.stderr

    rebuilt = child("-m", "kvstore", "fsck", str(tmp_path), "--rebuild-index")
    assert rebuilt.returncode in (0, 1), rebuilt.stderr
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))


def test_lock_mdb_garbage_is_not_damage(tmp_path: Path) -> None:
    build(tmp_path)
    (tmp_path / "index" / "lock.mdb").write_bytes(random.Random(3).randbytes(100))
    assert all(same(g, v) for g, v in zip(read_back(tmp_path), VALUES))


def test_unwritten_free_pages_past_the_end_of_data_mdb_are_not_damage(tmp_path: Path) -> None:
    """The meta page names three more pages than the file holds (as after a transaction
    whose last pages were allocated and freed again): nothing references them, the
    walk that the short file triggers finds everything inside it, the store opens and
    writes on, and fsck is clean."""
    build(tmp_path)
    data = tmp_path / "index" / "data.mdb"
    offset, psize = newest_meta(data)
    last_pg_at = offset + LAST_PG
    with open(data, "r+b") as f:
        f.seek(last_pg_at)
        last = struct.unpack("=Q", f.read(8))[0]
        assert (last + 1) * psize == data.stat().st_size
        f.seek(last_pg_at)
        f.write(struct.pack("=Q", last + 3))

    more = NS.chain_keys(list(range(10_000, 10_000 + 4 * 20)))

    async def run() -> list[torch.Tensor | None]:
        async with kvstore.open(tmp_path, namespace=NS, create=False, engine="threads") \
                as store:
            await store.put_many(more, VALUES[:20])
            return await store.get_many(KEYS + more)

    got = anyio.run(run)
    assert all(same(g, v) for g, v in zip(got, VALUES + VALUES[:20]))
    checked = child("-m", "kvstore", "fsck", str(tmp_path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
