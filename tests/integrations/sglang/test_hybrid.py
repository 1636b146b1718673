"""The v2 (hybrid) calls of the SGLang HiCache backend, driven by SGLang's own
``HybridCacheController`` through its real host pools (``controller.py``): a Mamba state
sidecar (Qwen3-Next, Nemotron-H) and a sliding-window KV sidecar (gpt-oss, Gemma 3)
beside the full-attention KV pages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore.testing import parts
from tests.conformance import flip_payload_bit
from tests.integrations.sglang.controller import (
    HostPoolGroup,
    PoolEntry,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    attach,
    backup,
    get_storage_hash_str,
    mamba_pool,
    mha_pool,
    prefetch,
)

PAGE, KV_LAYERS, SWA_LAYERS, WINDOW = 4, 2, 3, 2
EXTRA = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
         "class_name": "KVStoreHiCache", "interface_v1": 1, "extent_bytes": 4 << 20,
         "staging_bytes": 4 << 20}
TOKENS = list(range(100, 100 + 6 * PAGE))
HASHES = get_storage_hash_str(TOKENS, None, page_size=PAGE)
# Two radix nodes of three pages each, at host pages 1-3 and 4-6 of the KV pool.
NODES = [(0, 3, 1), (3, 6, 4)]


@dataclass
class Hybrid:
    """A hybrid model's host pools and how SGLang's tree describes their sidecar."""

    kind: str
    kv: Any
    side: Any

    @property
    def name(self) -> PoolName:
        return PoolName.MAMBA if self.kind == "mamba" else PoolName.SWA

    def group(self) -> HostPoolGroup:
        return HostPoolGroup([
            PoolEntry(PoolName.KV, self.kv, None, lambda i: i, is_primary_index_anchor=True),
            PoolEntry(self.name, self.side, None, lambda i: i)])

    def saved(self, node: int) -> PoolTransfer:
        """The sidecar of a node's backup (``build_hicache_transfers``): the state in
        slot ``node + 1`` keyed by the node's last page, or the node's last WINDOW
        pages of the SWA pool keyed by theirs."""
        end, host = NODES[node][1], NODES[node][2] + 2
        if self.kind == "mamba":
            return PoolTransfer(self.name, host_indices=torch.tensor([node + 1]),
                                keys=[HASHES[end - 1]],
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
        return PoolTransfer(self.name, host_indices=_tokens(host - WINDOW + 1, WINDOW),
                            keys=HASHES[end - WINDOW:end],
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)

    def wanted(self) -> PoolTransfer:
        """The sidecar of a prefetch: placeholders, re-pointed by the controller at the
        hit's end, loading into slot 5 or SWA pages 10-11."""
        n, indices = (1, torch.tensor([5])) if self.kind == "mamba" else \
            (WINDOW, _tokens(10, WINDOW))
        return PoolTransfer(self.name, host_indices=indices, keys=["__placeholder__"] * n,
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)

    def page(self, index: int) -> bytes:
        """Bytes of sidecar page ``index`` (a state slot or an SWA page)."""
        start = index if self.kind == "mamba" else index * PAGE
        return bytes(self.side.get_data_page(start, flat=True).view(torch.uint8).numpy())

    def saved_pages(self, node: int) -> list[int]:
        return [node + 1] if self.kind == "mamba" else \
            list(range(NODES[node][2] + 3 - WINDOW, NODES[node][2] + 3))

    def loaded_pages(self) -> list[int]:
        return [5] if self.kind == "mamba" else [10, 11]


