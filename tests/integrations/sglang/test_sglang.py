"""kvstore as SGLang HiCache's L3 backend, against the real sglang package.

The package is installed by tests/integrations/install_sglang.sh (without its GPU-only
dependencies).  Its storage interface and backend factory import on CPU; its host KV
pools do not (``pool_host`` imports ``memory_pool``, which imports torchvision's compiled
ops, available on PyPI only as CUDA builds).  The pools here therefore reproduce
SGLang's ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` buffers exactly (shapes,
strides and the ``get_data_page`` / ``get_dummy_flat_data_page`` /
``set_from_flat_data_page`` code), and ``test_pool_replica_matches_sglang_source``
checks those lines against the installed package's source.

Skipped when sglang is not importable, except with ``KVSTORE_REQUIRE_SGLANG=1`` (CI).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conformance import flip_payload_bit

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        HiCacheStorageFailureInjector,
    )
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as e:  # noqa: BLE001 - any import failure means: not installed here
    if os.environ.get("KVSTORE_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"KVSTORE_REQUIRE_SGLANG=1 but sglang does not import: {e!r}; "
                           "run tests/integrations/install_sglang.sh") from e
    pytest.skip(f"sglang is not importable ({e!r}); install it with "
                "tests/integrations/install_sglang.sh", allow_module_level=True)

from kvstore.integrations.sglang import KVStoreHiCache  # noqa: E402
from kvstore.testing import parts

SMALL = {"extent_bytes": 4 << 20, "staging_bytes": 4 << 20}
DYNAMIC = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
           "class_name": "KVStoreHiCache", "interface_v1": 1}
LAYERS, HEADS, HEAD_DIM, PAGE, SIZE = 3, 2, 16, 4, 64
KV_CACHE_DIM = 24  # MLA: kv_lora_rank + qk_rope_head_dim


# ---------------------------------------------------------------------- host pools

class MHAPool:
    """SGLang's MHATokenToKVPoolHost buffer and page accessors (pool_host/mha.py)."""

    def __init__(self, layout: str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.dtype, self.page_size = layout, dtype, PAGE
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        self.size, self.page_num, self.device, self.pin_memory = SIZE, SIZE // PAGE, "cpu", False
        if layout == "layer_first":
            dims: tuple[int, ...] = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        elif layout == "page_first":
            dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        elif layout == "page_first_direct":
            dims = (2, self.page_num, self.layer_num, self.page_size, self.head_num,
                    self.head_dim)
        else:
            dims = (2, self.page_num, self.head_num, self.page_size, self.layer_num,
                    self.head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        else:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.head_num, self.page_size, self.layer_num, self.head_dim)


class MLAPool:
    """SGLang's MLATokenToKVPoolHost buffer and page accessors (pool_host/mla.py)."""

    def __init__(self, layout: str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.dtype, self.page_size = layout, dtype, PAGE
        self.layer_num, self.kv_cache_dim = LAYERS, KV_CACHE_DIM
        self.size, self.page_num, self.device, self.pin_memory = SIZE, SIZE // PAGE, "cpu", False
        if layout == "layer_first":
            dims: tuple[int, ...] = (self.layer_num, self.size, 1, self.kv_cache_dim)
        elif layout == "page_first":
            dims = (self.size, self.layer_num, 1, self.kv_cache_dim)
        else:
            dims = (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index : index + self.page_size, :, :, :]
        else:
            real_index = index // self.page_size
            data_page = self.kv_buffer[real_index : real_index + 1, :, :, :, :]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + self.page_size, :, :] = data_page.reshape(
                self.layer_num, self.page_size, 1, self.kv_cache_dim)
        elif self.layout == "page_first":
            self.kv_buffer[index : index + self.page_size, :, :, :] = data_page.reshape(
                self.page_size, self.layer_num, 1, self.kv_cache_dim)
        else:
            real_index = index // self.page_size
            self.kv_buffer[real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                1, self.layer_num, self.page_size, 1, self.kv_cache_dim)


def _source(module: str) -> str:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return " ".join(path.read_text().split())


def test_pool_replica_matches_sglang_source() -> None:
    """The pools above are SGLang's: its buffer dims and page slicing, line for line."""
    mha, mla = _source("sglang.srt.mem_cache.pool_host.mha"), \
        _source("sglang.srt.mem_cache.pool_host.mla")
    for line in (
        "dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)",
        "dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)",
        "dims = ( 2, self.page_num, self.layer_num, self.page_size, self.head_num, "
        "self.head_dim, )",
        "dims = ( 2, self.page_num, self.head_num, self.page_size, self.layer_num, "
        "self.head_dim, )",
        "data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]",
        "data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]",
        "data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]",
        "(2, self.layer_num, self.page_size, self.head_num, self.head_dim),",
    ):
        assert line in mha, line
    for line in (
        "dims = ( self.layer_num, self.size, 1, self.kv_cache_dim, )",
        "dims = ( self.size, self.layer_num, 1, self.kv_cache_dim, )",
        "dims = ( self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim, )",
        "data_page = self.kv_buffer[:, index : index + self.page_size, :, :]",
        "data_page = self.kv_buffer[index : index + self.page_size, :, :, :]",
        "data_page = self.kv_buffer[real_index : real_index + 1, :, :, :, :]",
    ):
        assert line in mla, line


# ---------------------------------------------------------------------- helpers

def storage_config(extra: dict[str, Any], *, mla: bool = False, model: str = "meta/llama",
                   tp_rank: int = 0, tp_size: int = 1, page_first: bool = True
                   ) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=page_first, model_name=model, extra_config=extra)


