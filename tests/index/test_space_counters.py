"""The space counters of format 2 (kvstore/index/space_counters.py) follow the tables
they sum through everything a store does, and a version-1 store is upgraded in place by
its first open (issue 43)."""

from __future__ import annotations

import struct
from pathlib import Path

import anyio
import lmdb
import pytest
import torch

import kvstore
from kvstore.disk.format import FORMAT_VERSION, unpack_u64
from kvstore.index.index import META_FORMAT, Index
from kvstore.index.space_counters import CLAIMED, FREE, PENDING
from kvstore.testing import parts
from tests.conformance import NS, keys, make_tensor, same

EXTENT = 64 << 10
N = 24
VALUES = [make_tensor(torch.float16, (1500 + 97 * i,), i) for i in range(N)]


def counters(index: Index) -> tuple[dict[bytes, int | None], dict[bytes, int]]:
    with index.begin() as txn:  # one snapshot: recorded and summed agree or not
        return index.space.read(txn), index.space.actual(txn)


@pytest.mark.anyio
async def test_counters_follow_puts_deletes_evictions_and_growth(tmp_path: Path) -> None:
    """A small capacity and small extents: puts grow the store by several extents and
    then evict; deletes free; every transaction keeps free_bytes at the free table's
    sum (checked after each step, in one read transaction)."""
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=EXTENT,
                            capacity_bytes=2 * EXTENT) as store:
        index = parts(store).index
        for i in range(0, N, 4):
            ks = keys(N)[i:i + 4]
            await store.put_many(ks, VALUES[i:i + 4], parents=kvstore.chain_parents(ks))
            have, want = counters(index)
            # (space freed by its evictions is in its claims once the commit ripened it)
            assert have == want and want[PENDING] == 0
            with index.begin() as txn:
                mine = index.space.claims_of(txn, parts(store).owner.id)
            assert want[CLAIMED] == sum(length for _, _, length in mine)
        assert parts(store).counters["evicted_blocks"] > 0  # (the workload did evict)
        assert len(index.extents_list()) > 1  # (and grew)
        deleted = [e.slot_len for e in index.get_entries(keys(N)[N - 4:]) if e is not None]
        await store.delete_many(keys(N)[N - 4:])
        have, want = counters(index)
        assert have == want and want[PENDING] == sum(deleted) > 0
        assert want[FREE] == sum(length for _, _, length in index.free_runs())


def downgrade_to_version_1(path: Path) -> None:
    """The store as a version-1 build left it: format_version 1, no space counters,
    no claims or pending tables (the owners/creating tables of version-1 builds of
    this branch are additive and stay)."""
    env = lmdb.open(str(path / "index"), max_dbs=16)
    meta = env.open_db(b"meta")
    claims, pending = env.open_db(b"claims"), env.open_db(b"pending")
    with env.begin(write=True) as txn:
        txn.put(META_FORMAT, struct.pack("<I", 1), db=meta)
        for name in (FREE, CLAIMED, PENDING):
            assert txn.delete(name, db=meta)
        txn.drop(claims, delete=True)
        txn.drop(pending, delete=True)
    env.close()


def recorded_format(path: Path) -> int:
    env = lmdb.open(str(path / "index"), max_dbs=16, readonly=True)
    meta = env.open_db(b"meta", create=False)
    with env.begin() as txn:
        version = int(struct.unpack("<I", bytes(txn.get(META_FORMAT, db=meta)))[0])
    env.close()
    return version


@pytest.mark.anyio
async def test_a_version_1_store_is_upgraded_by_its_first_open(tmp_path: Path) -> None:
    ks = keys(N)[:8]
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=EXTENT) as store:
        await store.put_many(ks, VALUES[:8], parents=kvstore.chain_parents(ks))
        await store.delete_many(ks[6:])  # (free runs inside the extent, not only its tail)
    downgrade_to_version_1(tmp_path)
    assert recorded_format(tmp_path) == 1
    async with kvstore.open(tmp_path, namespace=NS) as store:
        index = parts(store).index
        assert index.meta_records.check_format() == FORMAT_VERSION == 2
        have, want = counters(index)
        assert have == want and want[FREE] > 0
        got = await store.get_many(ks)
        assert all(same(g, v) for g, v in zip(got[:6], VALUES[:6])) and got[6:] == [None] * 2
        await store.put_many(ks[6:], VALUES[6:8])  # and it goes on counting
        assert counters(index)[0] == counters(index)[1]
    assert recorded_format(tmp_path) == 2


def test_upgrade_is_one_transaction_that_rereads_the_version(tmp_path: Path) -> None:
    """Two openers that both read version 1 both ask for the upgrade: LMDB runs their
    transactions one after the other, and the second finds version 2 and does nothing
    (no counter counted twice)."""
    async def make() -> None:
        async with kvstore.open(tmp_path, namespace=NS, extent_bytes=EXTENT) as store:
            await store.put_many(keys(4), VALUES[:4])

    anyio.run(make)
    downgrade_to_version_1(tmp_path)
    index = Index(str(tmp_path / "index"), map_size=1 << 30, sync=True)
    try:
        with index.env.begin(write=True) as txn:
            assert index.space.upgrade(txn) is True
            assert index.space.upgrade(txn) is False
        have, want = counters(index)
        assert have == want
    finally:
        index.close()


def test_a_counter_that_would_drop_below_zero_is_index_corruption(tmp_path: Path) -> None:
    index = Index(str(tmp_path / "index"), map_size=1 << 30, sync=True)
    try:
        with index.env.begin(write=True) as txn:
            index.space.add(txn, FREE, 4096)
            index.space.add(txn, FREE, -4096)
            assert unpack_u64(bytes(txn.get(FREE, db=index.meta))) == 0
            with pytest.raises(kvstore.IndexCorruptionError, match="free_bytes"):
                index.space.add(txn, FREE, -1)
    finally:
        index.close()
