"""The data mover: paged KV blocks between an engine's per-layer cache tensors and
page-locked staging, layer by layer, on streams of kvstore's own, never blocking the
host on the GPU.  Independent of any engine: the vLLM connector
(:mod:`kvstore.integrations.vllm_worker`) and the GPU checks (``tests/gpu``) use it.

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
one DMA (``cudaMemcpy2DAsync``) into the block-major pinned staging: block ``i`` is
``[num_layers, *per_block]`` contiguous, one kvstore block.  No pageable memory, no host
copy: the store writes the staged block (its CRC32C pass copies it into the I/O arena).

With an FP8 codec the layers are gathered into a device scratch of whole blocks
instead; ``end_save`` quantises each block there (``cuda_ext/fp8.cu``, the codec's
algorithm) and copies only the FP8 payload (header space, scales, codes) and the status
word to staging: half the bytes over PCIe.  ``batch.payloads()`` are then byte-identical
to :func:`kvstore.codecs.encode` of the same block (a block the codec would store
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
too.  A lease is never reused before its copy-done notice fired, whatever the caller
does (``release`` early, a cancelled wait, an abort): :meth:`Mover.reap` hands it back
then.

On CPU tensors (a CPU engine) the same calls run plain copies (torch's
``index_select``/``index_copy_``), with no stream or event; everything is done when the
call returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvstore import codecs
from kvstore.codecs import CodecSpec
from kvstore.cuda import fp8 as gpu_fp8
from kvstore.cuda import paged
from kvstore.cuda._lib import CudaError, Library, runtime
from kvstore.cuda.device import DeviceBuffer, Notice, on_device
from kvstore.cuda.staging import DeviceLease, DeviceStagingPool, Lease, StagingPool

__all__ = ["LoadBatch", "Mover", "MoverStats", "SaveBatch"]

U8 = npt.NDArray[np.uint8]
_ALIGN = 16


def _up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class MoverStats:
    saves: int = 0                 # save batches staged
    saved_blocks: int = 0
    dropped_saves: int = 0         # refused for want of staging (never waited for)
    dropped_blocks: int = 0
    rate_dropped_saves: int = 0    # refused by the copy-out rate cap
    rate_dropped_blocks: int = 0
    copied_out_bytes: int = 0      # bytes DMA'd device -> staging (FP8: payloads)
    loads: int = 0
    loaded_blocks: int = 0
    copied_in_bytes: int = 0
    staging_bytes: int = 0         # saves' staging (loads have their own)
    load_staging_bytes: int = 0
    staging_in_use_bytes: int = 0  # both
    staging_peak_bytes: int = 0
    pending_leases: int = 0        # leases whose copies have not completed yet
    fp8_lossless_dropped: int = 0  # FP8 saves of blocks the codec stores losslessly


def _fired(notice: Notice) -> bool:
    """Whether the copies before ``notice`` are over (done, or their stream failed: the
    callback ran either way, nothing uses the staging any more)."""
    try:
        return notice.poll()
    except CudaError:
        return True


class _Batch:
    def __init__(self, mover: Mover, lease: Lease | DeviceLease, n: int) -> None:
        self.mover, self.lease, self.n = mover, lease, n
        self.notice: Notice | None = None
        self.released = False
        self.enqueued = 0   # the stream its copies were enqueued on (0: none)
        self.host_ids: list[int] = []   # the CPU path's cache block ids
        self._staged: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        """The batch's copies have completed (always, on the CPU path)."""
        return self.notice is None or self.notice.poll()

    async def wait(self) -> None:
        """Until the batch's copies have completed, awaited through the eventfd (a
        cancelled wait still lets the copies finish before anything is reused)."""
        if self.notice is not None:
            await self.notice.wait()

    def release(self) -> None:
        """Hand the staging back: now if the copies are done, else once they are (an
        aborted save, whose ``end_save`` never came, first gets a notice after the
        copies it enqueued)."""
        if not self.released:
            self.released = True
            if self.notice is None and self.enqueued:
                self.notice = self.mover._notice_after(self.enqueued)
            self.mover._retire(self.lease, self.notice)

    def staged(self) -> torch.Tensor:
        """The staging as ``[n, num_layers, *per_block]`` (a pinned CPU view; read it
        only once :meth:`wait` returned)."""
        if self._staged is None:
            m = self.mover
            self._staged = self.lease.tensor(m.dtype, (self.n, *m.block_shape))
        return self._staged

    def blocks(self) -> list[torch.Tensor]:
        """The staged blocks, ``[num_layers, *per_block]`` each."""
        return list(self.staged().unbind(0))


