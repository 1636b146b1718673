"""fsck and the ``tags`` table (kvstore/index/tags.py): a tag whose key has neither a block
nor a quarantine record is an orphan (reclaimable), ``--repair`` drops it (and the tags of
the blocks the repair itself drops); ``--rebuild-index`` cannot rebuild tags."""

from __future__ import annotations

from pathlib import Path

import anyio
import lmdb

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import IndexEntry
from kvstore.testing import parts
from kvstore.tools import fsck
from kvstore.tools.fsck_report import RECLAIMABLE
from tests.conformance import NS, keys
from tests.tools.test_fsck import VALUES, N, assert_repair_is_idempotent, kinds

TAGS = [b"tag-%d" % i for i in range(N)]


def build(path: Path) -> list[IndexEntry]:
    """A store with N tagged blocks."""
    async def run() -> list[IndexEntry]:
        async with kvstore.open(path, namespace=NS, extent_bytes=1 << 20) as store:
            await store.put_many(keys(N), VALUES, parents=kvstore.chain_parents(keys(N)),
                                 tags=TAGS)
            entries = parts(store).index.get_entries(keys(N))
        return [e for e in entries if e is not None]

    return anyio.run(run)


def table(path: Path, write: dict[bytes, bytes] | None = None) -> dict[bytes, bytes]:
    """The tags table as stored (after ``write``'s rows went in, as a build that keeps
    no lifetime for them would leave them)."""
    env = lmdb.open(str(path / "index"), max_dbs=16)
    try:
        db = env.open_db(b"tags")
        with env.begin(write=True) as txn:
            for k, v in (write or {}).items():
                txn.put(k, v, db=db)
            return {bytes(k): bytes(v) for k, v in txn.cursor(db)}
    finally:
        env.close()


def snapshot(path: Path) -> dict[bytes, bytes | None]:
    async def run() -> dict[bytes, bytes | None]:
        async with kvstore.open(path, namespace=NS) as store:
            return {b.key: b.tag async for page in store.snapshot() for b in page}

    return anyio.run(run)


def test_a_tagged_store_is_clean_and_orphan_tags_are_reclaimed(tmp_path: Path) -> None:
    build(tmp_path)
    assert fsck.check(str(tmp_path)).findings == []
    orphans = {k: b"left by an older build" for k in keys(3, 500)}
    table(tmp_path, orphans)
    report = fsck.check(str(tmp_path))
    assert kinds(report) == {"orphan-tag"}
    (finding,) = report.findings
    assert finding.severity == RECLAIMABLE and finding.detail.startswith("3 tag(s)")
    assert_repair_is_idempotent(tmp_path)
    assert table(tmp_path) == dict(zip(keys(N), TAGS))  # only the orphans went
    assert snapshot(tmp_path) == dict(zip(keys(N), TAGS))


def test_a_block_the_repair_drops_takes_its_tag_along(tmp_path: Path) -> None:
    entries = build(tmp_path)
    victim = entries[7]
    with open(extent_path(str(tmp_path), victim.extent), "r+b") as f:
        f.seek(victim.offset)  # a torn header: repair drops the block
        f.write(b"\0" * 512)
    assert kinds(fsck.check(str(tmp_path))) == {"bad-slot"}
    assert_repair_is_idempotent(tmp_path, deep=False)
    want = {k: t for i, (k, t) in enumerate(zip(keys(N), TAGS)) if i != 7}
    assert table(tmp_path) == want and snapshot(tmp_path) == want


def test_rebuild_index_keeps_the_blocks_not_their_tags(tmp_path: Path) -> None:
    build(tmp_path)
    fsck.rebuild_index(str(tmp_path))
    assert snapshot(tmp_path) == dict.fromkeys(keys(N))
    assert fsck.check(str(tmp_path)).findings == []


def test_an_older_build_sees_the_index_without_the_tags_table(tmp_path: Path) -> None:
    """An older build opens its eight tables by name (``max_dbs=8``) and never the ninth:
    the blocks read as before, and the tags stay for a build that keeps them."""
    build(tmp_path)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    try:
        blocks = env.open_db(b"blocks")
        for name in (b"meta", b"extents", b"free", b"quarantine", b"children", b"pins", b"lru"):
            env.open_db(name)
        with env.begin() as txn:
            assert sorted(bytes(k) for k, _ in txn.cursor(blocks)) == sorted(keys(N))
    finally:
        env.close()
    assert snapshot(tmp_path) == dict(zip(keys(N), TAGS))