def make_backend(path: Path, pool: Any, *, mla: bool = False, model: str = "meta/llama",
                 **options: Any) -> KVStoreHiCache:
    """As SGLang's cache controller does: the factory, then register_mem_pool_host."""
    extra = {**DYNAMIC, "path": str(path), **SMALL, **options}
    config = storage_config(extra, mla=mla, model=model,
                            page_first=pool.layout.startswith("page"))
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    assert isinstance(backend, KVStoreHiCache)
    return backend


def fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


def page_bytes(pool: Any, index: int) -> bytes:
    return bytes(pool.get_data_page(index, flat=True).view(torch.uint8).numpy())


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def hashes(n: int, tag: str = "a") -> list[str]:
    return [f"{tag}{i:063x}" for i in range(n)]


POOLS = [("mha", "page_first"), ("mha", "layer_first"), ("mha", "page_first_direct"),
         ("mha", "page_head"), ("mla", "page_first"), ("mla", "layer_first"),
         ("mla", "page_first_direct")]


def new_pool(kind: str, layout: str) -> Any:
    return MHAPool(layout) if kind == "mha" else MLAPool(layout)


# ---------------------------------------------------------------------- tests

def test_factory_loads_the_backend_dynamically(tmp_path: Path) -> None:
    pool = MHAPool("page_first")
    backend = make_backend(tmp_path, pool)
    try:
        assert isinstance(backend, HiCacheStorage)
        assert backend.path == str(tmp_path) and backend.config.store.staging_bytes == 4 << 20
    finally:
        backend.close()
    bad = storage_config({**DYNAMIC, "path": str(tmp_path), "codec": "fp4"})
    with pytest.raises(ValueError, match="codec must be one of"):
        StorageBackendFactory.create_backend("dynamic", bad, pool)