def _tokens(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def hybrid(kind: str, ssm_dtype: torch.dtype = torch.float32) -> Hybrid:
    kv = mha_pool(64 * PAGE, PAGE, KV_LAYERS)
    side = mamba_pool(8, ssm_dtype=ssm_dtype) if kind == "mamba" else \
        mha_pool(16 * PAGE, PAGE, SWA_LAYERS)
    g = torch.Generator().manual_seed(1)
    for buf in (kv.kv_buffer, *([side.temporal_buffer, *side.conv_buffer]
                                if kind == "mamba" else [side.kv_buffer])):
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    return Hybrid(kind, kv, side)


def save_both_nodes(cc: Any, h: Hybrid) -> None:
    for node, (start, end, host) in enumerate(NODES):
        op = backup(cc, _tokens(host, end - start), TOKENS[start * PAGE:end * PAGE],
                    HASHES[start:end], pool_transfers=[h.saved(node)])
        assert op.completed_tokens == (end - start) * PAGE
        assert op.pool_storage_result.extra_pool_hit_pages == {h.name: len(h.saved(node).keys)}


def kv_page(h: Hybrid, page: int) -> bytes:
    return bytes(h.kv.get_data_page(page * PAGE, flat=True).view(torch.uint8).numpy())


KINDS = ["mamba", "swa"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_controller_backs_up_and_prefetches_every_pool(tmp_path: Path, kind: str) -> None:
    h = hybrid(kind)
    cc = attach(h.group(), PAGE, {**EXTRA, "path": str(tmp_path)})
    try:
        assert cc.storage_backend._sidecars.names == [kind]
        save_both_nodes(cc, h)
        hit, op, acks = prefetch(cc, TOKENS, 20 * PAGE, [h.wanted()])
        assert hit == 6 * PAGE  # the KV pages and the sidecar at the end of node 2
        assert op.pool_storage_result.restorable_prefix_pages == [3, 6]
        assert [a.completed_tokens for a in acks[:-1]] == [6 * PAGE]
        assert acks[-1].pool_hits == {h.name: len(h.wanted().keys)}
        for i, (_, _, host) in enumerate(NODES):
            for p in range(3):
                assert kv_page(h, 20 + 3 * i + p) == kv_page(h, host + p)
        assert [h.page(p) for p in h.loaded_pages()] == [h.page(p) for p in h.saved_pages(1)]
    finally:
        cc.storage_backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupted_sidecar_page_makes_the_whole_hit_shorter(tmp_path: Path,
                                                              kind: str) -> None:
    h = hybrid(kind)
    extra = {**EXTRA, "path": str(tmp_path)}
    cc = attach(h.group(), PAGE, extra)
    save_both_nodes(cc, h)
    backend = cc.storage_backend
    # the first sidecar page node 2 needs: its state, or the first page of its window
    bad = backend._sidecars.keys(h.name, h.saved(1).keys[:1])[0]
    entry = parts(backend.store.store).index.get_entries([bad])[0]
    backend.close()
    assert entry is not None
    flip_payload_bit(tmp_path, entry)
    before = [h.page(p) for p in h.loaded_pages()]

    cc = attach(h.group(), PAGE, extra)
    try:
        hit, op, acks = prefetch(cc, TOKENS, 20 * PAGE, [h.wanted()])
        assert hit == 6 * PAGE  # the index still lists the page: its read fails
        assert acks[-1].pool_hits == {h.name: 0}  # SGLang drops this prefetch whole
        if kind == "mamba":  # a state page that failed is not scattered into the pool
            assert [h.page(p) for p in h.loaded_pages()] == before
        stats = cc.storage_backend.get_stats().kvstore
        assert stats["corrupt_blocks"] == 1 and stats["quarantined_blocks"] == 1

        hit, op, acks = prefetch(cc, TOKENS, 30 * PAGE, [h.wanted()])
        assert hit == 3 * PAGE  # shorter: node 1's end, whose sidecar verifies
        assert op.pool_storage_result.restorable_prefix_pages == [3]
        assert acks[-1].pool_hits == {h.name: len(h.wanted().keys)}
        assert [h.page(p) for p in h.loaded_pages()] == [h.page(p) for p in h.saved_pages(0)]
    finally:
        cc.storage_backend.close()


def test_a_corrupted_kv_page_of_a_hybrid_makes_the_whole_hit_shorter(tmp_path: Path) -> None:
    h = hybrid("mamba")
    extra = {**EXTRA, "path": str(tmp_path)}
    cc = attach(h.group(), PAGE, extra)
    save_both_nodes(cc, h)
    backend = cc.storage_backend
    bad = backend._keys(HASHES[4:5])[0]  # the K block of page 4 (node 2)
    entry = parts(backend.store.store).index.get_entries([bad])[0]
    backend.close()
    assert entry is not None
    flip_payload_bit(tmp_path, entry)

    cc = attach(h.group(), PAGE, extra)
    try:
        hit, op, acks = prefetch(cc, TOKENS, 20 * PAGE, [h.wanted()])
        assert hit == 6 * PAGE and acks[0].completed_tokens == 4 * PAGE
        assert acks[-1].pool_hits == {}  # KV fell short: no state read, SGLang drops it
        hit, op, acks = prefetch(cc, TOKENS, 30 * PAGE, [h.wanted()])
        assert (hit, op.pool_storage_result.restorable_prefix_pages) == (3 * PAGE, [3])
        assert [h.page(p) for p in h.loaded_pages()] == [h.page(p) for p in h.saved_pages(0)]
    finally:
        cc.storage_backend.close()


def test_a_restart_with_another_state_dtype_restores_nothing(tmp_path: Path) -> None:
    extra = {**EXTRA, "path": str(tmp_path)}
    h = hybrid("mamba")
    cc = attach(h.group(), PAGE, extra)
    save_both_nodes(cc, h)
    cc.storage_backend.close()
    other = hybrid("mamba", ssm_dtype=torch.bfloat16)
    cc = attach(other.group(), PAGE, extra)
    try:
        backend = cc.storage_backend
        assert backend.batch_exists(HASHES) == 6  # the attention pages are the same
        result = backend.batch_exists_v2(HASHES, [other.wanted()])
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
        assert prefetch(cc, TOKENS, 20 * PAGE, [other.wanted()])[0] == 0
    finally:
        cc.storage_backend.close()


def test_pools_it_cannot_store_are_refused_at_attach(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    kv = mha_pool(16 * PAGE, PAGE, KV_LAYERS)
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kv, None, lambda i: i, is_primary_index_anchor=True),
        PoolEntry(PoolName.INDEXER, mha_pool(16 * PAGE, PAGE, 1), None, lambda i: i)])
    backends: list[Any] = []
    from kvstore.integrations.sglang import backend as module

    class Recording(module.KVStoreHiCache):  # the backend, remembered to be closed
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            backends.append(self)

    monkeypatch.setattr(module, "Recording", Recording, raising=False)
    try:
        with pytest.raises(NotImplementedError, match="'indexer' is not supported"):
            attach(group, PAGE, {**EXTRA, "path": str(tmp_path),
                                 "module_path": module.__name__, "class_name": "Recording"})
    finally:
        for b in backends:
            b.close()
    assert len(backends) == 1


