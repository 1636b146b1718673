"""The memory tier's room in a store: serving hits, filling after verified reads and
durable puts, and prefetching (``open(memory_bytes=N)``).

:class:`MemoryRoom` puts :class:`kvstore.tiers.memory.tier.MemoryTier` (the bounded cache
itself) to work for the call paths:

* a get takes its hits with :meth:`MemoryRoom.take` in the same step as its index
  lookup (a hit is served only if the index still names the same block, same ``seq``;
  taken hits are marked as read, so they are not evicted until :meth:`release`), copies
  them out with :meth:`copy_out`, and caches what it read from disk with :meth:`fill`;
* a put caches what it made durable (write-through, lossless codecs only);
* :meth:`prefetch` starts bringing blocks in from disk (and, with a remote tier, from
  the remote first) in the store's background task group and returns a
  :class:`~kvstore.tiers.memory.prefetch.Prefetch` handle at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

import anyio
import torch

from kvstore.codecs import result_buffers
from kvstore.disk.format import IndexEntry
from kvstore.io.device_copies import DeviceCopier
from kvstore.io.transfers import offloaded
from kvstore.tiers.memory.prefetch import Prefetch
from kvstore.tiers.memory.tier import Cached, MemoryTier

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvstore.core.deletes import DeleteWatch
    from kvstore.core.latency import Latency
    from kvstore.core.operations import Operations
    from kvstore.core.reads import VerifiedReads
    from kvstore.index.index import Index
    from kvstore.io.scheduler import IoScheduler

__all__ = ["Block", "Hits", "MemoryRoom"]

# key, parent, bytes (uint8, CPU), dtype, shape, index seq
Block = tuple[bytes, "bytes | None", torch.Tensor, torch.dtype, tuple[int, ...], int]
Hits = list[tuple[int, Cached]]  # position in the get, the cached copy (marked as read)


class MissingBlocks(Protocol):
    """What a prefetch asks of the remote tier (:class:`kvstore.tiers.remote.adapter.
    RemoteAdapter`): a watch of deletes taken when the prefetch is asked for, and the
    fetch and promotion of the blocks absent locally, under it."""

    def watch_deletes(self, keys: Sequence[bytes]) -> DeleteWatch: ...

    def unwatch_deletes(self, watch: DeleteWatch) -> None: ...

    async def fetch_missing(self, keys: Sequence[bytes], since: DeleteWatch) -> None: ...


def _device_out(out: torch.Tensor | None) -> bool:
    return out is not None and out.device.type == "cuda" and out.is_contiguous()


class MemoryRoom:
    """The memory tier of one open store (see the module docstring)."""

    def __init__(self, memory: MemoryTier, *, index: Index, reads: VerifiedReads,
                 counters: dict[str, int], ops: Operations, latency: Latency,
                 scheduler: IoScheduler | None, prefetch_share: float,
                 task_group: Callable[[], TaskGroup | None]) -> None:
        self.memory = memory
        self._index, self._reads, self._counters = index, reads, counters
        self._ops, self._latency, self._scheduler = ops, latency, scheduler
        self._prefetch_share = prefetch_share
        self._task_group = task_group
        self.prefetching: dict[bytes, anyio.Event] = {}  # key -> set when its read landed
        self._prefetches: set[Prefetch] = set()
        # remote tier: absent blocks fetched and promoted before a prefetch reads them
        self.remote: MissingBlocks | None = None

    # ------------------------------------------------------------------ gets

    def take(self, keys: Sequence[bytes], entries: Sequence[IndexEntry | None]
             ) -> tuple[Hits, list[IndexEntry | None]]:
        """The hits among ``entries`` (marked as read) and the entries left for the
        disk.  No await: call it in the step of the index lookup (a deleted, evicted or
        re-put key is never answered)."""
        hits: Hits = []
        from_disk = list(entries)
        for i, (key, entry) in enumerate(zip(keys, entries)):
            if entry is not None and (cached := self.memory.lookup(key, entry.seq)):
                self.memory.begin_read(cached)
                hits.append((i, cached))
                from_disk[i] = None
        self._counters["memory_misses"] += sum(e is not None for e in from_disk)
        return hits, from_disk

    def release(self, hits: Hits) -> None:
        for _, cached in hits:
            self.memory.end_read(cached)

    async def copy_out(self, hits: Hits, outs: Sequence[torch.Tensor | None],
                       results: list[torch.Tensor | None], copier: DeviceCopier) -> None:
        """Copy taken hits into ``out`` tensors or new ones (recycled memory, as every
        get's new tensors); on a worker thread when large.  A contiguous CUDA ``out``
        gets one copy enqueued from the (page-locked) region on kvstore's copy stream by
        ``copier`` (the store's), awaited through the eventfd, never a synchronize; the
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
        self._counters["memory_hits"] += len(hits)
        self._counters["memory_read_bytes"] += sum(c.nbytes for _, c in hits)

    # ------------------------------------------------------------------ filling

    def forget(self, keys: Sequence[bytes]) -> None:
        self.memory.discard(keys)

    async def fill(self, blocks: Sequence[Block], *, prefetched: bool = False,
                   limit: int | None = None) -> int:
        """Cache verified (or just durable) blocks: room is taken on the event loop, the
        bytes copied on a worker thread when large, then published unless a delete or an
        eviction discarded the key meanwhile.  Returns how many were cached."""
        memory = self.memory
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
        return (self._scheduler.prefetch_awaited() if self._scheduler is not None
                else nullcontext())

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
        group = self._task_group()
        if group is None:
            raise ValueError("prefetch needs a store opened with kvstore.open() (its "
                             "background task group runs the reads)")
        want = [k for k in keys if k not in self.memory and k not in self.prefetching]
        handle = Prefetch(len(keys), awaited=self.prefetch_awaited)
        for key in want:
            self.prefetching[key] = anyio.Event()
        self._prefetches.add(handle)
        # The promotion starts now, in the caller's view: a delete after this call
        # returned is not undone by it (its fetch runs later, in the background).
        watch = self.remote.watch_deletes(want) if self.remote is not None else None
        group.start_soon(self._run_prefetch, handle, want, watch)
        return handle

    def cancel_prefetches(self) -> None:
        """Background reads: stopped, not waited out (the store is closing)."""
        for handle in list(self._prefetches):
            handle.cancel()

    async def _run_prefetch(self, handle: Prefetch, keys: list[bytes],
                            watch: DeleteWatch | None) -> None:
        try:
            with anyio.CancelScope() as scope, self._ops.track(), \
                    self._latency.time("prefetch"):
                handle._scope = scope
                if handle.cancelled:
                    scope.cancel()
                await anyio.lowlevel.checkpoint()
                if self.remote is not None and watch is not None:
                    await self.remote.fetch_missing(keys, watch)
                entries = self._index.get_entries(keys)
                handle.scheduled = sum(e is not None for e in entries)
                results: list[torch.Tensor | None] = [None] * len(keys)
                await self._reads.read(keys, entries, [None] * len(keys), results,
                                       prefetch=True)
                handle.arrived = await self.fill(
                    [(k, e.parent, r.reshape(-1).view(torch.uint8), r.dtype, tuple(r.shape),
                      e.seq) for k, e, r in zip(keys, entries, results)
                     if e is not None and r is not None],
                    prefetched=True,
                    limit=int(self.memory.capacity_bytes * self._prefetch_share))
                self._counters["prefetch_blocks"] += handle.arrived
        except Exception as e:  # noqa: BLE001 - handed to whoever awaits the handle
            handle.error = e
        finally:
            if self.remote is not None and watch is not None:
                self.remote.unwatch_deletes(watch)
            for key in keys:
                landed = self.prefetching.pop(key, None)
                if landed is not None:
                    landed.set()
            self._prefetches.discard(handle)
            handle._finish()
