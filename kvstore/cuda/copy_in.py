"""The data mover's copy into the GPU, its load side (:mod:`kvstore.cuda.mover`): staged
blocks scattered into the cache layer by layer on the load stream, each layer's end
recorded in an event the compute stream waits on (on the GPU) before attention reads
the layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.cuda import paged
from kvstore.cuda.batches import LoadBatch
from kvstore.cuda.device import Notice
from kvstore.cuda.mover_core import CaptureError, MoverCore
from kvstore.cuda.staging import DeviceStagingPool, StagingPool

__all__ = ["CopyIn"]


class CopyIn:
    """Loads into ``core``'s cache through ``pool`` (page-locked, or device memory on
    the GPU path).  Construct it on the core's device, after ``core.setup_device()``."""

    def __init__(self, core: MoverCore, pool: StagingPool | DeviceStagingPool) -> None:
        self.core = core
        self.pool = pool
        self.max_blocks = pool.capacity // core.block_bytes
        if core.cuda:
            self._events = [core.new_event() for _ in range(core.num_layers)]
            self._unwaited: set[int] = set()   # layers loaded, compute stream not waiting
            # One layer of the largest batch: the scatter's side of the DMA.
            self._scratch = core.malloc(max(self.max_blocks, 1) * core.layer_bytes)

    def _refuse_in_capture(self, what: str) -> None:
        if self.core.capturing():
            raise CaptureError(
                f"kvstore data mover: {what} while the compute stream is capturing a CUDA "
                "graph; its copies and events would be captured into the graph. Load "
                "outside graph capture (the step is run eagerly or the load waits a step)")

    def begin(self, n: int) -> LoadBatch | None:
        """Staging for ``n`` blocks coming in (``batch.blocks()``), or None (no room).
        Raises :class:`CaptureError` while the compute stream captures a CUDA graph."""
        self._refuse_in_capture("a load began")
        if n < 1 or (self.core.cuda and n > self.max_blocks):
            return None
        lease = self.core.take(self.pool, n * self.core.block_bytes)
        return None if lease is None else LoadBatch(self.core, lease, n)

    def _count(self, n: int) -> None:
        core = self.core
        with core.lock:
            core.counts.loads += 1
            core.counts.loaded_blocks += n
            core.counts.copied_in_bytes += n * core.block_bytes

    def load(self, batch: LoadBatch, block_ids: Sequence[int]) -> None:
        """Scatter the first ``len(block_ids)`` staged blocks into the cache at
        ``block_ids``, layer by layer on the load stream, each layer's end recorded for
        :meth:`wait_layer`; then the batch's copy-done notice.  Returns at once (CPU:
        done)."""
        core = self.core
        self._refuse_in_capture("a load was enqueued")
        ids = [int(b) for b in block_ids]
        n = len(ids)
        if n > batch.n:
            raise ValueError(f"{n} block ids for a batch of {batch.n}")
        if len(set(ids)) != n:
            raise ValueError("load block ids must be distinct")
        self._count(n)
        if not n:
            return
        if not core.cuda:
            batch.host_ids = ids
            for layer in range(core.num_layers):
                core.host_copy(ids, layer, False, batch.staged())
            return
        lib = core.lib
        assert lib is not None
        outer, ostride, bstride, inner = core.geometry
        arr = np.asarray(ids, dtype=np.int64)
        core.check_ids(ids)
        stream, layer_bytes = core.load_stream, core.layer_bytes
        with core.lock, core.on_device():
            batch.enqueued = stream
            # The blocks' earlier users on the compute stream come first.
            lib.call("kvc_event_record", core.after_compute, core.compute())
            lib.call("kvc_stream_wait_event", stream, core.after_compute)
            for layer in range(core.num_layers):
                lib.call("kvc_memcpy2d_async", self._scratch.ptr, layer_bytes,
                         batch.lease.address + layer * layer_bytes, core.block_bytes,
                         layer_bytes, n, stream)
                paged.scatter_ptrs(lib, [core.layer_ptrs[layer]], outer, ostride, bstride,
                                   inner, arr, self._scratch.ptr, stream)
                lib.call("kvc_event_record", self._events[layer], stream)
                self._unwaited.add(layer)
            batch.notice = Notice(stream, lib)

    def load_host(self, blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
        """The CPU path's load from any host tensor ``[n, num_layers, *per_block]``
        (pageable memory cannot be copied asynchronously: refused on the GPU path)."""
        core = self.core
        if core.cuda:
            raise ValueError("load_host is the CPU path's; load through begin_load staging")
        ids = [int(b) for b in block_ids]
        self._count(len(ids))
        if len(set(ids)) != len(ids):
            raise ValueError("load block ids must be distinct")
        for layer in range(core.num_layers):
            core.host_copy(ids, layer, False, blocks)

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait (on the GPU) for the loads into ``layer``
        enqueued so far; the host does not wait.  While the compute stream captures a
        CUDA graph this enqueues nothing (a wait on an event recorded outside the
        capture cannot be captured) and raises :class:`CaptureError` if loads into the
        layer are still unwaited; with none, it returns."""
        core = self.core
        if not core.cuda:
            return
        lib = core.lib
        assert lib is not None
        with core.lock:
            if layer not in self._unwaited:
                return
        self._refuse_in_capture(f"layer {layer} was to wait for its loads")
        with core.lock:
            if layer not in self._unwaited:
                return
            self._unwaited.discard(layer)
            with core.on_device():
                lib.call("kvc_stream_wait_event", core.compute(), self._events[layer])

    def wait_all_layers(self) -> None:
        for layer in range(self.core.num_layers):
            self.wait_layer(layer)
