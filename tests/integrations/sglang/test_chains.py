"""Eviction never leaves a hole in what SGLang's controller backed up, also under SGLang's
defaults (``hicache_storage_pass_prefix_keys`` off: no call says which page came before):
the controller's own backup code writes each request in 128-page batches, and the
backend chains them (``kvstore/integrations/sglang/chains.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvstore.integrations.sglang.chains import STORAGE_BATCH_SIZE
from kvstore.testing import parts
from tests.integrations.sglang.controller import (
    HostPoolGroup,
    PoolEntry,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    attach,
    backup,
    get_storage_hash_str,
    hit_query,
    mamba_pool,
    mha_pool,
)

PAGE, PAGES, REQUESTS = 4, 300, 6
EXTRA = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
         "class_name": "KVStoreHiCache", "interface_v1": 1, "extent_bytes": 1 << 20,
         "staging_bytes": 4 << 20}


def test_the_batch_size_is_sglangs() -> None:
    from sglang.srt.managers import cache_controller

    assert cache_controller.STORAGE_BATCH_SIZE == STORAGE_BATCH_SIZE


def test_eviction_leaves_no_hole_without_prefix_keys(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Six 300-page requests (three batches each) into room for about 750 pages: every
    page still stored is reachable, i.e. each request keeps a leading run of its pages
    and nothing behind it.  With each batch a chain of its own, eviction took one
    batch's tail while the next batches stayed stored, unreachable."""
    kv = mha_pool(PAGES * PAGE, PAGE, layers=1, heads=1)
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv, None, lambda i: i,
                                     is_primary_index_anchor=True)])
    g = torch.Generator().manual_seed(3)
    kv.kv_buffer.copy_(torch.randn(kv.kv_buffer.shape, generator=g).to(kv.dtype))
    slot = 4096  # one K or V block of a page (256 payload bytes) takes one 4 KiB slot
    cc = attach(group, PAGE, {**EXTRA, "path": str(tmp_path),
                              "capacity_bytes": 750 * 2 * slot})
    backend = cc.storage_backend
    requests = [list(range(r * 10**6, r * 10**6 + PAGES * PAGE)) for r in range(REQUESTS)]
    hashes = [get_storage_hash_str(t, None, page_size=PAGE) for t in requests]
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.integrations.sglang"):
            for tokens, keys in zip(requests, hashes):
                op = backup(cc, torch.arange(PAGES * PAGE), tokens, keys)  # prefix_keys None
                assert op.completed_tokens == PAGES * PAGE
        stats = backend.store.stats()
        assert stats.evicted_blocks > 0 and stats.blocks <= 750 * 2
        usable, stored = [], []
        for tokens, keys in zip(requests, hashes):
            usable.append(hit_query(cc, tokens) // PAGE)
            present = backend.store.contains_many(backend._keys(keys))
            stored.append(sum(present) // 2)
        assert usable == stored, (usable, stored)  # nothing stored behind a hole
        assert sum(stored) == stats.blocks // 2 and max(usable) == PAGES
        entries = parts(backend.store.store).index.get_entries(backend._keys(hashes[-1]))
        parents = [e.parent for e in entries if e is not None]
        assert parents == [None, *backend._keys(hashes[-1])[:-1]]  # one chain, 3 batches
        warnings = [r for r in caplog.records if "hicache_storage_pass_prefix_keys" in
                    r.getMessage()]
        assert len(warnings) == 1  # once, naming the setting
    finally:
        backend.close()



def test_eviction_never_keeps_a_state_without_its_pages(tmp_path: Path) -> None:
    """A Mamba hybrid (two 150-page nodes per request, a state at each node's end,
    backed up with prefix keys as the launch line sets them) into room for about 750
    pages: a state still stored always has every KV page it needs, and the
    controller's hit is the longest length whose pages and state are stored."""
    kv = mha_pool(PAGES * PAGE, PAGE, layers=1, heads=1)
    states = mamba_pool(4)
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kv, None, lambda i: i, is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, states, None, lambda i: i)])
    g = torch.Generator().manual_seed(4)
    for buf in (kv.kv_buffer, states.temporal_buffer, *states.conv_buffer):
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    cc = attach(group, PAGE, {**EXTRA, "path": str(tmp_path),
                              "capacity_bytes": 750 * 2 * 4096})
    backend = cc.storage_backend
    requests = [list(range(r * 10**6, r * 10**6 + PAGES * PAGE)) for r in range(REQUESTS)]
    hashes = [get_storage_hash_str(t, None, page_size=PAGE) for t in requests]
    half = PAGES // 2

    def state(slot: int, keys: list[str]) -> PoolTransfer:
        return PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=keys,
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)

    try:
        for tokens, keys in zip(requests, hashes):
            for node, (start, end) in enumerate(((0, half), (half, PAGES))):
                op = backup(cc, torch.arange(start * PAGE, end * PAGE),
                            tokens[start * PAGE:end * PAGE], keys[start:end],
                            prefix_keys=keys[:start], pool_transfers=[state(node, [keys[end - 1]])])
                assert op.completed_tokens == (end - start) * PAGE
        assert backend.store.stats().evicted_blocks > 0
        for tokens, keys in zip(requests, hashes):
            pages = sum(backend.store.contains_many(backend._keys(keys))) // 2
            assert hit_query(cc, tokens) // PAGE == pages  # no KV page behind a hole
            at = [p for p in (half, PAGES) if backend.store.contains_many(
                backend._sidecars.keys(PoolName.MAMBA, [keys[p - 1]]))[0]]
            assert all(p <= pages for p in at), (at, pages)  # no state without its pages
            hit = hit_query(cc, tokens, [state(2, ["__placeholder__"])])
            assert hit == max(at, default=0) * PAGE
    finally:
        backend.close()
