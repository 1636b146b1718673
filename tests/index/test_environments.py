"""Two Stores of one process on one path share one LMDB environment and its writer
(issue 43, kvstore/index/environments.py): LMDB forbids opening one environment twice
in a process.  Each BlockingStore runs its own event loop on its own thread, so the
shared writer serves two loops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
import kvstore.core.owners
from kvstore.index import environments
from kvstore.testing import parts
from tests.conformance import NS, keys


def open_here(path: Path) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=1 << 20, engine="threads")


def test_a_refused_second_open_leaves_the_environment_to_the_first(tmp_path: Path) -> None:
    before = environments.open_count()
    with open_here(tmp_path) as first:
        with pytest.raises(kvstore.OptionMismatchError, match="sync"):
            kvstore.open_blocking(tmp_path, namespace=NS, extent_bytes=1 << 20,
                                  engine="threads", sync=False)
        assert environments.open_count() == before + 1
        first.put_many(keys(1), [torch.ones(4)])
        assert first.get_many(keys(1))[0] is not None
    assert environments.open_count() == before


def test_two_stores_of_one_process_share_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = environments.open_count()
    ks = keys(4)
    a = open_here(tmp_path)
    try:
        b = open_here(tmp_path)
        try:
            assert parts(a).index is parts(b).index and parts(a).writer is parts(b).writer
            assert environments.open_count() == before + 1
            with parts(a).index.begin() as txn:
                rows = parts(a).index.owner_records.rows(txn)
            assert sorted(rows) == sorted([parts(a).owner.id, parts(b).owner.id])
            a.put_many(ks, [torch.full((8,), i) for i in range(4)])
            got = b.get_many(ks)  # a hit in the other store on its next lookup
            assert all(g is not None and torch.equal(g, torch.full((8,), i))
                       for i, g in enumerate(got))
        finally:
            a.close()
        # the environment stays open for b
        assert b.contains_many(ks) == [True] * 4
        assert environments.open_count() == before + 1
        b.close()
    finally:
        a.close()
    assert environments.open_count() == before
