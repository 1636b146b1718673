"""Stream-ordered copies between host memory and CUDA tensors for ``Store.put_many`` and
``Store.get_many(out=...)``: no ``synchronize``, completion awaited through the eventfd.

* :class:`DeviceCopies` collects the host -> device copies of one read chunk
  (``kvstore.io.slots.deliver`` enqueues them straight from the verified arena run: one
  DMA from the page-locked arena, no host copy), each on kvstore's copy stream of the
  tensor's device after an event recorded on the current torch stream of the thread
  (whatever that stream queued into the tensor comes first); ``kvstore.io.transfers``
  awaits :meth:`DeviceCopies.wait` before the arena run is reused.
* :func:`to_host` copies CUDA values of a put into page-locked staging (a process-wide
  :class:`~kvstore.cuda.staging.StagingPool`, registered once) and awaits the copies;
  the CPU tensors it returns hand their staging back when the last of them dies (a
  weak reference, as :mod:`kvstore.codecs.result_buffers` does), so the put path needs no
  release call.  A put whose values do not fit the staging now gets ordinary host
  memory for the rest (counted in :func:`stats`): slower, never blocked.

Both need the CUDA library (``kvstore.cuda.available()``); without it, or for tensors
not on a CUDA device, they are not used (``enabled_for``), and torch's copies run as
before.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvstore.codecs.tensors import DTYPE_CODES
from kvstore.cuda import fp8 as gpu_fp8
from kvstore.cuda._lib import Library, runtime
from kvstore.cuda.device import DeviceBuffer, Notice, on_device
from kvstore.cuda.staging import Lease, StagingPool

__all__ = ["DeviceCopies", "close", "enabled_for", "stats", "to_host"]

PUT_STAGING_BYTES = 256 << 20   # the put path's page-locked staging, made on first use
# The FP8 decoder's row -> scale-group maps go up through staging of their own, made on
# first use: a few KiB per block geometry, uploaded once.  Taken from the put staging,
# the first FP8 read page-locked 256 MiB per process for them.
ROW_GROUP_STAGING_BYTES = 1 << 20
_STAGING_BYTES = {"put": PUT_STAGING_BYTES, "row groups": ROW_GROUP_STAGING_BYTES}

_lock = threading.Lock()
# Per library (the process's, or another a test or tool loaded), by id: device index ->
# kvstore's copy stream there and the event it orders by, and the put staging.
_streams: dict[tuple[int, int], int] = {}
_events: dict[tuple[int, int], int] = {}
_pools: dict[tuple[int, str], StagingPool] = {}   # (library, purpose) -> staging
_row_group_cache: dict[tuple[object, ...], tuple[object, int]] = {}


@dataclass
class CopyStats:
    to_device: int = 0        # host -> device copies enqueued
    to_host: int = 0          # device -> host copies into page-locked staging
    to_host_unstaged: int = 0  # device -> host copies that found no staging
    fp8_decoded: int = 0      # FP8 blocks dequantised on the GPU


_stats = CopyStats()


def stats() -> CopyStats:
    return CopyStats(**vars(_stats))


def enabled_for(t: torch.Tensor) -> bool:
    """Whether ``t``'s copies take this path: on a CUDA device, the library usable."""
    return t.device.type == "cuda" and runtime().usable


def _index(t: torch.Tensor) -> int:
    if t.device.index is not None:
        return int(t.device.index)
    return torch.cuda.current_device() if torch.cuda.is_available() else runtime().device


def _caller_stream(device: torch.device) -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0  # a torch without CUDA: the legacy default stream (the stand-in's)


def close() -> None:
    """Release the process's CUDA library's copy streams and put staging (it is about to
    change, or the process ends; copies are awaited by their callers, none is in flight
    then)."""
    lib = runtime().lib
    if lib is None:
        return
    with _lock:
        pools = [_pools.pop(k) for k in [k for k in _pools if k[0] == id(lib)]]
        for key in [k for k in _row_group_cache if k[0] == id(lib)]:
            holder, _ = _row_group_cache.pop(key)
            if isinstance(holder, DeviceBuffer):
                holder.close()
        for key in [k for k in _streams if k[0] == id(lib)]:
            with on_device(key[1], lib):
                lib.try_call("kvc_event_destroy", _events.pop(key))
                lib.try_call("kvc_stream_destroy", _streams.pop(key))
    for pool in pools:
        pool.close()


