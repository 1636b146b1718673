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
    PoolName,
    attach,
    backup,
    get_storage_hash_str,
    hit_query,
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

