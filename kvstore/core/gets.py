"""How a get travels (``Store.get_many``; guarantee G2):

1. validate keys and ``out`` tensors; wait only for prefetch reads of these keys;
2. in one step, with no await: look the keys up in the index, take the memory tier's
   hits (served only if the index still names the same block), note what the remote
   tier already holds of the misses, and begin the disk read's epoch;
3. read the rest from disk, verified, quarantining what fails
   (:class:`kvstore.core.reads.VerifiedReads`); copy the memory hits out;
4. remote tier: fetch the local misses, decode them, promote them in the background;
5. cache what came from disk in memory, record last use for eviction, count.

While the get runs, the I/O scheduler holds background writes back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.codecs.tensors import CODE_DTYPES, check_out, check_writable_out

if TYPE_CHECKING:
    from kvstore.core.allocator import Allocator
    from kvstore.core.puts import SlotLimits
    from kvstore.core.reads import VerifiedReads
    from kvstore.core.tier_ports import Tiers
    from kvstore.index.index import Index
    from kvstore.io.device_copies import DeviceCopier

__all__ = ["GetPath"]


class GetPath:
    """The gets of one open store (see the module docstring)."""

    def __init__(self, *, index: Index, allocator: Allocator, limits: SlotLimits,
                 counters: dict[str, int], reads: VerifiedReads, tiers: Tiers,
                 copier: DeviceCopier) -> None:
        self._index, self._allocator, self._limits = index, allocator, limits
        self._reads, self._tiers, self._copier = reads, tiers, copier
        self._counters = counters

    async def get_many(self, keys: list[bytes], out: Sequence[torch.Tensor | None] | None
                       ) -> list[torch.Tensor | None]:
        memory, remote = self._tiers.memory, self._tiers.remote
        outs: list[torch.Tensor | None] = [None] * len(keys) if out is None else list(out)
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} out tensors")
        # This owner's read mark from before the lookup until the disk read ended
        # (kvstore/core/read_marks.py): no owner reuses what it looked up meanwhile.
        with self._reads.marked():
            entries = self._index.get_entries(keys)
            # remote tier: what it holds of the misses, now (a promotion may land meanwhile)
            held = remote.held_blocks(keys, entries) if remote is not None else None
            for entry, o in zip(entries, outs):  # validate before any I/O
                if isinstance(o, torch.Tensor):  # (a local miss may be fetched: checked too)
                    check_writable_out(o)
                if entry is not None:
                    self._limits.check(entry.slot_len)
                if entry is not None and o is not None:
                    check_out(o, entry.dtype,
                              (entry.raw_len // CODE_DTYPES[entry.dtype].itemsize,))
            self._counters["gets"] += 1
            results: list[torch.Tensor | None] = [None] * len(keys)
            hits: Any = None  # the memory tier's, held until released
            from_disk = entries
            if memory is not None:
                hits, from_disk = memory.take(keys, entries)
            try:
                # No await between the lookup above and the read's epoch (begun at the
                # call): a block deleted or evicted after it keeps its space until it ends.
                await self._reads.read(keys, from_disk, outs, results)
                if hits:
                    assert memory is not None
                    await memory.copy_out(hits, outs, results, self._copier)
            finally:
                if memory is not None and hits is not None:
                    memory.release(hits)
        if remote is not None:  # local misses, fetched and promoted
            assert held is not None
            await remote.fill_misses(keys, outs, results, held)
        if memory is not None:
            # Only blocks read into new tensors: they carry the stored shape (an ``out``
            # tensor has the caller's) and live on the CPU.
            await memory.fill([
                (keys[i], e.parent, r.reshape(-1).view(torch.uint8), r.dtype,
                 tuple(r.shape), e.seq)
                for i, (e, r) in enumerate(zip(from_disk, results))
                if e is not None and r is not None and outs[i] is None])
        self._allocator.touch((k for k, r in zip(keys, results) if r is not None),
                              time.time_ns() // 1000)
        hits_n = sum(r is not None for r in results)
        self._counters["hits"] += hits_n
        self._counters["misses"] += len(keys) - hits_n
        return results
