"""An owner's claims (space it took from the free pool: kvstore/index/space_counters.py)
go back to the pool when it closes and when the next open finds it killed
(kvstore/core/owners.py), counters with them (issue 43).  The killed owner is a real
process, SIGKILLed while it holds a claim."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

import kvstore
from kvstore.index.index import Index
from kvstore.index.space_counters import CLAIMED, FREE
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, keys, same
from tests.core.test_owners import killed_at

EXTENT = 1 << 20
VALUES = [torch.arange(1000 * (i + 1), dtype=torch.float32) for i in range(4)]

CLAIMER = textwrap.dedent("""
    import sys, kvstore
    from kvstore.testing import parts
    from tests.conformance import NS
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, engine="threads")
    p = parts(store)
    extent, offset, length = p.index.free_runs()[-1]
    p.writer.run_sync(lambda txn: p.index.space.claim(
        txn, p.index.free_map, p.owner.id, extent, offset + 8192, 16384))
    print("claimed", flush=True)
    sys.stdin.readline()  # killed meanwhile
""")


def state(index: Index) -> tuple[list[tuple[int, int, int]], dict[bytes, int | None],
                                  dict[bytes, int]]:
    with index.begin() as txn:
        return index.free_map.runs(txn), index.space.read(txn), index.space.actual(txn)


def fill(path: Path) -> list[tuple[int, int, int]]:
    with kvstore.open_blocking(path, namespace=NS, extent_bytes=EXTENT,
                               engine="threads") as store:
        store.put_many(keys(4), VALUES, parents=kvstore.chain_parents(keys(4)))
    # (read after the close: an open store holds the space it claimed for its puts)
    with kvstore.open_blocking(path, namespace=NS, engine="threads") as store:
        return parts(store).index.free_runs()


def test_claims_go_back_to_the_pool_when_their_owner_closes(tmp_path: Path) -> None:
    before = fill(tmp_path)
    extent, offset, length = before[-1]
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads") as store:
        p = parts(store)
        p.writer.run_sync(lambda txn: p.index.space.claim(
            txn, p.index.free_map, p.owner.id, extent, offset + 8192, 16384))
        runs, have, want = state(p.index)
        assert have == want and want[CLAIMED] == 16384
        assert runs == [*before[:-1], (extent, offset, 8192),
                        (extent, offset + 8192 + 16384, length - 8192 - 16384)]
        with p.index.begin() as txn:
            assert p.index.space.claims_of(txn, p.owner.id) == [(extent, offset + 8192, 16384)]
        assert fsck_free_of_findings_while_open(p.index)
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads") as store:
        runs, have, want = state(parts(store).index)
        assert runs == before  # merged back into one run
        assert have == want and want[CLAIMED] == 0
        assert all(same(g, v) for g, v in zip(store.get_many(keys(4)), VALUES))
    assert fsck.check(str(tmp_path)).findings == []


def fsck_free_of_findings_while_open(index: Index) -> bool:
    """The claim owns its space: free + claimed + stored tile the extent (what fsck's
    allocation step checks; fsck itself needs the store closed)."""
    with index.begin() as txn:
        claimed = index.space.actual(txn)[CLAIMED]
        free = index.space.actual(txn)[FREE]
    stored = sum(e.slot_len for _, e in index.iter_entries())
    usable = sum(size - 4096 for size in index.extents_list().values())
    return free + claimed + stored == usable


def test_a_killed_owners_claims_go_back_to_the_pool_at_the_next_open(tmp_path: Path) -> None:
    before = fill(tmp_path)
    killed_at(CLAIMER, tmp_path, "claimed\n")
    index = Index(str(tmp_path / "index"), map_size=1 << 30, sync=True)
    try:
        runs, have, want = state(index)  # as the killed owner left it: claimed
        assert want[CLAIMED] == 16384 and have == want and runs != before
    finally:
        index.close()
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads") as store:
        assert parts(store).owner.recovered == 1
        runs, have, want = state(parts(store).index)
        assert runs == before and have == want and want[CLAIMED] == 0
        assert all(same(g, v) for g, v in zip(store.get_many(keys(4)), VALUES))
    assert fsck.check(str(tmp_path)).findings == []