@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_every_call_round_trips_pages_bit_exact(tmp_path: Path, kind: str, layout: str) -> None:
    src, dst = new_pool(kind, layout), new_pool(kind, layout)
    fill(src, 1)
    backend = make_backend(tmp_path, src, mla=kind == "mla")
    try:
        keys = hashes(6)
        # v1 (zero copy): pages 0-2 of the pool, in one put_many
        assert backend.batch_set_v1(keys[:3], indices([5, 1, 9])) == [True] * 3
        # pre-v1: flat pages, as SGLang's generic path passes them
        assert backend.batch_set(keys[3:5], [src.get_data_page(p * PAGE) for p in (2, 7)])
        assert backend.set(keys[5], src.get_data_page(3 * PAGE))
        assert backend.batch_exists(keys) == 6 and backend.exists(keys[4])
        assert backend.batch_exists([*keys[:2], "f" * 64, keys[3]]) == 2
        assert not backend.exists("f" * 64)

        backend.register_mem_pool_host(dst)  # same scope, another pool to read into
        assert backend.batch_get_v1([*keys, "f" * 64], indices([0, 1, 2, 3, 4, 5, 6])) == \
            [True] * 6 + [False]
        for got, want in zip(range(6), (5, 1, 9, 2, 7, 3)):
            assert page_bytes(dst, got * PAGE) == page_bytes(src, want * PAGE)
        flats = backend.batch_get(keys[:3], [dst.get_dummy_flat_data_page() for _ in range(3)])
        for page, want in zip(flats, (5, 1, 9)):
            assert page is not None
            assert bytes(page.view(torch.uint8).numpy()) == page_bytes(src, want * PAGE)
        one = backend.get(keys[4], dst.get_dummy_flat_data_page())
        assert one is not None and bytes(one.view(torch.uint8).numpy()) == page_bytes(src, 7 * PAGE)
        fresh = backend.get(keys[5])  # no target: a new flat page
        assert fresh is not None and bytes(fresh.view(torch.uint8).numpy()) == \
            page_bytes(src, 3 * PAGE)
        assert backend.get("f" * 64, dst.get_dummy_flat_data_page()) is None
        dst.set_from_flat_data_page(10 * PAGE, flats[0])  # SGLang's own scatter agrees
        assert page_bytes(dst, 10 * PAGE) == page_bytes(src, 5 * PAGE)
    finally:
        backend.close()


def test_v1_calls_read_and_write_pool_memory_directly(tmp_path: Path) -> None:
    """Zero copy: the blocks put are views of the pool, and gets fill the pool in place."""
    pool = MHAPool("page_first")
    fill(pool, 2)
    backend = make_backend(tmp_path, pool)
    base = pool.kv_buffer.untyped_storage().data_ptr()
    seen: list[list[torch.Tensor]] = []
    put_many, get_many = backend.store.put_many, backend.store.get_many

    def spy_put(keys: Any, values: Any, **kw: Any) -> Any:
        seen.append(list(values))
        return put_many(keys, values, **kw)

    def spy_get(keys: Any, out: Any = None) -> Any:
        seen.append(list(out))
        return get_many(keys, out)

    backend.store.put_many = spy_put  # type: ignore[method-assign]
    backend.store.get_many = spy_get  # type: ignore[method-assign]
    try:
        assert backend.batch_set_v1(hashes(3), indices([0, 1, 2])) == [True] * 3
        before = page_bytes(pool, 0)
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(hashes(3), indices([0, 1, 2])) == [True] * 3
        assert page_bytes(pool, 0) == before
    finally:
        backend.close()
    assert len(seen) == 2 and len(seen[0]) == 6  # one put_many: K and V of 3 pages
    for tensors in seen:
        for t in tensors:
            assert t.untyped_storage().data_ptr() == base and t.is_contiguous()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_restart_persistence(tmp_path: Path, kind: str) -> None:
    pool = new_pool(kind, "page_first")
    fill(pool, 3)
    backend = make_backend(tmp_path, pool, mla=kind == "mla")
    assert backend.batch_set_v1(hashes(4), indices([0, 1, 2, 3])) == [True] * 4
    backend.close()
    backend.close()  # idempotent
    other = new_pool(kind, "page_first")
    backend = make_backend(tmp_path, other, mla=kind == "mla")
    try:
        assert backend.batch_exists(hashes(4)) == 4
        assert backend.batch_get_v1(hashes(4), indices([0, 1, 2, 3])) == [True] * 4
        assert all(page_bytes(other, p * PAGE) == page_bytes(pool, p * PAGE) for p in range(4))
    finally:
        backend.close()


