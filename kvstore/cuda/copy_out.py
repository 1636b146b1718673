"""The data mover's copy out of the GPU, its save side (:mod:`kvstore.cuda.mover`): a
step's blocks gathered layer by layer on the save stream into page-locked staging, or,
with an FP8 codec, into whole blocks in device memory that ``end`` quantises, copying
out only the payloads; bounded by the staging and the copy-out rate cap."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore import codecs
from kvstore.cuda import fp8 as gpu_fp8
from kvstore.cuda import paged
from kvstore.cuda._lib import Library
from kvstore.cuda.backpressure import RateCap
from kvstore.cuda.batches import U8, SaveBatch
from kvstore.cuda.device import Notice
from kvstore.cuda.mover_core import MoverCore
from kvstore.cuda.staging import StagingPool

__all__ = ["CopyOut"]

_ALIGN = 16


def _up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


class CopyOut:
    """Saves of ``core``'s blocks through ``pool``; ``max_save_bytes_per_s`` caps the
    copy-out rate and ``max_save_bytes_per_batch`` one save's copy-out (a save over
    either is dropped whole).  Construct it on the core's device."""

    def __init__(self, core: MoverCore, pool: StagingPool, *,
                 max_save_bytes_per_s: float | None = None,
                 max_save_bytes_per_batch: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.pool = pool
        self.rate = RateCap(max_save_bytes_per_s, clock)
        self.max_batch_bytes = max_save_bytes_per_batch
        core.counts.staging_bytes = pool.capacity
        self.max_blocks = pool.capacity // core.block_bytes
        if core.cuda:
            # One layer of the largest batch: the gather's side of the DMA.  Reused by
            # every batch: work on one stream runs in order.
            self._scratch = core.malloc(max(self.max_blocks, 1) * core.layer_bytes)
            if core.fp8:
                self._setup_fp8()

    def _setup_fp8(self) -> None:
        core = self.core
        assert core.codec is not None
        sg = gpu_fp8.scale_groups(core.block_shape, core.codec)
        self._sg = sg
        numel = sg.rows * sg.head_dim
        hdr = gpu_fp8._HDR.size
        # A device record: amax words | status word | payload (header, scales,
        # codes); what is staged: status word | payload.
        self._payload_bytes = hdr + sg.n + numel
        self._scratch_bytes = 4 * sg.n
        self._device_record = _up(self._scratch_bytes + 4 + self._payload_bytes)
        self._record_bytes = _up(4 + self._payload_bytes)
        self.max_fp8_blocks = self.pool.capacity // self._record_bytes
        n_fp8 = max(min(self.max_fp8_blocks, 4 * max(self.max_blocks, 1)), 1)
        self.max_fp8_blocks = min(self.max_fp8_blocks, n_fp8)
        self._fp8_blocks = core.malloc(n_fp8 * core.block_bytes)
        self._fp8_records = core.malloc(n_fp8 * self._device_record)
        rg = core.malloc(sg.row_group.nbytes)
        # Once, at construction (a synchronous upload: never on the step's path).
        rg.upload(sg.row_group, core.save_stream)
        self._row_group = rg

    def stored_bytes(self, n: int) -> int:
        """Staging one save of ``n`` blocks takes."""
        return n * (self._record_bytes if self.core.fp8 else self.core.block_bytes)

    def copied_bytes(self, n: int) -> int:
        """The bytes a save of ``n`` blocks moves device -> host (FP8: status words and
        payloads; what the caps count)."""
        if self.core.fp8:
            return n * (4 + self._payload_bytes)
        return n * self.core.block_bytes

    def begin(self, block_ids: Sequence[int]) -> SaveBatch | None:
        """Staging for a save of ``block_ids`` (cache block numbers), or None: dropped
        (no room now, over a copy-out cap, or the compute stream capturing a CUDA
        graph) and counted; never waits."""
        core = self.core
        ids = [int(b) for b in block_ids]
        core.check_ids(ids)
        n = len(ids)
        if n and core.capturing():
            self._count_capture_skip(n)
            return None
        nbytes = self.stored_bytes(n)
        if n and self.max_batch_bytes is not None and \
                self.copied_bytes(n) > self.max_batch_bytes:
            with core.lock:
                core.counts.rate_dropped_saves += 1
                core.counts.rate_dropped_blocks += n
            return None
        fits_device = not core.cuda or n <= (self.max_fp8_blocks if core.fp8 else
                                             self.max_blocks)
        lease = core.take(self.pool, nbytes) if fits_device and n else None
        if lease is None or not self.rate.allow(self.copied_bytes(n)):
            with core.lock:
                if lease is not None:
                    core.counts.rate_dropped_saves += 1
                    core.counts.rate_dropped_blocks += n
                else:
                    core.counts.dropped_saves += 1
                    core.counts.dropped_blocks += n
            if lease is not None:
                lease.release()
            return None
        with core.lock:
            core.counts.saves += 1
            core.counts.saved_blocks += n
        return SaveBatch(core, lease, ids, self.payloads)

    def _count_capture_skip(self, n: int) -> None:
        with self.core.lock:
            self.core.counts.capture_skipped_saves += 1
            self.core.counts.capture_skipped_blocks += n

    def _skip_in_capture(self, batch: SaveBatch) -> bool:
        """True (and the batch marked skipped, counted once) if the compute stream is
        capturing a CUDA graph: nothing of the batch may be enqueued then (a copy-out in
        a graph would run at every replay, into staging long handed back); the batch
        ends incomplete and its caller drops it."""
        if batch.skipped:
            return True
        if not self.core.capturing():
            return False
        batch.skipped = True
        self._count_capture_skip(batch.n)
        return True

    def save_layer(self, batch: SaveBatch, layer: int) -> None:
        """Enqueue the copy-out of ``layer``'s blocks, ordered after the work the compute
        stream has queued so far (the layer's KV write).  Returns at once.  Nothing is
        enqueued while the compute stream captures a CUDA graph (``batch.skipped``)."""
        if batch.ended or layer in batch.layers_done or self._skip_in_capture(batch):
            return
        batch.layers_done.add(layer)
        core = self.core
        if not core.cuda:
            core.host_copy(batch.host_ids, layer, True, batch.staged())
            return
        lib = core.lib
        assert lib is not None
        outer, ostride, bstride, inner = core.geometry
        ids = np.asarray(batch.block_ids, dtype=np.int64)
        stream, layer_bytes = core.save_stream, core.layer_bytes
        with core.lock, core.on_device():
            # The save stream starts on this layer once the compute stream got here.
            lib.call("kvc_event_record", core.after_compute, core.compute())
            lib.call("kvc_stream_wait_event", stream, core.after_compute)
            paged.gather_ptrs(lib, [core.layer_ptrs[layer]], outer, ostride, bstride, inner,
                              ids, self._scratch.ptr, stream)
            if core.fp8:   # into the whole-block device scratch; quantised in end
                dst = self._fp8_blocks.ptr + layer * layer_bytes
            else:          # one DMA into the block-major page-locked staging
                dst = batch.lease.address + layer * layer_bytes
                core.counts.copied_out_bytes += batch.n * layer_bytes
            lib.call("kvc_memcpy2d_async", dst, core.block_bytes, self._scratch.ptr,
                     layer_bytes, layer_bytes, batch.n, stream)
            batch.enqueued = stream

    def end(self, batch: SaveBatch) -> None:
        """Enqueue what is left (layers not saved yet, FP8 quantisation and its copy-out)
        and arm the batch's copy-done notice.  Returns at once.  A batch skipped for a
        CUDA graph capture (``batch.skipped``, now or at an earlier layer) enqueues
        nothing more: the caller drops it (``release``)."""
        if batch.ended:
            return
        core = self.core
        if self._skip_in_capture(batch):
            batch.ended = True
            return
        for layer in range(core.num_layers):
            self.save_layer(batch, layer)
        batch.ended = True
        if not core.cuda:
            return
        lib = core.lib
        assert lib is not None
        with core.lock, core.on_device():
            if core.fp8:
                self._enqueue_fp8(lib, batch)
            batch.notice = Notice(core.save_stream, lib)

    def _enqueue_fp8(self, lib: Library, batch: SaveBatch) -> None:
        core = self.core
        assert core.codec is not None
        sg, drec, stream = self._sg, self._device_record, core.save_stream
        hdr = gpu_fp8._HDR.size
        for i in range(batch.n):
            x = self._fp8_blocks.ptr + i * core.block_bytes
            r = self._fp8_records.ptr + i * drec
            scales = r + self._scratch_bytes + 4 + hdr
            lib.call("kvc_fp8_encode", x, gpu_fp8._DTYPE_CODE[core.dtype], sg.rows,
                     sg.head_dim, self._row_group.ptr, sg.n, gpu_fp8._base(core.codec), r,
                     scales, scales + sg.n, stream)
        # One DMA of every block's status word and payload (not the amax words).
        width = 4 + self._payload_bytes
        lib.call("kvc_memcpy2d_async", batch.lease.address, self._record_bytes,
                 self._fp8_records.ptr + self._scratch_bytes, drec, width, batch.n, stream)
        core.counts.copied_out_bytes += batch.n * width

    def payloads(self, batch: SaveBatch) -> list[tuple[int, U8] | None]:
        """:meth:`SaveBatch.payloads`."""
        core = self.core
        if core.codec is None:
            raise ValueError("payloads() needs a mover made with an FP8 codec")
        if not batch.done:
            raise RuntimeError("the batch's copies have not completed: await wait() first")
        if not core.fp8:   # the CPU path, or blocks FP8 does not apply to: the codec
            return list(codecs.encode(b, core.codec) for b in batch.blocks())
        sg, rec, hdr = self._sg, self._record_bytes, gpu_fp8._HDR.size
        base = gpu_fp8._base(core.codec)
        arr = batch.lease.tensor(torch.uint8, (batch.n * rec,)).numpy()
        out: list[tuple[int, U8] | None] = []
        for i in range(batch.n):
            r = arr[i * rec:(i + 1) * rec]
            status = int(r[:4].view(np.uint32)[0])
            if status & 2:   # the codec would store it raw; its raw bytes are gone
                out.append(None)
                with core.lock:
                    core.counts.fp8_lossless_dropped += 1
                continue
            p = r[4:4 + self._payload_bytes]
            gk, gv, kv, tok, head_ax = sg.fields
            gpu_fp8._HDR.pack_into(p.data, 0, 1, status & 1, gk, gv, kv, tok, head_ax, sg.n)
            out.append(codecs.zstd_stage(base, p, hdr + sg.n) if core.codec.zstd
                       else (base, p))
        return out