def _stream(lib: Library, device: int) -> tuple[int, int]:
    """kvstore's copy stream on ``device`` and its ordering event (made once)."""
    key = (id(lib), device)
    with _lock:
        if key not in _streams:
            s, e = ctypes.c_uint64(0), ctypes.c_uint64(0)
            with on_device(device, lib):
                lib.call("kvc_stream_create", ctypes.byref(s))
                lib.call("kvc_event_create", ctypes.byref(e))
            _streams[key], _events[key] = int(s.value), int(e.value)
        return _streams[key], _events[key]


class DeviceCopies:
    """The copies of one chunk, awaited together (module docstring)."""

    def __init__(self) -> None:
        self._streams: dict[int, int] = {}   # stream -> device
        self._lib: Library | None = None
        self._keep: list[object] = []
        self._buffers: list[DeviceBuffer] = []
        self._leases: list[Lease] = []

    def _enqueue(self, t: torch.Tensor, dst: int, src: int, nbytes: int) -> None:
        rt = runtime()
        assert rt.lib is not None
        lib = self._lib = rt.lib
        device = _index(t)
        stream, event = _stream(lib, device)
        with _lock, on_device(device, lib):
            # after what the current torch stream queued (e.g. the tensor's producer)
            lib.call("kvc_event_record", event, _caller_stream(t.device))
            lib.call("kvc_stream_wait_event", stream, event)
            lib.call("kvc_memcpy_async", dst, src, nbytes, stream)
        self._streams[stream] = device

    def to_device(self, dst: torch.Tensor, src_address: int, nbytes: int) -> None:
        """Enqueue ``nbytes`` from host ``src_address`` into contiguous CUDA ``dst``."""
        _stats.to_device += 1
        self._enqueue(dst, dst.data_ptr(), src_address, nbytes)

    def copy(self, dst: torch.Tensor, src_address: int, nbytes: int, keep: object) -> None:
        """``to_device``, keeping ``keep`` (the host source) alive until :meth:`wait`
        (``kvstore.io.slots.ToDevice``)."""
        if keep is not None:
            self._keep.append(keep)
        self.to_device(dst, src_address, nbytes)

    def decode(self, out: torch.Tensor, codec: int, payload: npt.NDArray[np.uint8],
               dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """An FP8 payload (no zstd stage) in the page-locked arena: its scales and codes
        copied to the GPU and dequantised there into ``out`` (``kvstore/cuda/fp8.py``'s
        kernel, bytes identical to ``kvstore.codecs.pipeline.decode``), all enqueued on the copy
        stream: half the bytes over the bus of a decoded block.  False for other codecs
        (the caller decodes on the host)."""
        if codec & 0x10 or not gpu_fp8._is_fp8(codec, dtype):
            return False
        sg, scales, codes = gpu_fp8._parse(codec, payload, dtype, shape)
        rt = runtime()
        assert rt.lib is not None
        lib = self._lib = rt.lib
        device = _index(out)
        stream, event = _stream(lib, device)
        rg = self._row_groups(lib, out, device, stream, sg)
        if not rg:
            return False
        # device scratch for the scales and codes, alive until wait()
        scratch = self._scratch(out, lib, device, scales.size + codes.size)
        with _lock, on_device(device, lib):
            lib.call("kvc_event_record", event, _caller_stream(out.device))
            lib.call("kvc_stream_wait_event", stream, event)
            if scales.size:
                lib.call("kvc_memcpy_async", scratch, scales.ctypes.data, scales.size, stream)
            lib.call("kvc_memcpy_async", scratch + scales.size, codes.ctypes.data,
                     codes.size, stream)
            lib.call("kvc_fp8_decode", scratch + scales.size, scratch, rg, sg.rows,
                     sg.head_dim, codec & 0x0F, gpu_fp8._DTYPE_CODE[dtype], out.data_ptr(),
                     stream)
        self._streams[stream] = device
        _stats.fp8_decoded += 1
        return True

    def _scratch(self, like: torch.Tensor, lib: Library, device: int, nbytes: int) -> int:
        """Device memory for one decode: torch's caching allocator where torch has CUDA
        (no synchronising cudaMalloc), else the library's."""
        if torch.cuda.is_available():
            t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=like.device)
            self._keep.append(t)
            return int(t.data_ptr())
        with on_device(device, lib):
            buf = DeviceBuffer(max(nbytes, 1), lib)
        self._buffers.append(buf)
        return buf.ptr

    def _row_groups(self, lib: Library, out: torch.Tensor, device: int, stream: int,
                    sg: gpu_fp8.ScaleGroups) -> int:
        """The kernel's row -> scale-group map on ``device``, made once per block geometry:
        device memory from torch's caching allocator where torch has CUDA (else the
        library's), filled by a copy on ``stream`` from page-locked staging (ordered
        before the decodes that use it, nothing waited for); 0 when there is no staging
        for it now."""
        key = (id(lib), device, sg.fields, sg.rows, sg.head_dim, sg.n)
        with _lock:
            cached = _row_group_cache.get(key)
        if cached is not None:
            return cached[1]
        nbytes = sg.row_group.nbytes
        lease = _staging("row groups").try_take(nbytes)
        if lease is None:
            return 0
        holder: object
        if torch.cuda.is_available():
            t = torch.empty(nbytes, dtype=torch.uint8, device=out.device)
            holder, ptr = t, int(t.data_ptr())
        else:
            with on_device(device, lib):
                buf = DeviceBuffer(nbytes, lib)
            holder, ptr = buf, buf.ptr
        arena = lease.pool.arena
        arena.array[lease.run.offset:lease.run.offset + nbytes] = sg.row_group.view(np.uint8)
        with _lock, on_device(device, lib):
            lib.call("kvc_memcpy_async", ptr, lease.address, nbytes, stream)
            _row_group_cache[key] = (holder, ptr)
        self._leases.append(lease)
        return ptr

    def to_host(self, dst_address: int, src: torch.Tensor, nbytes: int) -> None:
        """Enqueue ``nbytes`` of contiguous CUDA ``src`` into host ``dst_address``."""
        self._enqueue(src, dst_address, src.data_ptr(), nbytes)

    def __bool__(self) -> bool:
        return bool(self._streams)

    @property
    def sink(self) -> DeviceCopies:
        """What ``kvstore.io.slots.deliver`` enqueues through (``kvstore.io.slots.ToDevice``)."""
        return self

    async def wait(self) -> None:
        """Until every copy enqueued so far has completed (the eventfd; a cancelled
        wait still lets them finish first); then what they used is let go."""
        if not self._streams:
            return
        assert self._lib is not None
        notices = []
        for stream, device in self._streams.items():
            with on_device(device, self._lib):
                notices.append(Notice(stream, self._lib))
        self._streams = {}
        try:
            for n in notices:
                await n.wait()
        finally:
            self._keep = []
            for buf in self._buffers:
                buf.close()
            self._buffers = []
            for lease in self._leases:
                lease.release()
            self._leases = []