def test_a_corrupted_page_is_a_miss(tmp_path: Path) -> None:
    pool = MHAPool("page_first")
    fill(pool, 4)
    backend = make_backend(tmp_path, pool)
    keys = hashes(3)
    assert backend.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    v_of_page_1 = backend._keys([keys[1]])[1]
    entry = parts(backend.store.store).index.get_entries([v_of_page_1])[0]
    backend.close()
    assert entry is not None
    flip_payload_bit(tmp_path, entry)
    dst = MHAPool("page_first")
    backend = make_backend(tmp_path, dst)
    try:
        assert backend.batch_get_v1(keys, indices([0, 1, 2])) == [True, False, True]
        stats = backend.get_stats().kvstore
        assert stats["corrupt_blocks"] == 1 and stats["quarantined_blocks"] == 1
        assert backend.batch_exists(keys) == 1  # the chain now ends before page 1
        assert page_bytes(dst, 0) == page_bytes(pool, 0)
        assert page_bytes(dst, 2 * PAGE) == page_bytes(pool, 2 * PAGE)
        assert backend.batch_get(keys[1:2], [dst.get_dummy_flat_data_page()]) == [None]
    finally:
        backend.close()


def test_two_models_in_one_directory_never_hit_each_other(tmp_path: Path) -> None:
    pool = MHAPool("page_first")
    fill(pool, 5)
    keys = hashes(4)
    a = make_backend(tmp_path, pool, model="org/model-a")
    assert a.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    a.close()
    b = make_backend(tmp_path, MHAPool("page_first"), model="org/model-b")
    try:
        assert b.batch_exists(keys) == 0 and not b.exists(keys[0])
        assert b.batch_get_v1(keys, indices([0, 1, 2, 3])) == [False] * 4
        assert b.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4  # its own pages
    finally:
        b.close()
    # the same model under another layout, dtype, codec or TP shard: apart too
    others: list[tuple[MHAPool, dict[str, Any]]] = [
        (MHAPool("layer_first"), {}),
        (MHAPool("page_first", torch.float16), {}),
        (MHAPool("page_first"), {"codec": "zstd"}),
        (MHAPool("page_first"), {"cache_salt": "tenant-2"})]
    for pool2, options in others:
        c = make_backend(tmp_path, pool2, model="org/model-a", **options)
        try:
            assert c.batch_exists(keys) == 0
        finally:
            c.close()
    a = make_backend(tmp_path, MHAPool("page_first"), model="org/model-a")
    try:
        assert a.batch_exists(keys) == 4
    finally:
        a.close()


def test_batches_use_one_put_many_and_chain_across_batches(tmp_path: Path) -> None:
    pool = MHAPool("page_first")
    fill(pool, 6)
    backend = make_backend(tmp_path, pool)
    keys = hashes(8)
    try:
        before = backend.store.stats().puts
        assert backend.batch_set_v1(keys[:4], indices([0, 1, 2, 3])) == [True] * 4
        info = HiCacheStorageExtraInfo(prefix_keys=keys[:4])
        assert backend.batch_set_v1(keys[4:], indices([4, 5, 6, 7]), info) == [True] * 4
        assert backend.store.stats().puts == before + 2
        store_keys = backend._keys(keys)
        entries = parts(backend.store.store).index.get_entries(store_keys)
        parents = [e.parent if e is not None else b"?" for e in entries]
        assert parents == [None, *store_keys[:-1]]  # K0 <- V0 <- K1 ... across batches
        again = backend.store.stats().put_blocks
        assert backend.batch_set_v1(keys[:4], indices([0, 1, 2, 3])) == [True] * 4
        assert backend.store.stats().put_blocks == again  # stored already: nothing written
    finally:
        backend.close()


