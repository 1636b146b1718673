"""The data mover: paged KV blocks between an engine's per-layer cache tensors and
page-locked staging, layer by layer, on streams of kvstore's own, never blocking the
host on the GPU.  Independent of any engine: the vLLM connector
(:mod:`kvstore.integrations.vllm.worker.side`) and the GPU checks (``tests/gpu``) use it.

Save (per engine step)::

    batch = mover.begin_save(block_ids)        # staging for n blocks, or None: dropped
    for each layer l, once the engine wrote it:
        mover.save_layer(batch, l)             # enqueue only
    mover.end_save(batch)                      # arms the copy-done notice
    await batch.wait()                         # on the store's event loop (eventfd)
    store.put_many(keys, batch.blocks())       # or batch.payloads() with an FP8 codec
    batch.release()

``save_layer`` records an event on the compute stream (after the layer's KV write),
makes the save stream wait for it (a GPU-side wait), gathers the layer's blocks into a
device scratch of one layer (HBM to HBM, the gather kernel) and copies that scratch with
one DMA (``cudaMemcpy2DAsync``) into the block-major page-locked staging: block ``i`` is
``[num_layers, *per_block]`` contiguous, one kvstore block.  No pageable memory, no host
copy: the store writes the staged block (its CRC32C pass copies it into the I/O arena).

With an FP8 codec the layers are gathered into a device scratch of whole blocks
instead; ``end_save`` quantises each block there (``cuda_ext/fp8.cu``, the codec's
algorithm) and copies only the FP8 payload (header space, scales, codes) and the status
word to staging: half the bytes over PCIe.  ``batch.payloads()`` are then byte-identical
to :func:`kvstore.codecs.pipeline.encode` of the same block (a block the codec would store
losslessly is copied raw and encoded on the host, as the codec does).

Load (per step)::

    batch = mover.begin_load(n)                 # staging, or None
    store.get_many(keys, out=batch.blocks())    # NVMe -> staging
    mover.load(batch, block_ids)                # per layer: DMA in, scatter, event
    mover.wait_layer(l)                         # compute stream waits (GPU side)
    batch.release()                             # deferred to its copy-done notice

Completion is awaited through :class:`kvstore.cuda.device.Notice` (a stream callback
writing an eventfd), never by a host thread blocking in CUDA.  Staging is bounded
(:class:`kvstore.cuda.staging.StagingPool`): a save that finds no room is dropped and
counted, and ``max_save_bytes_per_s`` caps the copy-out rate (token bucket, one second
of burst) so that saves leave PCIe bandwidth to loads; a save over the cap is dropped
too, and ``max_save_bytes_per_batch`` caps one save (a step's) the same way.  A lease is never reused before its copy-done notice fired, whatever the caller
does (``release`` early, a cancelled wait, an abort): :meth:`Mover.reap` hands it back
then.

CUDA graphs: while the compute stream captures one (torch's
``is_current_stream_capturing``; kvstore's library has no capture query), the mover
enqueues nothing into it: a save is skipped and counted (``capture_skipped_saves``,
``SaveBatch.skipped``), a load is refused with :class:`CaptureError`.

On CPU tensors (a CPU engine) the same calls run plain copies (torch's
``index_select``/``index_copy_``), with no stream or event; everything is done when the
call returns.

Layout: this module is the facade; the save side is :mod:`kvstore.cuda.copy_out`, the
load side :mod:`kvstore.cuda.copy_in`, the batches :mod:`kvstore.cuda.batches`, what both sides
share (geometry, streams, lock, counters, the CPU path's copy) :mod:`kvstore.cuda.mover_core`,
and the backpressure (leases held until their copies ended, the rate cap)
:mod:`kvstore.cuda.backpressure`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvstore.codecs.pipeline import CodecSpec
from kvstore.cuda import paged
from kvstore.cuda._lib import Library
from kvstore.cuda.batches import LoadBatch, SaveBatch
from kvstore.cuda.copy_in import CopyIn
from kvstore.cuda.copy_out import CopyOut
from kvstore.cuda.mover_core import CaptureError, MoverCore, MoverStats
from kvstore.cuda.staging import DeviceStagingPool, StagingPool

__all__ = ["CaptureError", "LoadBatch", "Mover", "MoverStats", "SaveBatch"]


class Mover:
    """Moves blocks of ``layers`` (one cache tensor per layer, all alike, ``layout`` as in
    :mod:`kvstore.cuda.paged`) through ``staging_bytes`` of page-locked staging for saves
    and ``load_staging_bytes`` (default: as many) for loads.

    ``device_loads``: on the GPU path, loads stage in device memory (reads land there from
    the store's arena with no host copy; it takes ``load_staging_bytes`` of the GPU's
    memory).  ``codec``: an FP8 ``CodecSpec`` quantises saves on the GPU.  ``lib``: the CUDA
    library (default: the process's, when the layers are on a CUDA device and it is
    usable; else the CPU path).  ``compute_stream``: the engine's stream as an int
    (default: torch's current stream of the layers' device); ``capturing``: whether it
    captures a CUDA graph now (default: torch's query of its current stream).
    ``max_save_bytes_per_s`` / ``max_save_bytes_per_batch``: caps on the copy-out
    (bytes moved device -> host; a save over either is dropped whole, counted).

    A facade: :attr:`copy_out` (:class:`kvstore.cuda.copy_out.CopyOut`) and
    :attr:`copy_in` (:class:`kvstore.cuda.copy_in.CopyIn`) do the work, on one shared
    :class:`kvstore.cuda.mover_core.MoverCore`.
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: paged.Layout, *,
                 staging_bytes: int, load_staging_bytes: int | None = None,
                 device_loads: bool = False, codec: CodecSpec | None = None,
                 max_save_bytes_per_s: float | None = None,
                 max_save_bytes_per_batch: int | None = None, lib: Library | None = None,
                 compute_stream: Callable[[], int] | None = None,
                 capturing: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        core = self._core = MoverCore(layers, layout, codec=codec, lib=lib,
                                      compute_stream=compute_stream, capturing=capturing)
        self.layers, self.layout, self.dtype = core.layers, core.layout, core.dtype
        self.num_layers, self.num_blocks = core.num_layers, core.num_blocks
        self.block_shape, self.layer_bytes = core.block_shape, core.layer_bytes
        self.block_bytes, self.cuda, self.codec = core.block_bytes, core.cuda, core.codec
        self.closed = False
        pools: list[StagingPool | DeviceStagingPool] = []
        try:
            with core.on_device():
                # Saves and loads each have their own staging: saves that pile up (a
                # slow disk) are dropped, and never take the room a load needs.
                self.pool = StagingPool(staging_bytes, core.lib)
                pools.append(self.pool)
                # device_loads (GPU path): loads stage in device memory, the store's
                # reads go there straight from its page-locked arena (one DMA, an FP8
                # block dequantised there), no host copy, at the price of that much
                # device memory; else page-locked host memory, like the saves'.
                self.load_pool: StagingPool | DeviceStagingPool = \
                    DeviceStagingPool(load_staging_bytes or staging_bytes, core.layers[0]) \
                    if core.lib is not None and device_loads else \
                    StagingPool(load_staging_bytes or staging_bytes, core.lib,
                                owner="kvstore data mover (loads)")
                pools.append(self.load_pool)
                if core.cuda:
                    core.setup_device()
                    self.save_stream, self.load_stream = core.save_stream, core.load_stream
                self.copy_out = CopyOut(core, self.pool,
                                        max_save_bytes_per_s=max_save_bytes_per_s,
                                        max_save_bytes_per_batch=max_save_bytes_per_batch,
                                        clock=clock)
                self.copy_in = CopyIn(core, self.load_pool)
        except BaseException:
            # (e.g. no device memory for the load staging) nothing stays registered or
            # allocated: the caller may retry with other options
            core.close()
            for p in pools:
                p.close()
            raise
        self.device_loads = isinstance(self.load_pool, DeviceStagingPool)
        self.max_blocks, self.max_load_blocks = self.copy_out.max_blocks, self.copy_in.max_blocks

    # ------------------------------------------------------------------ save

    def stored_bytes(self, n: int) -> int:
        """Staging one save of ``n`` blocks takes."""
        return self.copy_out.stored_bytes(n)

    def copied_bytes(self, n: int) -> int:
        """Bytes one save of ``n`` blocks moves device -> host (what the caps count)."""
        return self.copy_out.copied_bytes(n)

    def capturing(self) -> bool:
        """Whether the compute stream captures a CUDA graph now (GPU path only)."""
        return self._core.capturing()

    def begin_save(self, block_ids: Sequence[int]) -> SaveBatch | None:
        """Staging for a save of ``block_ids`` (cache block numbers), or None: dropped
        (no room now, or over the rate cap) and counted; never waits."""
        return self.copy_out.begin(block_ids)

    def save_layer(self, batch: SaveBatch, layer: int) -> None:
        """Enqueue the copy-out of ``layer``'s blocks, ordered after the work the compute
        stream has queued so far (the layer's KV write).  Returns at once."""
        self.copy_out.save_layer(batch, layer)

    def end_save(self, batch: SaveBatch) -> None:
        """Enqueue what is left (layers not saved yet, FP8 quantisation and its copy-out)
        and arm the batch's copy-done notice.  Returns at once."""
        self.copy_out.end(batch)

    # ------------------------------------------------------------------ load

    def begin_load(self, n: int) -> LoadBatch | None:
        """Staging for ``n`` blocks coming in (``batch.blocks()``), or None (no room)."""
        return self.copy_in.begin(n)

    def load(self, batch: LoadBatch, block_ids: Sequence[int]) -> None:
        """Scatter the first ``len(block_ids)`` staged blocks into the cache at
        ``block_ids``, layer by layer on the load stream, each layer's end recorded for
        :meth:`wait_layer`; then the batch's copy-done notice.  Returns at once (CPU:
        done)."""
        self.copy_in.load(batch, block_ids)

    def load_host(self, blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
        """The CPU path's load from any host tensor ``[n, num_layers, *per_block]``
        (pageable memory cannot be copied asynchronously: refused on the GPU path)."""
        self.copy_in.load_host(blocks, block_ids)

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait (on the GPU) for the loads into ``layer``
        enqueued so far; the host does not wait."""
        self.copy_in.wait_layer(layer)

    def wait_all_layers(self) -> None:
        self.copy_in.wait_all_layers()

    # ------------------------------------------------------------------ life

    def reap(self) -> int:
        """Hand back the leases whose copies completed (non-blocking); how many."""
        return self._core.leases.reap()

    def stats(self) -> MoverStats:
        self.reap()
        s, ls = self.pool.stats(), self.load_pool.stats()
        core = self._core
        with core.lock:
            out = MoverStats(**vars(core.counts))
            out.pending_leases = len(core.leases)
        out.staging_in_use_bytes = s.in_use_bytes + ls.in_use_bytes
        out.staging_peak_bytes = s.peak_bytes
        out.load_staging_bytes = ls.capacity_bytes
        return out

    def close(self) -> None:
        """Wait for the streams (a host wait, at shutdown only), then free everything."""
        if self.closed:
            return
        self.closed = True
        self._core.close()
        self.pool.close()
        self.load_pool.close()