def _staging(purpose: str = "put") -> StagingPool:
    """The page-locked staging for ``purpose`` (``_STAGING_BYTES``), made on first use."""
    lib = runtime().lib
    key = (id(lib), purpose)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = StagingPool(_STAGING_BYTES[purpose], lib,
                                             owner=f"kvstore {purpose} staging")
        return pool


def _leased(lease: Lease, nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor over the lease that hands it back when the last user dies."""
    arr = np.frombuffer(lease.pool.arena._map, dtype=np.uint8, count=nbytes,
                        offset=lease.run.offset)
    weakref.finalize(arr, lease.release).atexit = False
    with torch.inference_mode(False):
        return torch.from_numpy(arr)


async def to_host(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` with every CUDA tensor replaced by a CPU copy of its bytes, viewed as
    its dtype and shape (module docstring); other values are returned as they are."""
    copies = DeviceCopies()
    out: list[torch.Tensor] = []
    keep = []
    for v in values:
        if not (isinstance(v, torch.Tensor) and enabled_for(v)) or v.is_sparse \
                or v.layout != torch.strided or v.is_quantized or v.dtype not in DTYPE_CODES:
            out.append(v)   # not ours, or host_bytes refuses it with the right error
            continue
        src = v.detach()
        if not src.is_contiguous():
            src = src.contiguous()   # a kernel on the current stream, ordered before ours
        keep.append(src)
        nbytes = src.numel() * src.element_size()
        lease = _staging().try_take(nbytes) if nbytes else None
        if lease is None:
            _stats.to_host_unstaged += 1
            host = torch.empty(nbytes, dtype=torch.uint8)
            address = host.data_ptr()
        else:
            _stats.to_host += 1
            host = _leased(lease, nbytes)
            address = lease.address
        if nbytes:
            copies.to_host(address, src, nbytes)
        out.append(host.view(src.dtype).view(src.shape) if nbytes else
                   torch.empty(src.shape, dtype=src.dtype))
    await copies.wait()
    del keep
    return out