def test_get_stats_and_clear(tmp_path: Path) -> None:
    pool = MHAPool("page_first")
    fill(pool, 7)
    backend = make_backend(tmp_path, pool)
    keys = hashes(3)
    try:
        backend.batch_set_v1(keys, indices([0, 1, 2]))
        backend.batch_get_v1(keys, indices([3, 4, 5]))
        stats = backend.get_stats()
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
        assert stats.kvstore["blocks"] == 6 and stats.kvstore["hits"] >= 6
        assert backend.get_stats().backup_pgs == []  # taken since the last call
        assert backend.clear() is True
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys[:1], indices([0])) == [True]
    finally:
        backend.close()
    backend = make_backend(tmp_path, MHAPool("page_first"))
    try:  # cleared stays cleared after a restart; what came after is there
        assert backend.batch_exists(keys) == 1
    finally:
        backend.close()


def test_unsupported_set_ups_fail_clearly(tmp_path: Path) -> None:
    config = storage_config({**DYNAMIC, "path": str(tmp_path)}, model="")
    with pytest.raises(ValueError, match='set "model"'):
        KVStoreHiCache(config)
    backend = KVStoreHiCache(storage_config({**DYNAMIC, "path": str(tmp_path), **SMALL}))
    try:
        with pytest.raises(RuntimeError, match="no host pool registered"):
            backend.batch_exists(hashes(1))
        pool = MHAPool("page_first")
        pool.layout = "page_unified"
        with pytest.raises(NotImplementedError, match="page_unified"):
            backend.register_mem_pool_host(pool)
    finally:
        backend.close()


def test_tp_ranks_get_directories_of_their_own(tmp_path: Path) -> None:
    extra = {**DYNAMIC, "path": str(tmp_path), **SMALL}
    ranks = [KVStoreHiCache(storage_config(extra, tp_rank=r, tp_size=2)) for r in range(2)]
    try:  # both open at once: a store directory is one process's
        assert [b.path for b in ranks] == [str(tmp_path / "tp0of2"), str(tmp_path / "tp1of2")]
    finally:
        for b in ranks:
            b.close()


def _rank_backend(path: Path, pool: Any, *, mla: bool = False, tp_rank: int = 0,
                  tp_size: int = 1, dp_rank: int = 0) -> KVStoreHiCache:
    """One SGLang rank process's backend (all of them in this process: one store
    directory shared by several backends, as by several processes)."""
    config = storage_config({**DYNAMIC, "path": str(path), **SMALL}, mla=mla,
                            tp_rank=tp_rank, tp_size=tp_size)
    config.dp_rank = dp_rank  # type: ignore[attr-defined]  (SGLang's DP attention rank)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    assert isinstance(backend, KVStoreHiCache)
    return backend


@pytest.mark.parametrize("how", ["mla tp=2", "dp attention", "two servers"])
def test_ranks_that_hold_the_same_kv_share_one_store(tmp_path: Path, how: str) -> None:
    """MLA with TP 2: SGLang writes a page from rank 0 only and every rank reads it;
    DP-attention ranks, and two servers on one path, hit each other's pages."""
    mla = how == "mla tp=2"
    kind = "mla" if mla else "mha"
    writer_pool, reader_pool = new_pool(kind, "page_first"), new_pool(kind, "page_first")
    fill(writer_pool, 11)
    reader_args = ({"tp_rank": 1, "tp_size": 2} if mla
                   else {"dp_rank": 1} if how == "dp attention" else {})
    writer = _rank_backend(tmp_path, writer_pool, mla=mla, tp_size=2 if mla else 1)
    reader = _rank_backend(tmp_path, reader_pool, mla=mla, **reader_args)
    try:
        assert writer.path == reader.path == str(tmp_path)
        assert writer.batch_set_v1(hashes(4), indices([0, 1, 2, 3])) == [True] * 4
        assert reader.batch_exists(hashes(4)) == 4  # at its next lookup
        assert reader.batch_get_v1(hashes(4), indices([4, 5, 6, 7])) == [True] * 4
        assert all(page_bytes(reader_pool, (4 + p) * PAGE) == page_bytes(writer_pool, p * PAGE)
                   for p in range(4))
    finally:
        writer.close()
        reader.close()


