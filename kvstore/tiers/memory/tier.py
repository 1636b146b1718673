"""The host-memory tier of a store (``open(memory_bytes=N)``): serving hits, filling
after verified reads and durable puts, forgetting what left the disk, and prefetching.

:class:`MemoryTier` builds its bounded cache (:class:`kvstore.tiers.memory.cache.
MemoryCache`, in a region page-locked like the staging arena) and puts it to work for
the call paths, which reach it through :class:`kvstore.core.tier_ports.MemoryPort`; it
reaches the store only through the :class:`~kvstore.tiers.host.TierHost` it is handed:

* a get takes its hits with :meth:`MemoryTier.take` in the same step as its index
  lookup (a hit is served only if the index still names the same block, same ``seq``;
  taken hits are marked as read, so they are not evicted until :meth:`release`), copies
  them out with :meth:`copy_out`, and caches what it read from disk with :meth:`fill`;
* a put caches what it made durable (write-through, lossless codecs only);
* a block evicted, quarantined or deleted on disk is dropped with :meth:`forget` (one
  method for the three);
* :meth:`prefetch` starts bringing blocks in from disk (and, with a remote tier, from
  the remote first) in the store's background task group and returns a
  :class:`~kvstore.tiers.memory.prefetch.Prefetch` handle at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import anyio
import torch

from kvstore.codecs import result_buffers
from kvstore.core.tier_ports import Block
from kvstore.disk.format import IndexEntry
from kvstore.io.device_copies import DeviceCopier
from kvstore.io.page_locking import PageLocker
from kvstore.io.transfers import offloaded
from kvstore.tiers.memory.cache import Cached, MemoryCache
from kvstore.tiers.memory.prefetch import Prefetch

if TYPE_CHECKING:
    from kvstore.core.deletes import DeleteWatch
    from kvstore.tiers.host import TierHost

__all__ = ["Hits", "MemoryTier"]

Hits = list[tuple[int, Cached]]  # position in the get, the cached copy (marked as read)


def _device_out(out: torch.Tensor | None) -> bool:
    return out is not None and out.device.type == "cuda" and out.is_contiguous()


class MemoryTier:
    """The memory tier of one open store (see the module docstring); ``close()``
    releases its region."""

    def __init__(self, host: TierHost, nbytes: int, prefetch_share: float,
                 page_lock: bool | None, page_locker: PageLocker) -> None:
        """``nbytes`` of host RAM (``memory_bytes``); prefetched blocks not yet read take
        at most ``prefetch_share`` of it; ``page_lock``: as ``page_lock_staging``, done by
        ``page_locker`` (the store's)."""
        self._host = host
        self._prefetch_share = prefetch_share
        self.cache = MemoryCache(nbytes, host.pinned)
        try:
            # Zero its pages now, off the get path (the first fill of a fresh region ran
            # at page-zeroing speed): it is a cache, it fills anyway.
            self.cache.region.prefault_all()
            # page-locked like the staging arena, so a GPU load from memory goes by DMA
            self._lock = page_locker(self.cache.region, page_lock)
        except BaseException:
            self.cache.close()
            raise
        self.prefetching: dict[bytes, anyio.Event] = {}  # key -> set when its read landed
        self._prefetches: set[Prefetch] = set()

    def close(self) -> None:
        """The region: unregistered from CUDA (if it was page-locked), then unmapped."""
        try:
            self._lock.close()
        finally:
            self.cache.close()

    def stats_fields(self) -> dict[str, int]:
        """Its fields of ``StoreStats``."""
        c = self.cache
        return {"memory_capacity_bytes": c.capacity_bytes, "memory_used_bytes": c.used_bytes,
                "memory_blocks": len(c), "memory_evicted_blocks": c.evicted_blocks}

    # ------------------------------------------------------------------ gets

    def take(self, keys: Sequence[bytes], entries: Sequence[IndexEntry | None]
             ) -> tuple[Hits, list[IndexEntry | None]]:
        """The hits among ``entries`` (marked as read) and the entries left for the
        disk.  No await: call it in the step of the index lookup (a deleted, evicted or
        re-put key is never answered, whichever owner of the store changed it: the copy
        must carry the ``seq`` the index names now).  A copy of a key the index no
        longer holds is dropped (this process's own deletes and evictions drop theirs
        through :meth:`forget`; another process's are found here)."""
        hits: Hits = []
        from_disk = list(entries)
        cache = self.cache
        for i, (key, entry) in enumerate(zip(keys, entries)):
            if entry is None:
                if key in cache:  # another owner deleted or evicted it: the copy is stale
                    cache.discard([key])
            elif cached := cache.lookup(key, entry.seq):  # (another seq: dropped there)
                cache.begin_read(cached)
                hits.append((i, cached))
                from_disk[i] = None
        self._host.count("memory_misses", sum(e is not None for e in from_disk))
        return hits, from_disk

    def release(self, hits: Hits) -> None:
        for _, cached in hits:
            self.cache.end_read(cached)

    async def copy_out(self, hits: Hits, outs: Sequence[torch.Tensor | None],
                       results: list[torch.Tensor | None], copier: DeviceCopier) -> None:
        """Copy taken hits into ``out`` tensors or new ones (recycled memory, as every
        get's new tensors); on a worker thread when large.  A contiguous CUDA ``out``
        gets one copy enqueued from the (page-locked) region on kvstore's copy stream,
        by ``copier`` (the store's), awaited through the eventfd, never a synchronize; the
        hits stay marked as read until it completed."""
        copies = copier.copies() if any(_device_out(outs[i]) for i, _ in hits) else None
        sink = None if copies is None else copies.sink
        on_host: Hits = []
        for i, cached in hits:
            o = outs[i]
            if sink is not None and o is not None and _device_out(o):
                src = cached.view()
                sink.copy(o, src.data_ptr(), cached.nbytes, None)
                results[i] = o
            else:
                on_host.append((i, cached))

        def copy_all() -> None:
            for i, cached in on_host:
                src, o = cached.view(), outs[i]
                if o is None:
                    results[i] = result_buffers.empty(tuple(src.shape), src.dtype).copy_(src)
                else:
                    results[i] = o.copy_(src.reshape(o.shape))

        try:
            await offloaded(sum(c.nbytes for _, c in on_host), copy_all)
        finally:
            if copies:  # (also when cancelled: the GPU reads the region until then)
                with anyio.CancelScope(shield=True):
                    await copies.wait()
        self._host.count("memory_hits", len(hits))
        self._host.count("memory_read_bytes", sum(c.nbytes for _, c in hits))

    # ------------------------------------------------------------------ filling

    def forget(self, keys: Sequence[bytes]) -> None:
        """Blocks evicted, quarantined or deleted on disk: dropped now (their space comes
        back at once), and a fill of them in progress is not published.  A lookup would
        not serve them anyway (their index entries are gone or name another ``seq``)."""
        self.cache.discard(keys)

    async def fill(self, blocks: Sequence[Block], *, prefetched: bool = False,
                   limit: int | None = None) -> int:
        """Cache verified (or just durable) blocks: room is taken on the event loop, the
        bytes copied on a worker thread when large, then published unless a delete or an
        eviction discarded the key meanwhile.  Returns how many were cached."""
        memory = self.cache
        fills = []
        for key, parent, data, dtype, shape, seq in blocks:
            got = memory.reserve(key, data.numel(), () if parent is None else (parent,),
                                 prefetch_limit=limit)
            if got is not None:
                fills.append((got, key, parent, data, dtype, shape, seq))
        if not fills:
            return 0

        def copy_all() -> None:
            for (_, run), _k, _p, data, *_ in fills:
                run.tensor[:data.numel()].copy_(data)

        try:
            await offloaded(sum(f[3].numel() for f in fills), copy_all)
        except BaseException:
            for (token, run), key, *_ in fills:
                memory.abandon(token, run, key)
            raise
        return sum(memory.publish(token, run, key=key, parent=parent, nbytes=data.numel(),
                                  dtype=dtype, shape=shape, seq=seq, prefetched=prefetched)
                   for (token, run), key, parent, data, dtype, shape, seq in fills)

    # ------------------------------------------------------------------ prefetch

    def prefetch_awaited(self) -> AbstractContextManager[None]:
        """A caller waiting for a prefetch: the scheduler lets prefetch reads go meanwhile."""
        return self._host.prefetch_awaited()

    async def landed(self, keys: Sequence[bytes]) -> None:
        """Until the prefetch reads of ``keys`` landed (a get of them then comes from
        memory).  Awaited, the prefetch reads go even while other gets run: a stream of
        them would otherwise hold this get back for as long as it lasted."""
        if not any(k in self.prefetching for k in keys):
            return
        with self.prefetch_awaited():
            for key in keys:
                event = self.prefetching.get(key)
                if event is not None:
                    await event.wait()

    def prefetch(self, keys: list[bytes]) -> Prefetch:
        host = self._host
        want = [k for k in keys if k not in self.cache and k not in self.prefetching]
        handle = Prefetch(len(keys), awaited=self.prefetch_awaited)
        # The promotion starts now, in the caller's view: a delete after this call
        # returned is not undone by it (its fetch runs later, in the background).
        watch = host.watch_deletes(want) if host.has_remote else None
        # (started soon, not now: registered below in this same step)
        if not host.spawn(lambda: self._run_prefetch(handle, want, watch)):
            if watch is not None:
                host.unwatch_deletes(watch)
            raise ValueError("prefetch needs a store opened with kvstore.open() (its "
                             "background task group runs the reads)")
        for key in want:
            self.prefetching[key] = anyio.Event()
        self._prefetches.add(handle)
        return handle

    def cancel_prefetches(self) -> None:
        """Background reads: stopped, not waited out (the store is closing)."""
        for handle in list(self._prefetches):
            handle.cancel()

    async def _run_prefetch(self, handle: Prefetch, keys: list[bytes],
                            watch: DeleteWatch | None) -> None:
        """In the store's task group, as one of its calls (``aclose`` waits for it)."""
        host = self._host
        with handle.running():
            try:
                with host.timed("prefetch"):
                    await anyio.lowlevel.checkpoint()
                    if watch is not None:
                        await host.fetch_missing(keys, watch)
                    with host.read_mark():
                        entries = host.lookup(keys)
                        handle.scheduled = sum(e is not None for e in entries)
                        results: list[torch.Tensor | None] = [None] * len(keys)
                        await host.read_blocks(keys, entries, results)
                    handle.arrived = await self.fill(
                        [(k, e.parent, r.reshape(-1).view(torch.uint8), r.dtype,
                          tuple(r.shape), e.seq) for k, e, r in zip(keys, entries, results)
                         if e is not None and r is not None],
                        prefetched=True,
                        limit=int(self.cache.capacity_bytes * self._prefetch_share))
                    host.count("prefetch_blocks", handle.arrived)
            except Exception as e:  # noqa: BLE001 - handed to whoever awaits the handle
                handle.error = e
            finally:
                if watch is not None:
                    host.unwatch_deletes(watch)
                for key in keys:
                    landed = self.prefetching.pop(key, None)
                    if landed is not None:
                        landed.set()
                self._prefetches.discard(handle)
