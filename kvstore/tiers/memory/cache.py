"""The host-memory tier's cache, :class:`MemoryCache`: verified blocks in one bounded
region of host RAM, in front of the extents (``open(memory_bytes=N)``).  The tier that
puts it to work for the store is :class:`kvstore.tiers.memory.tier.MemoryTier`.

What it holds: the *decoded* bytes a get would return (so a memory hit is one copy,
no decode), with the dtype, shape and index ``seq`` of the entry they came from.  It is
filled by puts once they are durable (write-through: a put is still acknowledged only
when it is on disk; blocks of a lossy codec are not cached by puts, because a get
returns their decoded values, not the caller's) and by gets and prefetches after the
slot was verified.

Never a stale block: the store serves a memory copy only when the index still names the
same block (same ``seq``) at lookup time, so a delete, a disk eviction, a quarantine or
a re-put is never answered from memory even if its ``discard`` has not run yet; the
store also has the tier forget each of those (``MemoryTier.forget``), so the space
comes back at once.

Space: one page-aligned anonymous mapping of ``memory_bytes`` (the staging arena's
allocator: first-fit runs, page-rounded), allocated at open and registered as pinned
memory when the CUDA path is usable, so GPU loads go by DMA.  RSS stays within
``memory_bytes`` plus ~200 bytes of bookkeeping per cached block.  When a block does not
fit, least-recently-used blocks are evicted *leaf first* (a block whose child is cached
stays, as on disk: a cached prefix never loses its head before its tail), never a pinned
block (the store's pins) nor one being copied out or being filled; if that frees too
little the block is simply not cached (the tier is a cache: nothing waits for it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvstore.io.arena import Arena, ArenaRun

PinnedKeys = Callable[[Sequence[bytes]], set[bytes]]


@dataclass(eq=False)
class Cached:
    """One block in memory."""

    key: bytes
    parent: bytes | None
    run: ArenaRun
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    seq: int
    readers: int = 0  # copies out in flight: not evictable, run freed after the last
    dead: bool = False  # discarded while being read: free the run when readers reach 0
    prefetched: bool = False  # brought in by a prefetch and not read by a get since

    def view(self) -> torch.Tensor:
        """The cached bytes as a tensor of the block's dtype and shape (no copy)."""
        return self.run.tensor[:self.nbytes].view(self.dtype).view(self.shape)