def test_concurrent_calls_from_threads(tmp_path: Path) -> None:
    pool = MHAPool("page_first")
    fill(pool, 8)
    backend = make_backend(tmp_path, pool)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work(t: int) -> None:
        try:
            start.wait()
            keys = hashes(4, tag=f"{t}")
            pages = [(t * 4 + i) % (SIZE // PAGE) for i in range(4)]
            for _ in range(3):
                assert backend.batch_set_v1(keys, indices(pages)) == [True] * 4
                assert backend.batch_exists(keys) == 4
                flats = backend.batch_get(keys, [pool.get_dummy_flat_data_page()
                                                 for _ in keys])
                for f, p in zip(flats, pages):
                    assert f is not None
                    assert bytes(f.view(torch.uint8).numpy()) == page_bytes(pool, p * PAGE)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    backend.close()
    assert not errors, errors
    with pytest.raises(Exception, match="closed"):
        backend.batch_exists(hashes(1))


def test_sglang_failure_injector_wraps_the_backend(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's HiCacheStorageFailureInjector, switched on as its tests do (environment),
    around this backend: injected failures are reported as failures, and every page a
    call reports as read holds the bytes that were written."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    pool = MHAPool("page_first")
    fill(pool, 9)
    extra = {**DYNAMIC, "path": str(tmp_path), **SMALL}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    assert isinstance(backend, HiCacheStorageFailureInjector)
    backend.register_mem_pool_host(pool)
    dst = MHAPool("page_first")
    try:
        stored: set[int] = set()
        for round_ in range(12):
            keys = hashes(4, tag=f"{round_ % 3}")
            if all(backend.batch_set_v1(keys, indices([0, 1, 2, 3]))):
                stored.add(round_ % 3)
            hit = backend.batch_exists(keys)
            assert hit in (0, 4) if round_ % 3 in stored else hit == 0
            backend.register_mem_pool_host(dst)
            got = backend.batch_get_v1(keys, indices([0, 1, 2, 3]))
            backend.register_mem_pool_host(pool)
            for i, ok in enumerate(got):
                if ok:
                    assert page_bytes(dst, i * PAGE) == page_bytes(pool, i * PAGE)
        assert stored  # 12 rounds at p=0.3: some saves went through
        assert isinstance(backend.get_stats().kvstore, dict)
    finally:
        backend.close()


def test_batches_without_prefix_keys_continue_their_own_threads_full_batch(
        tmp_path: Path) -> None:
    """SGLang's defaults (no prefix keys): a batch that follows a full 128-page batch on
    the same thread continues its chain (SGLang cuts only an operation's last batch
    short), whatever other threads write in between; a short batch ends it."""
    pool = MHAPool("page_first")
    fill(pool, 10)
    backend = make_backend(tmp_path, pool)
    none = HiCacheStorageExtraInfo(prefix_keys=None)
    a, b = hashes(131, tag="a"), hashes(3, tag="b")
    pages = [i % (SIZE // PAGE) for i in range(128)]
    a_full, b_done = threading.Event(), threading.Event()
    results: dict[str, list[bool]] = {}

    def thread_a() -> None:
        try:
            results["a1"] = backend.batch_set_v1(a[:128], indices(pages), none)
        finally:  # a failure ends the test, never hangs it
            a_full.set()
        b_done.wait()
        results["a2"] = backend.batch_set_v1(a[128:130], indices([0, 1]), none)
        results["a3"] = backend.batch_set_v1(a[130:], indices([2]), none)  # after a short one

    def thread_b() -> None:
        a_full.wait()
        try:
            results["b"] = backend.batch_set_v1(b, indices([3, 4, 5]), none)
        finally:
            b_done.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert all(all(ok) for ok in results.values()) and len(results) == 4
        keys_a, keys_b = backend._keys(a), backend._keys(b)
        index = parts(backend.store.store).index
        parents = [e.parent if e is not None else b"?" for e in index.get_entries(keys_a)]
        assert parents[:260] == [None, *keys_a[:259]]  # one chain across both batches
        assert parents[260] is None  # the batch after a short one begins another
        assert index.get_entries(keys_b[:1])[0].parent is None  # not after a's batch
        assert backend.batch_exists(a) == 131
    finally:
        backend.close()
