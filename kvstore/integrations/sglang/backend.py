"""kvstore as SGLang HiCache's storage tier (L3): a ``HiCacheStorage`` backend.

Launch (docs/sglang.md)::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
          "class_name": "KVStoreHiCache", "interface_v1": 1,
          "hicache_storage_pass_prefix_keys": true, "path": "/nvme/kvstore"}'

SGLang's factory (``sglang/srt/mem_cache/storage/backend_factory.py``) imports this
module and calls ``KVStoreHiCache(storage_config, kwargs)``; the cache controller then
calls ``register_mem_pool_host(host_pool)``.  With ``"interface_v1": 1`` it uses the
zero-copy ``batch_get_v1`` / ``batch_set_v1`` (pages read into and written from the host
pool's memory), else the older ``batch_get`` / ``batch_set`` of flat page tensors.  Both
store the same bytes, so either reads what the other wrote.

How a page is stored.  One SGLang page (``page_size`` tokens, all layers) of an MHA
model is two kvstore blocks, its K and its V half; of an MLA model, one block.  Each is
a view of the host pool (``get_data_page(index, flat=False)``), contiguous in the
``page_first`` and ``page_first_direct`` layouts, so a put copies it straight into the
store's staging arena and a get reads it straight into the pool (``out=``).  In
``layer_first`` the view is strided (one run per layer): a get still scatters straight
into it, a put gathers it once.  The blocks of consecutive pages form one chain
(``parents``: K0 <- V0 <- K1 <- V1 ...), also across SGLang's 128-page batches
(:mod:`.chains`, with or without SGLang's prefix keys), so eviction never leaves a hole
in a prefix and ``batch_exists`` is one ``match_prefix``.

Hybrid models.  SGLang's ``HybridCacheController`` registers its host pool group with
``register_mem_host_pool_v2`` and moves the sidecar pools' pages (a Mamba state, a
sliding-window KV pool) with ``batch_set_v2`` / ``batch_get_v2`` / ``batch_exists_v2``:
stored beside the KV pages, all or nothing, in :mod:`.sidecars`; a pool it cannot store
is refused when SGLang registers it.

Keys.  SGLang names a page by a hex hash it chains itself over the tokens; each block's
key is that hash (plus ``#k``/``#v``) scoped by a :class:`~kvstore.keys.Namespace`:
the model, the KV dtype, the page size, MHA or MLA, the host layout and a page's
geometry (layers, heads, head dim), the TP rank and size (not for MLA, whose KV every
rank holds), the PP stage, the attention-CP rank, the codec, an optional cache salt and
the ``clear()`` generation.  Two deployments that differ in any of these never read
each other's pages, also from one directory.

Every call blocks the calling SGLang thread, not the event loop: the store runs on its
own loop thread (:func:`kvstore.open_blocking`), and any number of threads may call at
once.  A page that fails its checksum is quarantined and reported as missing (False /
None), never returned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstore.blocking import BlockingStore, open_blocking
from kvstore.errors import KVStoreError
from kvstore.integrations.common.extra_config import store_open_options
from kvstore.integrations.sglang.chains import BatchChains
from kvstore.integrations.sglang.config import BackendConfig, rank_store
from kvstore.integrations.sglang.hybrid import HybridCalls
from kvstore.integrations.sglang.sidecars import PagePort, SidecarPools
from kvstore.integrations.sglang.storage_stats import BatchStats, KVStoreStorageStats
from kvstore.keys import Namespace, chain_parents

__all__ = ["KVStoreHiCache", "KVStoreStorageStats"]

logger = logging.getLogger("kvstore.integrations.sglang")  # the package SGLang loads

_P = "kvstore HiCache backend"
# Layouts whose ``get_data_page(index, flat=False)`` is a view of one page of the pool.
_LAYOUTS = {"layer_first", "page_first", "page_first_direct", "page_head"}
_MARKER_BATCH = 64


class KVStoreHiCache(HybridCalls):
    """SGLang ``HiCacheStorage`` backed by a kvstore store; see the module doc."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.config = BackendConfig.from_extra(storage_config.extra_config)
        self.storage_config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        if getattr(storage_config, "should_split_heads", False):
            raise NotImplementedError(
                f"{_P}: heterogeneous TP (tp_lcm_size, split heads) is not supported")
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise NotImplementedError(f"{_P}: decode context parallel (dcp_size > 1) is not "
                                      "supported")
        self.model = self.config.model or storage_config.model_name
        if not self.model:
            raise ValueError(f'{_P}: no model name: SGLang passed none; set "model" in the '
                             "extra config (it scopes the keys)")
        # this rank's directory and share of the engine's capacity
        self.path, store = rank_store(self.config, storage_config, replicated=self.is_mla)
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        self._lock = threading.Lock()  # guards the scope (clear)
        self._batches = BatchStats()
        self._pool: Any = None
        self._ns: Namespace | None = None
        self._segments = 1 if self.is_mla else 2
        self._seg_shape: tuple[int, ...] = ()
        self._page_bytes = 0
        self._store: BlockingStore = open_blocking(self.path, **store_open_options(store))
        self._chains = BatchChains()
        self._sidecars = SidecarPools(PagePort(
            scope=self._namespace, page_tails=self._page_tails, kv_prefix=self.batch_exists,
            contains=self._store.contains_many, put=self._put, get=self._get))
        logger.info("%s: store %s (engine %s), model %r", _P, self.path,
                    self._store.stats().engine, self.model)

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called by SGLang right after construction: the host pool fixes the key scope
        (dtype, page size, layout, geometry) and the views pages are read and written
        through."""
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in _LAYOUTS:
            raise NotImplementedError(f"{_P}: host pool layout {layout!r} is not supported "
                                      f"(supported: {sorted(_LAYOUTS)})")
        page_size = int(mem_pool_host.page_size)
        view = mem_pool_host.get_data_page(0, flat=False)
        flat = mem_pool_host.get_dummy_flat_data_page()
        segments = self._split_view(view)
        if sum(s.numel() for s in segments) != flat.numel() or view.dtype != flat.dtype:
            raise NotImplementedError(
                f"{_P}: {type(mem_pool_host).__name__}'s page view {tuple(view.shape)} does "
                f"not match its flat page ({flat.numel()} elements)")
        super().register_mem_pool_host(mem_pool_host)
        self._pool = mem_pool_host
        self._seg_shape = tuple(segments[0].shape)
        self._page_bytes = flat.numel() * flat.element_size()
        sc = self.storage_config
        base = Namespace(
            model=self.model, dtype=str(view.dtype).removeprefix("torch."),
            block_size=page_size,
            layout=(f"sglang-hicache;{'mla' if self.is_mla else 'mha'};{layout};"
                    f"segment={'x'.join(map(str, self._seg_shape))}"),
            tp_rank=0 if self.is_mla else sc.tp_rank, tp_size=1 if self.is_mla else sc.tp_size,
            cache_salt=self.config.cache_salt,
            extra=(("pp", f"{sc.pp_rank}/{sc.pp_size}"),
                   ("attn_cp", f"{sc.attn_cp_rank}/{sc.attn_cp_size}"),
                   ("codec", self.config.codec)))
        self._base = base
        generation = self._find_generation()
        with self._lock:
            self._ns = self._scoped(generation)
            self._generation = generation
        if self.config.remote is not None:
            self._store.attach_remote(self.config.remote, self._base)

    def _split_view(self, view: torch.Tensor) -> list[torch.Tensor]:
        if self.is_mla:
            return [view]
        if view.dim() < 1 or view.shape[0] != 2:
            raise NotImplementedError(f"{_P}: an MHA page view of shape {tuple(view.shape)} "
                                      "has no leading K/V axis")
        return [view[0], view[1]]

    def _scoped(self, generation: int) -> Namespace:
        base = self._base
        return Namespace(model=base.model, dtype=base.dtype, block_size=base.block_size,
                         layout=base.layout, tp_rank=base.tp_rank, tp_size=base.tp_size,
                         cache_salt=base.cache_salt,
                         extra=(*base.extra, ("generation", str(generation))))

    def _marker(self, generation: int) -> bytes:
        return self._base.engine_key(f"sglang-hicache-cleared/{generation}".encode())

    def _find_generation(self) -> int:
        """The scope's generation: how many times ``clear()`` ran on this store."""
        generation = 0
        while True:
            markers = [self._marker(generation + i) for i in range(_MARKER_BATCH)]
            present = self._store.contains_many(markers)
            if all(present):
                generation += _MARKER_BATCH
                continue
            return generation + present.index(False)

    def _namespace(self) -> Namespace:
        ns = self._ns
        if ns is None:
            raise RuntimeError(f"{_P}: no host pool registered yet (SGLang calls "
                               "register_mem_pool_host right after creating the backend)")
        return ns

    # ------------------------------------------------------------------ keys

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        """The store keys of pages ``keys``: per page its segments, in chain order."""
        ns = self._namespace()
        if self.is_mla:
            return [ns.engine_key(k.encode()) for k in keys]
        return [ns.engine_key(f"{k}{tag}".encode()) for k in keys for tag in ("#k", "#v")]

    def _page_tails(self, keys: Sequence[str]) -> list[bytes]:
        """The last block (in chain order) of each page: what the next page, or a
        sidecar page of the same hash, follows."""
        return self._keys(keys)[self._segments - 1::self._segments]

    def _put_pages(self, keys: list[str], values: list[torch.Tensor],
                   extra_info: HiCacheStorageExtraInfo | None) -> bool:
        """Put a batch of KV pages as one chain that continues the pages before it
        (``kvstore/integrations/sglang/chains.py``)."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if extra_info is not None and prefix is None:
            self._chains.warn_without_prefix_keys()
        store_keys = self._keys(keys)
        first = self._chains.first_parent(
            self._page_tails(prefix[-1:])[0] if prefix else None, prefix is not None)
        ok = self._put(store_keys, values, chain_parents(store_keys, first))
        self._chains.written(len(keys), store_keys[-1], ok, prefix is not None)
        return ok

    def _page_views(self, host_indices: torch.Tensor, n: int) -> list[torch.Tensor]:
        page_size = self._pool.page_size
        if host_indices.numel() < n * page_size:
            raise ValueError(f"{_P}: {host_indices.numel()} host indices for {n} pages of "
                             f"{page_size} tokens")
        starts = host_indices[:n * page_size:page_size].tolist()
        views: list[torch.Tensor] = []
        for start in starts:
            views.extend(self._split_view(self._pool.get_data_page(int(start), flat=False)))
        return views

    def _flat_segments(self, page: torch.Tensor) -> list[torch.Tensor]:
        """A flat page tensor (the pre-v1 calls) as its segments, views of it."""
        if page.numel() * page.element_size() != self._page_bytes:
            raise ValueError(f"{_P}: a page is {self._page_bytes} bytes, got a tensor of "
                             f"{page.numel() * page.element_size()}")
        return list(page.view(self._segments, -1).unbind(0))

    # ------------------------------------------------------------------ v1 (zero copy)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at ``host_indices`` of the host pool: one durable ``put_many``
        of views of the pool (no intermediate tensor)."""
        if not keys:
            return []
        start = time.perf_counter()
        ok = self._put_pages(keys, self._page_views(host_indices, len(keys)), extra_info)
        if ok and self.enable_metrics:
            self._batches.record(False, len(keys), len(keys) * self._page_bytes,
                                 time.perf_counter() - start)
        return [ok] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices`` (``out=`` views);
        True per page read and verified."""
        if not keys:
            return []
        start = time.perf_counter()
        got = self._get(self._keys(keys), self._page_views(host_indices, len(keys)))
        hits = [all(got[i * self._segments:(i + 1) * self._segments])
                for i in range(len(keys))]
        if self.enable_metrics:
            self._batches.record(True, sum(hits), sum(hits) * self._page_bytes,
                                 time.perf_counter() - start)
        return hits

    # ------------------------------------------------------------------ pre-v1 calls

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """Flat pages, read into ``target_locations`` (SGLang passes the pool's dummy
        flat pages) or into new tensors; ``None`` for a page not stored."""
        if not keys:
            return []
        if target_locations is None:
            pages = [self._pool_required().get_dummy_flat_data_page() for _ in keys]
        else:
            pages = list(target_locations)
        outs = [s for page in pages for s in self._flat_segments(page)]
        got = self._get(self._keys(keys), outs)
        return [page if all(got[i * self._segments:(i + 1) * self._segments]) else None
                for i, page in enumerate(pages)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None
                  ) -> bool:
        """Store flat pages (``get_data_page(index)``) in one durable ``put_many``."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError(f"{_P}: batch_set needs one value per key")
        segments = [s for v in values for s in self._flat_segments(v.reshape(-1))]
        return self._put_pages(keys, segments, None)

    def exists(self, key: str) -> bool:
        return all(self._store.contains_many(self._keys([key])))

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages are stored (one ``match_prefix`` over their blocks)."""
        if not keys:
            return 0
        return int(self._store.match_prefix(self._keys(keys)) // self._segments)

    # ------------------------------------------------------------------ the rest

    def clear(self) -> bool:
        """Forget every page of this scope: later calls use the next generation of the
        key scope (persisted by a pinned marker block), so nothing stored before is hit
        again, also after a restart.  The old pages' space is reclaimed by eviction, as
        the least recently used."""
        self._namespace()
        with self._lock:
            marker = self._marker(self._generation)
            self._store.put_many([marker], [torch.zeros(1, dtype=torch.uint8)])
            self._store.pin([marker])
            self._generation += 1
            self._ns = self._scoped(self._generation)
        logger.info("%s: cleared; key scope generation %d", _P, self._generation)
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per batch since the last call)
        with the store's counters in ``.kvstore`` (:meth:`BatchStats.take`)."""
        return self._batches.take(self._store)

    def close(self) -> None:
        """Close the store (SGLang calls it on detach and shutdown); idempotent.
        Acknowledged pages are durable already; calls in flight are waited for."""
        self._store.close()

    @property
    def store(self) -> BlockingStore:
        """The store behind the backend (tests, tools)."""
        return self._store

    # ------------------------------------------------------------------ helpers

    def _pool_required(self) -> Any:
        self._namespace()
        return self._pool

    def _put(self, keys: list[bytes], values: list[torch.Tensor],
             parents: list[bytes | None]) -> bool:
        try:
            result = self._store.put_many(keys, values, parents=parents,
                                          background=self.config.background_saves)
        except KVStoreError as e:
            logger.warning("%s: saving %d blocks failed: %s", _P, len(keys), e)
            return False
        return result.dropped == 0

    def _get(self, keys: list[bytes], outs: list[torch.Tensor]) -> list[bool]:
        try:
            got = self._store.get_many(keys, out=outs)
        except KVStoreError as e:
            logger.warning("%s: loading %d blocks failed: %s", _P, len(keys), e)
            return [False] * len(keys)
        return [g is not None for g in got]
