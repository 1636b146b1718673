"""The v2 (hybrid) calls of the SGLang HiCache backend (:class:`KVStoreHiCache`'s base):
SGLang's ``HybridCacheController`` registers its host pool group and moves the sidecar
pools' pages through them; what is stored and how is :mod:`.sidecars`."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.integrations.sglang.chains import BatchChains
from kvstore.integrations.sglang.sidecars import SidecarPools

__all__ = ["HybridCalls"]

logger = logging.getLogger("kvstore.integrations.sglang")

_P = "kvstore HiCache backend"


class HybridCalls(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no types
    """``register_mem_host_pool_v2``, ``on_host_pools_registered`` and the three v2 calls,
    over the sidecar pools the subclass makes (``_sidecars``), the batch chains it keeps
    (``_chains``) and its KV anchor pool (``_pool``, None until registered)."""

    _sidecars: SidecarPools
    _chains: BatchChains
    _pool: Any

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of SGLang's host pool group (``HybridCacheController``): ``kv`` (the
        anchor), ``mamba`` and ``swa`` are stored (:mod:`.sidecars`); any other is
        refused here, which fails SGLang's attach with the reason."""
        self._sidecars.register(host_pool, host_pool_name, self._pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        """SGLang's pool registration is over: the anchor must be there."""
        if self._pool is None:
            raise RuntimeError(f"{_P}: SGLang registered no KV host pool "
                               "(register_mem_pool_host)")
        logger.info("%s: host pools kv%s", _P,
                    "".join(f", {n}" for n in self._sidecars.names))

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        """The prefix lengths (pages) at which the KV pages and every sidecar page they
        need are stored (``restorable_prefix_pages``); the longest is the hit."""
        return self._sidecars.exists(keys, pool_transfers)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[Any, list[bool]]:
        """Read sidecar pages (verified) into their pools; True per page read."""
        return self._sidecars.get(transfers)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[Any, list[bool]]:
        """Store sidecar pages (one durable ``put_many``); SGLang calls it first in a
        hybrid backup, before the operation's KV batches."""
        self._chains.new_operation()
        return self._sidecars.set(transfers)
