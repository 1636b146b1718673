"""A put that stores nothing of its own (every block another owner stored) syncs the
index before it is acknowledged (issue 43, kvstore/core/durable_dedup.py): LMDB shows a
commit to other processes before its meta page is durable."""

from __future__ import annotations

from pathlib import Path

import torch

import kvstore
from kvstore.testing import parts
from tests.conformance import NS, keys, same


def open_here(path: Path, *, sync: bool = True) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=64 << 10,
                                 engine="threads", sync=sync)


def values(n: int) -> list[torch.Tensor]:
    return [torch.full((512,), float(i)) for i in range(n)]


def test_a_put_of_blocks_another_owner_stored_syncs_the_index_first(tmp_path: Path
                                                                      ) -> None:
    """A stores three blocks; B's put of the same three writes nothing and commits
    nothing: it syncs the index once before it returns, and not again while no
    transaction committed since; after one did (B's own put), once more."""
    ks = keys(4)
    with open_here(tmp_path) as a, open_here(tmp_path) as b:
        a.put_many(ks[:3], values(3))
        barrier = parts(b).puts.durable_dedup
        before = parts(b).writer.commits
        assert b.put_many(ks[:3], values(3)).deduplicated == 3
        assert barrier.syncs == 1
        assert parts(b).writer.commits == before  # no transaction of its own
        b.put_many(ks[:3], values(3))
        assert barrier.syncs == 1  # nothing committed since its sync
        a.put_many(ks[3:], values(4)[3:])
        assert b.put_many(ks[3:], values(4)[3:]).deduplicated == 1
        assert barrier.syncs == 2
        assert all(same(g, v) for g, v in zip(b.get_many(ks), values(4)))


def test_a_put_that_writes_or_a_store_without_sync_needs_no_barrier(tmp_path: Path
                                                                     ) -> None:
    """A put that writes a block makes everything durable in its own commit; a store
    opened with sync=False promises no durability: neither syncs for the barrier."""
    ks = keys(3)
    with open_here(tmp_path / "durable") as a:
        a.put_many(ks[:2], values(2))
        a.put_many(ks, values(3))  # two deduplicated, one written
        assert parts(a).puts.durable_dedup.syncs == 0
    with open_here(tmp_path / "fast", sync=False) as a, \
            open_here(tmp_path / "fast", sync=False) as b:
        a.put_many(ks, values(3))
        assert b.put_many(ks, values(3)).deduplicated == 3
        assert parts(b).puts.durable_dedup.syncs == 0
