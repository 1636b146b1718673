"""The memory tier across owners of one store (issue 43, DESIGN 13): each owner keeps
its own memory tier, and a memory hit is served only if the index still names the same
block (its ``seq``), so another owner's delete or rewrite of a key is never answered
from memory; a copy whose key the index no longer holds is dropped by the get that
finds it gone.  Two Stores of one process on one path stand in for two processes (the
index and its writer are shared exactly as across processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
import kvstore.core.owners
from kvstore.testing import parts
from tests.conformance import NS, keys, make_tensor, same

BLOCK = 64 << 10


def block(i: int) -> torch.Tensor:
    return make_tensor(torch.uint8, (BLOCK,), i)


def open_here(path: Path, **options: object) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=4 << 20, engine="threads",
                                 **options)  # type: ignore[arg-type]


def test_another_owners_delete_and_rewrite_are_never_served_from_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    k, other = keys(2)
    with open_here(tmp_path, memory_bytes=8 * BLOCK) as a:
        a.put_many([k, other], [block(1), block(2)])
        memory = parts(a).memory
        assert memory is not None and k in memory
        assert same(a.get(k), block(1)) and a.stats().memory_hits == 1  # from memory
        with open_here(tmp_path) as b:
            assert parts(b).owner.id != parts(a).owner.id
            assert b.delete(k)
            # A's memory still holds the old bytes; the index no longer names them
            assert a.get(k) is None
            assert k not in memory  # dropped by the get that found the entry gone
            b.put(k, block(3))  # the key stored again by B: another seq
            got = a.get(k)
            assert got is not None and same(got, block(3))
            assert a.stats().memory_hits == 1  # never served from A's memory since
            assert same(a.get(other), block(2))  # untouched: still a memory hit
            assert a.stats().memory_hits == 2
