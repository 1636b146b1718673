"""SGLang's v2 (hybrid) HiCache calls: the sidecar host pools stored beside the KV pages.

A hybrid model's cache in SGLang 0.5.23 is a group of host pools (``HostPoolGroup``): the
KV anchor pool (the full-attention layers, read and written by the v1 calls) and
sidecars: ``mamba`` (``MambaPoolHost``: one recurrent state, SSM and conv, per slot, as
in Qwen3-Next or Nemotron-H) and ``swa`` (an ``MHATokenToKVPoolHost`` over the
sliding-window layers, one page per KV page).  ``HybridCacheController`` registers each
with ``register_mem_host_pool_v2`` and moves their pages with ``batch_set_v2`` /
``batch_get_v2``, asking ``batch_exists_v2`` which prefix lengths every pool can resume
at.  Both sidecars are ``TRAILING_PAGES`` pools: a hit of ``p`` pages needs the KV pages
``[0, p)`` and the sidecar pages ``[p - n, p)`` (``n`` = 1 for the state at ``p``, the
window's pages for SWA).

How a sidecar page is stored.  One kvstore block per page: the pool's flat page
(``get_data_page(index, flat=True)``), read back into ``get_dummy_flat_data_page()`` and
scattered by the pool's own ``set_from_flat_data_page``.  Its key is the KV page's
SGLang hash (the state is keyed by the page it is valid at), the pool's name and the
pool's page signature (:func:`page_signature`: its class, page size, layout and each
tensor's shape and dtype), scoped by the backend's namespace: a restart with another
state shape, state dtype or window layer count reads none of the old sidecar pages.
Its parent is the last block of that KV page, so eviction takes a state or window page
before the KV page it belongs to (a KV page is not a leaf while one is stored): a
stored sidecar page never outlives what it needs.  SGLang writes the sidecars before
the KV pages; a parent need not be stored yet.

All or nothing.  ``batch_exists_v2`` reports only the lengths at which the KV prefix
and every sidecar page the length needs are stored; ``batch_get_v2`` reads each page
verified (CRC32C) and reports a page that fails as not read (and quarantines it).
SGLang then discards the whole prefetch (``UnifiedRadixCache._check_hybrid_prefetch_result``:
SWA and Mamba hits are never partial) and, its failed page no longer stored, the next
query answers a shorter length.  Pools other than ``kv``, ``mamba`` and ``swa`` are
refused when SGLang registers them (the attach fails with the reason), as is any other
hit policy when asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.keys import Namespace

__all__ = ["SIDECARS", "PagePort", "SidecarPools", "page_signature"]

_P = "kvstore HiCache backend"
# The sidecar pools stored (beside ``kv``, the anchor the v1 calls move).
SIDECARS = (PoolName.MAMBA, PoolName.SWA)
_ACCESSORS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")


def _pool_name(name: Any) -> PoolName:
    try:
        return PoolName(name)
    except ValueError:
        raise NotImplementedError(f"{_P}: unknown SGLang host pool {name!r}") from None


def page_signature(pool: Any) -> str:
    """What one page of ``pool`` is made of, without the pool's capacity: its class,
    page size, layout and the shape and dtype of each tensor of a page (a Mamba
    pool's temporal and conv states, an MHA pool's page view), and the flat page's
    length.  Part of every sidecar key."""
    iter_tensors = getattr(pool, "_iter_page_tensors", None)  # MambaPoolHost
    tensors = list(iter_tensors(0)) if callable(iter_tensors) else \
        [pool.get_data_page(0, flat=False)]
    flat = pool.get_dummy_flat_data_page()
    shapes = ",".join(f"{str(t.dtype).removeprefix('torch.')}"
                      f"[{'x'.join(map(str, t.shape))}]" for t in tensors)
    return (f"{type(pool).__name__};page={int(pool.page_size)};"
            f"layout={getattr(pool, 'layout', None)};{shapes};"
            f"flat={str(flat.dtype).removeprefix('torch.')}[{flat.numel()}]")


@dataclass(frozen=True)
class PagePort:
    """What the sidecar pools use of the backend (:class:`KVStoreHiCache`)."""

    scope: Callable[[], Namespace]  # the key scope (clear() moves it)
    page_tails: Callable[[Sequence[str]], list[bytes]]  # last block of each KV page
    kv_prefix: Callable[[list[str]], int]  # leading KV pages stored
    contains: Callable[[list[bytes]], list[bool]]
    put: Callable[[list[bytes], list[torch.Tensor], list[bytes | None]], bool]
    get: Callable[[list[bytes], list[torch.Tensor]], list[bool]]


@dataclass(frozen=True)
class _Sidecar:
    pool: Any
    signature: str


class SidecarPools:
    """The registered sidecar pools and the three v2 calls over them; see the module doc."""

    def __init__(self, port: PagePort) -> None:
        self._port = port
        self._pools: dict[PoolName, _Sidecar] = {}

    @property
    def names(self) -> list[str]:
        return sorted(str(n) for n in self._pools)

    def register(self, pool: Any, name: Any, anchor: Any) -> None:
        """A pool of SGLang's host pool group: ``kv`` must be the anchor pool the v1
        calls use; ``mamba`` and ``swa`` are stored; any other is refused."""
        pool_name = _pool_name(name)
        if pool_name == PoolName.KV:
            if anchor is None or pool is not anchor:
                raise NotImplementedError(
                    f"{_P}: the host pool group's kv pool is not the pool registered with "
                    "register_mem_pool_host (a unified page envelope host is not supported)")
            return
        if pool_name not in SIDECARS:
            raise NotImplementedError(
                f"{_P}: SGLang host pool {str(pool_name)!r} is not supported (supported: kv, "
                f"{', '.join(map(str, SIDECARS))}); the model's cache needs it, so HiCache "
                "storage cannot restore it: run without --hicache-storage-backend")
        missing = [a for a in _ACCESSORS if not callable(getattr(pool, a, None))]
        if missing or int(getattr(pool, "page_size", 0)) < 1:
            raise NotImplementedError(f"{_P}: host pool {str(pool_name)!r} "
                                      f"({type(pool).__name__}) lacks {missing or 'page_size'}")
        self._pools[pool_name] = _Sidecar(pool, page_signature(pool))

    # ------------------------------------------------------------------ the v2 calls

    def set(self, transfers: Sequence[PoolTransfer]) -> dict[Any, list[bool]]:
        """Store every transfer's pages in one durable ``put_many``; True per page
        stored (all or none: a failed put stores nothing of it)."""
        keys: list[bytes] = []
        values: list[torch.Tensor] = []
        parents: list[bytes | None] = []
        for t in transfers:
            side, hashes = self._sidecar(t.name), list(t.keys or ())
            keys += self._keys(t.name, side, hashes)
            values += [side.pool.get_data_page(i, flat=True) for i in self._starts(t, side)]
            parents += self._port.page_tails(hashes)
        ok = self._port.put(keys, values, parents) if keys else True
        return {t.name: [ok] * len(t.keys or ()) for t in transfers}

    def get(self, transfers: Sequence[PoolTransfer]) -> dict[Any, list[bool]]:
        """Read every transfer's pages (verified) into its pool at ``host_indices``;
        True per page read.  A page that fails is left as it was in the pool."""
        plan: list[tuple[PoolTransfer, _Sidecar, list[int], list[torch.Tensor]]] = []
        keys: list[bytes] = []
        for t in transfers:
            side, hashes = self._sidecar(t.name), list(t.keys or ())
            pages = [side.pool.get_dummy_flat_data_page() for _ in hashes]
            plan.append((t, side, self._starts(t, side), pages))
            keys += self._keys(t.name, side, hashes)
        got = self._port.get(keys, [p for *_, pages in plan for p in pages]) if keys else []
        out: dict[Any, list[bool]] = {}
        at = 0
        for t, side, starts, pages in plan:
            ok = got[at:at + len(pages)]
            at += len(pages)
            for start, page, hit in zip(starts, pages, ok):
                if hit:
                    side.pool.set_from_flat_data_page(start, page)
            out[t.name] = ok
        return out

    def exists(self, keys: list[str], transfers: Sequence[PoolTransfer] | None
               ) -> PoolTransferResult:
        """The prefix lengths (pages) at which the KV pages and every transfer's pages
        that length needs are stored; the longest is the hit."""
        kv = self._port.kv_prefix(keys) if keys else 0
        restorable = set(range(1, kv + 1))
        hits: dict[str, int] = {PoolName.KV: kv} if kv else {}
        for t in transfers or ():
            side = self._sidecar(t.name)
            present = self._port.contains(self._keys(t.name, side, keys[:kv])) if kv else []
            ok = _restorable(present, t)
            if ok:
                hits[t.name] = max(ok)
            restorable &= ok
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    def keys(self, name: Any, hashes: Sequence[str]) -> list[bytes]:
        """The store keys of pool ``name``'s pages at SGLang page hashes ``hashes``."""
        return self._keys(name, self._sidecar(name), hashes)

    # ------------------------------------------------------------------ helpers

    def _sidecar(self, name: Any) -> _Sidecar:
        side = self._pools.get(_pool_name(name))
        if side is None:
            raise ValueError(f"{_P}: no {str(name)!r} host pool registered (registered: "
                             f"{self.names}); SGLang registers them when it attaches")
        return side

    def _keys(self, name: Any, side: _Sidecar, hashes: Sequence[str]) -> list[bytes]:
        ns = self._port.scope()
        tag = f"#{_pool_name(name).value}#{side.signature}"
        return [ns.engine_key(f"{h}{tag}".encode()) for h in hashes]

    @staticmethod
    def _starts(t: PoolTransfer, side: _Sidecar) -> list[int]:
        """The first host index of each of the transfer's pages (SGLang's convention:
        ``page_size`` indices per key)."""
        n, size = len(t.keys or ()), int(side.pool.page_size)
        indices = t.host_indices
        if n and (indices is None or indices.numel() != n * size):
            got = 0 if indices is None else indices.numel()
            raise ValueError(f"{_P}: {got} host indices for {n} pages of the {str(t.name)!r} "
                             f"pool ({size} per page)")
        return [] if indices is None else [int(i) for i in indices[::size][:n].tolist()]


def _restorable(present: list[bool], t: PoolTransfer) -> set[int]:
    """Prefix lengths (pages) a pool allows, given which of its pages are stored."""
    if t.hit_policy == PoolHitPolicy.ALL_PAGES:
        lead = present.index(False) if False in present else len(present)
        return set(range(1, lead + 1))
    if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
        need = max(1, len(t.keys or ()))
        ok, run = set(), 0
        for p, here in enumerate(present, start=1):
            run = run + 1 if here else 0
            if run >= min(need, p):  # pages [p - need, p) all stored
                ok.add(p)
        return ok
    policy = getattr(t.hit_policy, "value", t.hit_policy)
    raise NotImplementedError(f"{_P}: hit policy {policy} of the {str(t.name)!r} pool is "
                              "not supported")
