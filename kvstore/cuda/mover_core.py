"""What the data mover's save side (:mod:`kvstore.cuda.copy_out`) and load side
(:mod:`kvstore.cuda.copy_in`) share: the engine's per-layer cache tensors and their
geometry, the CUDA library and device, kvstore's two streams and the event that orders
them after the compute stream, the device memory and handles to free at close, one lock,
the counters, the leases waiting for their copies, and the CPU path's copy."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec
from kvstore.cuda import fp8 as gpu_fp8
from kvstore.cuda import paged
from kvstore.cuda._lib import Library, runtime
from kvstore.cuda.backpressure import PendingLeases
from kvstore.cuda.device import DeviceBuffer, Notice, on_device
from kvstore.cuda.staging import DeviceLease, DeviceStagingPool, Lease, StagingPool

__all__ = ["CaptureError", "MoverCore", "MoverStats", "torch_capturing"]


class CaptureError(RuntimeError):
    """A load asked of the mover while the engine's stream captures a CUDA graph: its
    copies and events would become nodes of the graph (replayed at every launch) or
    pull kvstore's stream into the capture; refused, nothing enqueued."""


def torch_capturing() -> bool:
    """Whether torch's current CUDA stream (the engine's compute stream) is capturing a
    CUDA graph.  kvstore's CUDA library has no capture query of its own
    (``cudaStreamIsCapturing`` is not in ``cuda_ext``), so this asks torch; a torch
    without CUDA captures nothing."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@dataclass
class MoverStats:
    saves: int = 0                 # save batches staged
    saved_blocks: int = 0
    dropped_saves: int = 0         # refused for want of staging (never waited for)
    dropped_blocks: int = 0
    rate_dropped_saves: int = 0    # refused by a copy-out cap (bytes/s, bytes per save)
    rate_dropped_blocks: int = 0
    capture_skipped_saves: int = 0  # not enqueued: the compute stream was capturing a
    capture_skipped_blocks: int = 0  # CUDA graph (never copied into a graph)
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


class MoverCore:
    """The shared state of one mover (see the module docstring); ``lib`` ``None`` picks
    the process's CUDA library when the layers are on a CUDA device and it is usable,
    else the CPU path.  ``codec`` is kept only if it is an FP8 one."""

    # Up to this many blocks a CPU copy goes block by block (one copy of each block's
    # layer, straight into place); more, through index_select (one call, two copies).
    HOST_LOOP_BLOCKS = 64

    def __init__(self, layers: Sequence[torch.Tensor], layout: paged.Layout, *,
                 codec: CodecSpec | None, lib: Library | None,
                 compute_stream: Callable[[], int] | None,
                 capturing: Callable[[], bool] | None = None) -> None:
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
        self.lib = lib
        self.cuda = lib is not None
        self.device = first.device.index if first.device.type == "cuda" else None
        if self.cuda and self.device is None and first.device.type == "cuda":
            self.device = paged.cuda_index(first.device)
        self.codec = codec if codec is not None and \
            codecs.codec_id(codec) & 0x0F in (codecs.FP8_E4M3, codecs.FP8_E5M2) else None
        self.fp8 = self.codec is not None and self.cuda and gpu_fp8._fp8_applies(
            self.dtype, self.block_shape, self.codec)
        self.lock = threading.Lock()
        self.leases = PendingLeases(self.lock)
        self.counts = MoverStats()
        self._compute_stream = compute_stream
        self._capturing = capturing or torch_capturing
        self._buffers: list[DeviceBuffer] = []
        self._streams: list[int] = []
        self._events: list[int] = []

    # ------------------------------------------------------------------ device

    def on_device(self) -> AbstractContextManager[None]:
        return on_device(self.device, self.lib)

    def setup_device(self) -> None:
        """The GPU path's shared handles: the layers' geometry and addresses, the save
        and load streams, and the event that orders either after the compute stream."""
        self.geometry = paged._geometry(self.layers[0], 1 if self.layout == "kv_first" else 0)
        for t in self.layers[1:]:
            if paged._geometry(t, 1 if self.layout == "kv_first" else 0) != self.geometry:
                raise ValueError("every layer must have the same strides")
        self.layer_ptrs = [t.data_ptr() for t in self.layers]
        self.save_stream = self._new_stream()
        self.load_stream = self._new_stream()
        # Recorded on the compute stream (under the lock) by a save or a load, for
        # kvstore's stream to wait on.
        self.after_compute = self.new_event()

    def _new_stream(self) -> int:
        return self._create("kvc_stream_create", self._streams)

    def new_event(self) -> int:
        return self._create("kvc_event_create", self._events)

    def _create(self, call: str, kept: list[int]) -> int:
        """A new handle from the library's ``call``, kept in ``kept`` to free at close."""
        assert self.lib is not None
        h = ctypes.c_uint64(0)
        self.lib.call(call, ctypes.byref(h))
        kept.append(int(h.value))
        return int(h.value)

    def malloc(self, nbytes: int) -> DeviceBuffer:
        buf = DeviceBuffer(max(nbytes, 1), self.lib)
        self._buffers.append(buf)
        return buf

    def compute(self) -> int:
        """The engine's compute stream, as an int."""
        if self._compute_stream is not None:
            return self._compute_stream()
        dev = self.layers[0].device
        if dev.type == "cuda" and torch.cuda.is_available():
            return int(torch.cuda.current_stream(dev).cuda_stream)
        return 0  # the legacy default stream (a torch without CUDA: the stand-in's)

    def capturing(self) -> bool:
        """Whether the compute stream is capturing a CUDA graph now (the GPU path only:
        nothing a CPU engine does is captured)."""
        return self.cuda and self._capturing()

    def check_ids(self, ids: Sequence[int]) -> None:
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block ids must be in [0, {self.num_blocks}), got {b}")

    # ------------------------------------------------------------------ staging

    def take(self, pool: StagingPool | DeviceStagingPool, nbytes: int
             ) -> Lease | DeviceLease | None:
        """A lease of ``nbytes`` of ``pool`` (after handing back the finished ones), or
        None: no room now."""
        self.leases.reap()
        return pool.try_take(nbytes)

    def notice_after(self, stream: int) -> Notice:
        """A notice that fires once the work enqueued on ``stream`` so far is done."""
        assert self.lib is not None
        with self.lock, self.on_device():
            return Notice(stream, self.lib)

    def retire(self, lease: Lease | DeviceLease, notice: Notice | None) -> None:
        self.leases.retire(lease, notice)

    # ------------------------------------------------------------------ CPU path

    def host_copy(self, ids: Sequence[int], layer: int, out: bool,
                  staged: torch.Tensor) -> None:
        """The CPU path: layer ``layer`` of the blocks ``ids`` between the cache and
        ``staged`` (``[n, num_layers, *per_block]``), ``out``: cache -> staging."""
        cache = self.layers[layer]
        kv_first = self.layout == "kv_first"
        if len(ids) <= self.HOST_LOOP_BLOCKS:
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

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        """Wait for the streams (a host wait, at shutdown only), free the device memory
        and handles, then hand back every lease."""
        lib = self.lib
        if lib is not None:
            with self.on_device():
                for s in self._streams:
                    lib.try_call("kvc_stream_synchronize", s)
                for e in self._events:
                    lib.try_call("kvc_event_destroy", e)
                for s in self._streams:
                    lib.try_call("kvc_stream_destroy", s)
                for b in self._buffers:
                    b.close()
        self.leases.release_all()