class MemoryCache:
    """Bounded cache of verified blocks in host RAM; see the module docstring."""

    def __init__(self, nbytes: int, pinned_keys: PinnedKeys) -> None:
        self.region = Arena(nbytes)
        self.capacity_bytes = self.region.size
        self._pinned_keys = pinned_keys
        self._blocks: OrderedDict[bytes, Cached] = OrderedDict()  # least recently used first
        self._children: Counter[bytes] = Counter()  # cached children per cached parent key
        self._filling: dict[bytes, int] = {}  # key -> fill token (insert in progress)
        self._filling_prefetch: dict[int, int] = {}  # token -> run bytes, prefetch fills
        self._tokens = 0
        self.used_bytes = 0  # run bytes of cached blocks (page-rounded)
        self.prefetched_bytes = 0  # of which brought by prefetch and not read since
        self.evicted_blocks = 0
        self.not_cached = 0  # blocks that found no room (nothing evictable)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: bytes, seq: int) -> Cached | None:
        """The cached copy of the block the index names with ``seq`` (marked used), or
        None.  A copy of another ``seq`` (the key was deleted and put again) is dropped."""
        cached = self._blocks.get(key)
        if cached is None:
            return None
        if cached.seq != seq:
            self.discard([key])
            return None
        self._blocks.move_to_end(key)
        if cached.prefetched:
            cached.prefetched = False
            self.prefetched_bytes -= cached.run.length
        return cached

    def begin_read(self, cached: Cached) -> None:
        cached.readers += 1

    def end_read(self, cached: Cached) -> None:
        cached.readers -= 1
        if cached.dead and not cached.readers:
            self.region.release(cached.run)

    # ------------------------------------------------------------------ filling

    def reserve(self, key: bytes, nbytes: int, protect: Iterable[bytes] = (), *,
                prefetch_limit: int | None = None) -> tuple[int, ArenaRun] | None:
        """Room for ``key`` (evicting if needed), or None if it cannot be cached now.
        ``protect``: keys not to evict for it (the block's parent).  The caller fills
        the run (on any thread) and then calls :meth:`publish` or :meth:`abandon`."""
        if key in self._blocks or key in self._filling or nbytes > self.capacity_bytes:
            return None
        if prefetch_limit is not None and self.prefetched_bytes + \
                sum(self._filling_prefetch.values()) + nbytes > prefetch_limit:
            return None
        run = self.region.try_acquire(nbytes)
        if run is None:
            run = self._evict_for(nbytes, set(protect) | {key})
            if run is None:
                self.not_cached += 1
                return None
        self._tokens += 1
        self._filling[key] = self._tokens
        if prefetch_limit is not None:
            self._filling_prefetch[self._tokens] = run.length
        return self._tokens, run

    def publish(self, token: int, run: ArenaRun, *, key: bytes, parent: bytes | None,
                nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], seq: int,
                prefetched: bool = False) -> bool:
        """Make a filled run visible; False (and the run freed) if the key was discarded
        while it was being filled (a delete or eviction raced the fill)."""
        self._filling_prefetch.pop(token, None)
        if self._filling.get(key) != token:
            self.region.release(run)
            return False
        del self._filling[key]
        self._blocks[key] = Cached(key, parent, run, nbytes, dtype, shape, seq,
                                   prefetched=prefetched)
        self.used_bytes += run.length
        if prefetched:
            self.prefetched_bytes += run.length
        if parent is not None:
            self._children[parent] += 1
        return True

    def abandon(self, token: int, run: ArenaRun, key: bytes) -> None:
        self._filling_prefetch.pop(token, None)
        if self._filling.get(key) == token:
            del self._filling[key]
        self.region.release(run)

    def insert(self, key: bytes, parent: bytes | None, data: torch.Tensor, dtype: torch.dtype,
               shape: tuple[int, ...], seq: int, *, prefetched: bool = False,
               prefetch_limit: int | None = None) -> bool:
        """Copy ``data`` (the block's bytes, flat uint8) in now, on this thread."""
        nbytes = data.numel()
        got = self.reserve(key, nbytes, () if parent is None else (parent,),
                           prefetch_limit=prefetch_limit)
        if got is None:
            return False
        token, run = got
        run.tensor[:nbytes].copy_(data)
        return self.publish(token, run, key=key, parent=parent, nbytes=nbytes, dtype=dtype,
                            shape=shape, seq=seq, prefetched=prefetched)

    # ------------------------------------------------------------------ removal

    def discard(self, keys: Iterable[bytes]) -> int:
        """Drop these keys (deleted, evicted or quarantined on disk, or re-put); fills in
        progress of them are abandoned at publish.  Returns how many were cached."""
        dropped = 0
        for key in keys:
            self._filling.pop(key, None)
            cached = self._blocks.pop(key, None)
            if cached is not None:
                self._drop(cached)
                dropped += 1
        return dropped

    def _drop(self, cached: Cached) -> None:
        self.used_bytes -= cached.run.length
        if cached.prefetched:
            self.prefetched_bytes -= cached.run.length
        if cached.parent is not None:
            self._children[cached.parent] -= 1
            if not self._children[cached.parent]:
                del self._children[cached.parent]
        if cached.readers:
            cached.dead = True  # the last reader frees the run
        else:
            self.region.release(cached.run)

    def _evict_for(self, nbytes: int, protect: set[bytes]) -> ArenaRun | None:
        """Evict least-recently-used leaves (not pinned, not being read, not protected)
        until a run of ``nbytes`` fits; None if the evictable blocks cannot make room."""
        pinned: set[bytes] | None = None
        while True:
            victim = None
            for cached in self._blocks.values():  # least recently used first
                if cached.readers or cached.key in protect or self._children[cached.key]:
                    continue
                if pinned is None:  # one index lookup for every candidate, when needed
                    pinned = self._pinned_keys(list(self._blocks))
                if cached.key in pinned:
                    continue
                victim = cached
                break
            if victim is None:
                return None
            del self._blocks[victim.key]
            self._drop(victim)
            self.evicted_blocks += 1
            run = self.region.try_acquire(nbytes)
            if run is not None:
                return run

    def close(self) -> None:
        self._blocks.clear()
        self._filling.clear()
        self._filling_prefetch.clear()
        self.region.close()
