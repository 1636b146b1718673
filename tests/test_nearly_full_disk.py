"""A nearly full disk at the index commit: LMDB reports a short write as EIO.

``mdb_page_flush`` writes a commit's dirty pages with ``pwritev``; when the file system
has room for some of them and not all, the call returns a short count, and LMDB turns a
short count into ``EIO`` ("short write, filesystem full?", mdb.c).  So a commit of
several pages on a disk with a few free blocks fails with errno EIO, not ENOSPC, and the
store took it for an I/O error: ``StoreIOError`` and read-only for as long as it stays
open, although freeing space is all it needs (found by the concurrent state machine's
full-disk rounds).  An EIO at a commit on a file system left (nearly) full is now
``StoreFullError`` and the store goes on (kvstore.index.writer._file_system_full).  The loop-mounted file system and its filler are those of tests/test_full_disk.py,
the reader of another process that makes the commit need new pages tests/concurrency.py's.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from tests.concurrency import SnapshotReader
from tests.conformance import NS
from tests.test_full_disk import Filler, small_fs  # noqa: F401 - small_fs: a fixture

SMALL = torch.zeros(16, dtype=torch.uint8)  # one 4 KiB slot; 256 of them: many index pages


def test_a_commit_that_half_fits_is_store_full_and_the_store_goes_on(
        small_fs: Path) -> None:  # noqa: F811 - the fixture imported above
    path = small_fs / "store"

    async def run() -> None:
        async with kvstore.open(path, namespace=NS, extent_bytes=16 << 20,
                                engine="threads") as store:
            await store.put_many(NS.chain_keys([0, 1, 2, 3]), [SMALL])
            # A reader of another process holds a snapshot: the commit needs new pages.
            reader = SnapshotReader(path / "index")
            filler = Filler(small_fs)
            try:
                filler.give_back(3 * 4096)  # room for three pages, not for the commit
                keys = NS.chain_keys(list(range(100, 100 + 4 * 256)))
                with pytest.raises(kvstore.StoreFullError):
                    await store.put_many(keys, [SMALL] * 256)
                assert not store.read_only
            finally:
                reader.end()
                filler.give_back()
            await store.put_many(keys, [SMALL] * 256)  # space is back: it goes on

    anyio.run(run)