def test_v2_calls_check_their_input(tmp_path: Path) -> None:
    h = hybrid("mamba")
    cc = attach(h.group(), PAGE, {**EXTRA, "path": str(tmp_path)})
    backend = cc.storage_backend
    try:
        wrong = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 2]), keys=["a" * 64])
        with pytest.raises(ValueError, match="2 host indices for 1 pages"):
            backend.batch_set_v2([wrong])
        with pytest.raises(ValueError, match="no 'swa' host pool registered"):
            backend.batch_get_v2([PoolTransfer(PoolName.SWA, keys=["a" * 64],
                                               host_indices=_tokens(0, 1))])
        groups = PoolTransfer(PoolName.MAMBA, keys=["a" * 64],
                              hit_policy=PoolHitPolicy.BLOCK_GROUPS)
        backup(cc, _tokens(1, 3), TOKENS[:3 * PAGE], HASHES[:3])
        with pytest.raises(NotImplementedError, match="hit policy block_groups"):
            backend.batch_exists_v2(HASHES[:3], [groups])
        assert backend.batch_exists(HASHES) == 3 and backend.store.stats().blocks == 6
    finally:
        backend.close()


PATTERN_PAGES = 8


@pytest.mark.parametrize("kind", KINDS)
def test_batch_exists_v2_answers_as_sglangs_file_backend(tmp_path: Path, kind: str) -> None:
    """Which pages are stored (any pattern: holes in the KV prefix and in the sidecar
    pages) and which hit policy and window: ``batch_exists_v2`` answers exactly as
    SGLang's reference implementation, ``HiCacheFile``, given the same pages."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    h = hybrid(kind)
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny/hybrid", extra_config={**EXTRA, "path": str(tmp_path / "kvstore")})
    ours = StorageBackendFactory.create_backend("dynamic", config, h.kv)
    theirs = HiCacheFile(config, file_path=str(tmp_path / "file"))
    for backend in (ours, theirs):
        backend.register_mem_pool_host(h.kv)
        for entry in h.group().entries:
            backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    side_page = h.saved(0)  # one sidecar page's host indices
    side_page.host_indices = side_page.host_indices[:len(side_page.host_indices)
                                                    // len(side_page.keys)]
    examples = iter(range(10**6))

    @given(kv=st.lists(st.booleans(), min_size=PATTERN_PAGES, max_size=PATTERN_PAGES),
           side=st.lists(st.booleans(), min_size=PATTERN_PAGES, max_size=PATTERN_PAGES),
           window=st.integers(1, 3), policy=st.sampled_from(
               [PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES]))
    def same_answer(kv: list[bool], side: list[bool], window: int,
                    policy: PoolHitPolicy) -> None:
        tokens = [next(examples)] * PATTERN_PAGES * PAGE  # fresh hashes each example
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        for backend in (ours, theirs):
            for i in range(PATTERN_PAGES):
                if kv[i]:
                    assert backend.batch_set([hashes[i]], [h.kv.get_data_page(i * PAGE)])
                if side[i]:
                    one = PoolTransfer(h.name, host_indices=side_page.host_indices,
                                       keys=[hashes[i]])
                    assert backend.batch_set_v2([one]) == {h.name: [True]}
        asked = [PoolTransfer(h.name, keys=["__placeholder__"] * window, hit_policy=policy)]
        got, want = ours.batch_exists_v2(hashes, asked), theirs.batch_exists_v2(hashes, asked)
        assert (got.kv_hit_pages, got.restorable_prefix_pages, got.extra_pool_hit_pages) == \
            (want.kv_hit_pages, want.restorable_prefix_pages, want.extra_pool_hit_pages)

    try:
        same_answer()
    finally:
        ours.close()