class SaveBatch(_Batch):
    """One step's blocks on their way out (see the module docstring)."""

    def __init__(self, mover: Mover, lease: Lease | DeviceLease, block_ids: list[int]) -> None:
        super().__init__(mover, lease, len(block_ids))
        self.block_ids = self.host_ids = block_ids
        self.layers_done: set[int] = set()
        self.ended = False

    def payloads(self) -> list[tuple[int, U8] | None]:
        """``(codec id, payload)`` per block, as :func:`kvstore.codecs.encode` makes
        them from the same values (after :meth:`wait`); needs a mover with a codec.
        ``None`` for a block the codec would store losslessly (a finite value FP8
        scales cannot reach: the GPU path does not keep its raw bytes; counted in
        ``MoverStats.fp8_lossless_dropped``, the caller drops it)."""
        return self.mover._payloads(self)


class LoadBatch(_Batch):
    """Staging for ``n`` blocks coming in: ``blocks()`` is where the store reads them
    (device memory on the GPU path: the reads land there straight from the arena)."""


class Mover:
    """Moves blocks of ``layers`` (one cache tensor per layer, all alike, ``layout`` as in
    :mod:`kvstore.cuda.paged`) through ``staging_bytes`` of page-locked staging for saves
    and ``load_staging_bytes`` (default: as many) for loads.

    ``device_loads``: on the GPU path, loads stage in device memory (reads land there from
    the store's arena with no host copy; it takes ``load_staging_bytes`` of the GPU's
    memory).  ``codec``: an FP8 ``CodecSpec`` quantises saves on the GPU.  ``lib``: the CUDA
    library (default: the process's, when the layers are on a CUDA device and it is
    usable; else the CPU path).  ``compute_stream``: the engine's stream as an int
    (default: torch's current stream of the layers' device).
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: paged.Layout, *,
                 staging_bytes: int, load_staging_bytes: int | None = None,
                 device_loads: bool = False, codec: CodecSpec | None = None,
                 max_save_bytes_per_s: float | None = None, lib: Library | None = None,
                 compute_stream: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.layers = list(layers)
        self.layout = layout
        axis = paged._check_layers(self.layers, layout)
        first = self.layers[0]
        self.dtype = first.dtype
        self.num_layers = len(self.layers)
        self.num_blocks = int(first.shape[axis])
        self.block_shape = paged.staging_shape(first.shape, self.num_layers, 1, layout)[1:]
        self.layer_bytes = int(np.prod(self.block_shape[1:], dtype=np.int64)) * \
            first.element_size()
        self.block_bytes = self.layer_bytes * self.num_layers
        if lib is None and first.device.type == "cuda" and runtime().usable:
            lib = runtime().lib
        self._lib = lib
        self.cuda = lib is not None
        self._device = first.device.index if first.device.type == "cuda" else None
        if self.cuda and self._device is None and first.device.type == "cuda":
            self._device = paged.cuda_index(first.device)
        self.codec = codec if codec is not None and \
            codecs.codec_id(codec) & 0x0F in (codecs.FP8_E4M3, codecs.FP8_E5M2) else None
        self._fp8 = self.codec is not None and self.cuda and gpu_fp8._fp8_applies(
            self.dtype, self.block_shape, self.codec)
        self._lock = threading.Lock()
        self._pending: list[tuple[Notice, Lease | DeviceLease]] = []
        self._stats = MoverStats()
        self._rate = max_save_bytes_per_s
        self._compute_stream = compute_stream
        self._clock = clock
        self._tokens = float(max_save_bytes_per_s or 0)
        self._refilled = clock()
        self.closed = False
        self._buffers: list[DeviceBuffer] = []
        self._streams: list[int] = []
        self._events: list[int] = []
        with self._on_device():
            # Saves and loads each have their own staging: saves that pile up (a slow
            # disk) are dropped, and never take the room a load needs.
            self.pool = StagingPool(staging_bytes, lib)
            # device_loads (GPU path): loads stage in device memory, the store's reads go
            # there straight from its page-locked arena (one DMA, an FP8 block
            # dequantised there), no host copy, at the price of that much device memory;
            # else page-locked host memory, like the saves'.
            self.load_pool: StagingPool | DeviceStagingPool = \
                DeviceStagingPool(load_staging_bytes or staging_bytes, first) \
                if lib is not None and device_loads else \
                StagingPool(load_staging_bytes or staging_bytes, lib,
                            owner="kvstore data mover (loads)")
            self._stats.staging_bytes = self.pool.capacity
            self.max_blocks = self.pool.capacity // self.block_bytes
            self.max_load_blocks = self.load_pool.capacity // self.block_bytes
            if self.cuda:
                self._setup_device()

    # ------------------------------------------------------------------ setup

    def _on_device(self) -> AbstractContextManager[None]:
        return on_device(self._device, self._lib)

    def _setup_device(self) -> None:
        lib = self._lib
        assert lib is not None
        self._geometry = paged._geometry(self.layers[0], 1 if self.layout == "kv_first" else 0)
        for t in self.layers[1:]:
            if paged._geometry(t, 1 if self.layout == "kv_first" else 0) != self._geometry:
                raise ValueError("every layer must have the same strides")
        self._layer_ptrs = [t.data_ptr() for t in self.layers]
        self.save_stream = self._new_stream()
        self.load_stream = self._new_stream()
        self._save_event = self._new_event()
        self._load_events = [self._new_event() for _ in range(self.num_layers)]
        self._unwaited: set[int] = set()   # layers loaded, compute stream not yet waiting
        blocks = max(self.max_blocks, 1)
        # One layer of the largest batch, per direction: the gather/scatter's side of the
        # DMA.  Reused by every batch: work on one stream runs in order.
        self._save_scratch = self._malloc(blocks * self.layer_bytes)
        self._load_scratch = self._malloc(max(self.max_load_blocks, 1) * self.layer_bytes)
        if self._fp8:
            assert self.codec is not None
            sg = gpu_fp8.scale_groups(self.block_shape, self.codec)
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
            n_fp8 = max(min(self.max_fp8_blocks, 4 * blocks), 1)
            self.max_fp8_blocks = min(self.max_fp8_blocks, n_fp8)
            self._fp8_blocks = self._malloc(n_fp8 * self.block_bytes)
            self._fp8_records = self._malloc(n_fp8 * self._device_record)
            rg = self._malloc(sg.row_group.nbytes)
            # Once, at construction (a synchronous upload: never on the step's path).
            rg.upload(sg.row_group, self.save_stream)
            self._row_group = rg

    def _new_stream(self) -> int:
        assert self._lib is not None
        import ctypes

        h = ctypes.c_uint64(0)
        self._lib.call("kvc_stream_create", ctypes.byref(h))
        self._streams.append(int(h.value))
        return int(h.value)

    def _new_event(self) -> int:
        assert self._lib is not None
        import ctypes

        h = ctypes.c_uint64(0)
        self._lib.call("kvc_event_create", ctypes.byref(h))
        self._events.append(int(h.value))
        return int(h.value)

    def _malloc(self, nbytes: int) -> DeviceBuffer:
        buf = DeviceBuffer(max(nbytes, 1), self._lib)
        self._buffers.append(buf)
        return buf

    def _compute(self) -> int:
        if self._compute_stream is not None:
            return self._compute_stream()
        dev = self.layers[0].device
        if dev.type == "cuda" and torch.cuda.is_available():
            return int(torch.cuda.current_stream(dev).cuda_stream)
        return 0  # the legacy default stream (a torch without CUDA: the stand-in's)

    # ------------------------------------------------------------------ staging

    def stored_bytes(self, n: int) -> int:
        """Staging one save of ``n`` blocks takes."""
        return n * (self._record_bytes if self._fp8 else self.block_bytes)

    def _take(self, nbytes: int, pool: StagingPool | DeviceStagingPool | None = None
              ) -> Lease | DeviceLease | None:
        self.reap()
        return (pool or self.pool).try_take(nbytes)

    def _allow_rate(self, nbytes: int) -> bool:
        if self._rate is None:
            return True
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        if nbytes > self._tokens:
            return False
        self._tokens -= nbytes
        return True

    def _notice_after(self, stream: int) -> Notice:
        assert self._lib is not None
        with self._lock, self._on_device():
            return Notice(stream, self._lib)

    def _retire(self, lease: Lease | DeviceLease, notice: Notice | None) -> None:
        with self._lock:
            if notice is None or _fired(notice):
                lease.release()
            else:
                self._pending.append((notice, lease))

    def reap(self) -> int:
        """Hand back the leases whose copies completed (non-blocking); how many."""
        with self._lock:
            keep, done = [], 0
            for notice, lease in self._pending:
                if _fired(notice):
                    lease.release()
                    done += 1
                else:
                    keep.append((notice, lease))
            self._pending = keep
            return done

    # ------------------------------------------------------------------ save

    def begin_save(self, block_ids: Sequence[int]) -> SaveBatch | None:
        """Staging for a save of ``block_ids`` (cache block numbers), or None: dropped
        (no room now, or over the rate cap) and counted; never waits."""
        ids = [int(b) for b in block_ids]
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block ids must be in [0, {self.num_blocks}), got {b}")
        n = len(ids)
        nbytes = self.stored_bytes(n)
        fits_device = not self.cuda or n <= (self.max_fp8_blocks if self._fp8 else
                                             self.max_blocks)
        lease = self._take(nbytes) if fits_device and n else None
        if lease is None or not self._allow_rate(nbytes):
            with self._lock:
                if lease is not None:
                    self._stats.rate_dropped_saves += 1
                    self._stats.rate_dropped_blocks += n
                else:
                    self._stats.dropped_saves += 1
                    self._stats.dropped_blocks += n
            if lease is not None:
                lease.release()
            return None
        with self._lock:
            self._stats.saves += 1
            self._stats.saved_blocks += n
        return SaveBatch(self, lease, ids)

    def save_layer(self, batch: SaveBatch, layer: int) -> None:
        """Enqueue the copy-out of ``layer``'s blocks, ordered after the work the compute
        stream has queued so far (the layer's KV write).  Returns at once."""
        if batch.ended or layer in batch.layers_done:
            return
        batch.layers_done.add(layer)
        if not self.cuda:
            self._host_copy(batch, layer, out=True)
            return
        lib = self._lib
        assert lib is not None
        outer, ostride, bstride, inner = self._geometry
        ids = np.asarray(batch.block_ids, dtype=np.int64)
        with self._lock, self._on_device():
            # The save stream starts on this layer once the compute stream got here.
            lib.call("kvc_event_record", self._save_event, self._compute())
            lib.call("kvc_stream_wait_event", self.save_stream, self._save_event)
            paged.gather_ptrs(lib, [self._layer_ptrs[layer]], outer, ostride, bstride, inner,
                              ids, self._save_scratch.ptr, self.save_stream)
            if self._fp8:   # into the whole-block device scratch; quantised in end_save
                dst, pitch = self._fp8_blocks.ptr + layer * self.layer_bytes, self.block_bytes
            else:           # one DMA into the block-major pinned staging
                dst, pitch = batch.lease.address + layer * self.layer_bytes, self.block_bytes
                self._stats.copied_out_bytes += batch.n * self.layer_bytes
            lib.call("kvc_memcpy2d_async", dst, pitch, self._save_scratch.ptr, self.layer_bytes,
                     self.layer_bytes, batch.n, self.save_stream)
            batch.enqueued = self.save_stream

    def end_save(self, batch: SaveBatch) -> None:
        """Enqueue what is left (layers not saved yet, FP8 quantisation and its copy-out)
        and arm the batch's copy-done notice.  Returns at once."""
        if batch.ended:
            return
        for layer in range(self.num_layers):
            self.save_layer(batch, layer)
        batch.ended = True
        if not self.cuda:
            return
        lib = self._lib
        assert lib is not None
        with self._lock, self._on_device():
            if self._fp8:
                self._enqueue_fp8(lib, batch)
            batch.notice = Notice(self.save_stream, lib)

    def _enqueue_fp8(self, lib: Library, batch: SaveBatch) -> None:
        assert self.codec is not None
        sg, drec = self._sg, self._device_record
        hdr = gpu_fp8._HDR.size
        for i in range(batch.n):
            x = self._fp8_blocks.ptr + i * self.block_bytes
            r = self._fp8_records.ptr + i * drec
            scales = r + self._scratch_bytes + 4 + hdr
            lib.call("kvc_fp8_encode", x, gpu_fp8._DTYPE_CODE[self.dtype], sg.rows,
                     sg.head_dim, self._row_group.ptr, sg.n, gpu_fp8._base(self.codec), r,
                     scales, scales + sg.n, self.save_stream)
        # One DMA of every block's status word and payload (not the amax words).
        width = 4 + self._payload_bytes
        lib.call("kvc_memcpy2d_async", batch.lease.address, self._record_bytes,
                 self._fp8_records.ptr + self._scratch_bytes, drec, width, batch.n,
                 self.save_stream)
        self._stats.copied_out_bytes += batch.n * width

    def _payloads(self, batch: SaveBatch) -> list[tuple[int, U8] | None]:
        if self.codec is None:
            raise ValueError("payloads() needs a mover made with an FP8 codec")
        if not batch.done:
            raise RuntimeError("the batch's copies have not completed: await wait() first")
        if not self._fp8:   # the CPU path, or blocks FP8 does not apply to: the codec
            return list(codecs.encode(b, self.codec) for b in batch.blocks())
        sg, rec, hdr = self._sg, self._record_bytes, gpu_fp8._HDR.size
        base = gpu_fp8._base(self.codec)
        arr = batch.lease.tensor(torch.uint8, (batch.n * rec,)).numpy()
        out: list[tuple[int, U8] | None] = []
        for i in range(batch.n):
            r = arr[i * rec:(i + 1) * rec]
            status = int(r[:4].view(np.uint32)[0])
            if status & 2:   # the codec would store it raw; its raw bytes are gone
                out.append(None)
                with self._lock:
                    self._stats.fp8_lossless_dropped += 1
                continue
            p = r[4:4 + self._payload_bytes]
            gk, gv, kv, tok, head_ax = sg.fields
            gpu_fp8._HDR.pack_into(p.data, 0, 1, status & 1, gk, gv, kv, tok, head_ax, sg.n)
            out.append(codecs._zstd_stage(base, p, hdr + sg.n) if self.codec.zstd
                       else (base, p))
        return out

    # ------------------------------------------------------------------ load

    def begin_load(self, n: int) -> LoadBatch | None:
        """Staging for ``n`` blocks coming in (``batch.blocks()``), or None (no room)."""
        if n < 1 or (self.cuda and n > self.max_load_blocks):
            return None
        lease = self._take(n * self.block_bytes, self.load_pool)
        return None if lease is None else LoadBatch(self, lease, n)

    def load(self, batch: LoadBatch, block_ids: Sequence[int]) -> None:
        """Scatter the first ``len(block_ids)`` staged blocks into the cache at
        ``block_ids``, layer by layer on the load stream, each layer's end recorded for
        :meth:`wait_layer`; then the batch's copy-done notice.  Returns at once (CPU:
        done)."""
        ids = [int(b) for b in block_ids]
        n = len(ids)
        if n > batch.n:
            raise ValueError(f"{n} block ids for a batch of {batch.n}")
        if len(set(ids)) != n:
            raise ValueError("load block ids must be distinct")
        with self._lock:
            self._stats.loads += 1
            self._stats.loaded_blocks += n
            self._stats.copied_in_bytes += n * self.block_bytes
        if not n:
            return
        if not self.cuda:
            batch.host_ids = ids
            for layer in range(self.num_layers):
                self._host_copy(batch, layer, out=False)
            return
        lib = self._lib
        assert lib is not None
        outer, ostride, bstride, inner = self._geometry
        arr = np.asarray(ids, dtype=np.int64)
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block ids must be in [0, {self.num_blocks}), got {b}")
        with self._lock, self._on_device():
            batch.enqueued = self.load_stream
            # The blocks' earlier users on the compute stream come first.
            lib.call("kvc_event_record", self._save_event, self._compute())
            lib.call("kvc_stream_wait_event", self.load_stream, self._save_event)
            for layer in range(self.num_layers):
                lib.call("kvc_memcpy2d_async", self._load_scratch.ptr, self.layer_bytes,
                         batch.lease.address + layer * self.layer_bytes, self.block_bytes,
                         self.layer_bytes, n, self.load_stream)
                paged.scatter_ptrs(lib, [self._layer_ptrs[layer]], outer, ostride, bstride,
                                   inner, arr, self._load_scratch.ptr, self.load_stream)
                lib.call("kvc_event_record", self._load_events[layer], self.load_stream)
                self._unwaited.add(layer)
            batch.notice = Notice(self.load_stream, lib)

    # Up to this many blocks a CPU copy goes block by block (one copy of each block's
    # layer, straight into place); more, through index_select (one call, two copies).
    _HOST_LOOP_BLOCKS = 64

    def _host_copy(self, batch: _Batch, layer: int, out: bool,
                   staged: torch.Tensor | None = None) -> None:
        """The CPU path: layer ``layer`` of the batch's blocks between the cache and
        ``staged`` (default: the batch's staging), ``out``: cache -> staging."""
        ids = batch.host_ids
        if staged is None:
            staged = batch.staged()
        cache = self.layers[layer]
        kv_first = self.layout == "kv_first"
        if len(ids) <= self._HOST_LOOP_BLOCKS:
            for i, b in enumerate(ids):
                part = cache[:, b] if kv_first else cache[b]
                if out:
                    staged[i, layer].copy_(part)
                else:
                    part.copy_(staged[i, layer])
            return
        index = torch.tensor(ids, dtype=torch.long, device=cache.device)
        axis = 1 if kv_first else 0
        if out:
            sel = cache.index_select(axis, index)
            staged[:len(ids), layer].copy_(sel.transpose(0, 1) if kv_first else sel)
        else:
            part = staged[:len(ids), layer]
            cache.index_copy_(axis, index, part.transpose(0, 1) if kv_first else part)

    def load_host(self, blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
        """The CPU path's load from any host tensor ``[n, num_layers, *per_block]``
        (pageable memory cannot be copied asynchronously: refused on the GPU path)."""
        if self.cuda:
            raise ValueError("load_host is the CPU path's; load through begin_load staging")
        ids = [int(b) for b in block_ids]
        with self._lock:
            self._stats.loads += 1
            self._stats.loaded_blocks += len(ids)
            self._stats.copied_in_bytes += len(ids) * self.block_bytes
        if len(set(ids)) != len(ids):
            raise ValueError("load block ids must be distinct")
        holder = _Batch.__new__(_Batch)
        holder.host_ids = ids
        for layer in range(self.num_layers):
            self._host_copy(holder, layer, out=False, staged=blocks)

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait (on the GPU) for the loads into ``layer``
        enqueued so far; the host does not wait."""
        if not self.cuda:
            return
        lib = self._lib
        assert lib is not None
        with self._lock:
            if layer not in self._unwaited:
                return
            self._unwaited.discard(layer)
            with self._on_device():
                lib.call("kvc_stream_wait_event", self._compute(), self._load_events[layer])

    def wait_all_layers(self) -> None:
        for layer in range(self.num_layers):
            self.wait_layer(layer)

    # ------------------------------------------------------------------ life

    def stats(self) -> MoverStats:
        self.reap()
        s, ls = self.pool.stats(), self.load_pool.stats()
        with self._lock:
            out = MoverStats(**vars(self._stats))
            out.pending_leases = len(self._pending)
        out.staging_in_use_bytes = s.in_use_bytes + ls.in_use_bytes
        out.staging_peak_bytes = s.peak_bytes
        out.load_staging_bytes = ls.capacity_bytes
        return out

    def close(self) -> None:
        """Wait for the streams (a host wait, at shutdown only), then free everything."""
        if self.closed:
            return
        self.closed = True
        lib = self._lib
        if lib is not None:
            with self._on_device():
                for s in self._streams:
                    lib.try_call("kvc_stream_synchronize", s)
                for e in self._events:
                    lib.try_call("kvc_event_destroy", e)
                for s in self._streams:
                    lib.try_call("kvc_stream_destroy", s)
                for b in self._buffers:
                    b.close()
        with self._lock:
            for _, lease in self._pending:
                lease.release()
            self._pending = []
        self.pool.close()
        self.load_pool.close()
