"""A stand-in for libkvcuda at the ctypes boundary, for the decisions that otherwise only
a GPU exercises: which device is current when memory is allocated or registered and a
kernel launched, and what a waiter does when a stream fails.

It stands in for the CUDA runtime only, which cannot run on a machine without a GPU;
everything above the boundary is the real code.  "Device memory" is host memory and
copies are ``memmove``; the FP8 "kernels" are the library's real host twins
(``kvc_fp8_*_host``, same element code), so payloads are the real ones; the current
device, stream callbacks and stream status are plain state a test sets.  tests/gpu runs
the same paths against the real library on a GPU.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvstore.cuda._lib import CudaError, Library, Runtime

ILLEGAL_ADDRESS = 700  # cudaErrorIllegalAddress: a sticky error


class StandInLibrary:
    """Duck-types :class:`kvstore.cuda._lib.Library`; records ``(call, current device)``."""

    def __init__(self, host: Library | None = None, current: int = 0) -> None:
        self.host = host                # the built library, for the FP8 host twins
        self.current = current          # this thread's "current device"
        self.calls: list[tuple[str, int]] = []
        self.fail: dict[str, int] = {}  # call name -> error code it returns
        self.stream_status = 0          # what callbacks report and cudaStreamQuery returns
        self.run_callbacks = True       # False: a driver that never runs the callback
        self.pending_fds: list[int] = []
        self.registered: dict[int, int] = {}
        self._buffers: dict[int, npt.NDArray[np.uint8]] = {}
        self.path = Path("stand-in")
        self.build_info = "stand-in for kvcuda"

    def runtime(self, devices: int = 2, device: int = 0) -> Runtime:
        return Runtime(self, "stand-in CUDA device", devices, device, "stand-in")  # type: ignore[arg-type]

    def error_string(self, code: int) -> str:
        return f"stand-in CUDA error {code}"

    def call(self, name: str, *args: Any) -> None:
        code = self.try_call(name, *args)
        if code:
            raise CudaError(name, code, self.error_string(code))

    def get_int(self, name: str, *args: Any) -> int:
        v = ctypes.c_int(0)
        self.call(name, *args, ctypes.byref(v))
        return v.value

    def try_call(self, name: str, *args: Any) -> int:
        self.calls.append((name, self.current))
        if name in self.fail:
            return self.fail[name]
        return int(getattr(self, "_" + name)(*args))

    def devices_of(self, name: str) -> list[int]:
        """The current device at every call of ``name``."""
        return [d for n, d in self.calls if n == name]

    # ---- the runtime's state
    def _kvc_get_device(self, out: Any) -> int:
        out._obj.value = self.current
        return 0

    def _kvc_set_device(self, device: int) -> int:
        self.current = device
        return 0

    def _kvc_host_register(self, address: int, nbytes: int) -> int:
        self.registered[address] = nbytes
        return 0

    def _kvc_host_unregister(self, address: int) -> int:
        self.registered.pop(address)
        return 0

    def _kvc_malloc(self, out: Any, nbytes: int) -> int:
        buf = np.zeros(nbytes, dtype=np.uint8)
        self._buffers[buf.ctypes.data] = buf
        out._obj.value = buf.ctypes.data
        return 0

    def _kvc_free(self, ptr: int) -> int:
        del self._buffers[ptr]
        return 0

    def _kvc_memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        ctypes.memmove(dst, src, nbytes)
        return 0

    def _kvc_stream_synchronize(self, stream: int) -> int:
        return self.stream_status

    # ---- completion: the stream callback writes 1 + the stream's status
    def _kvc_notify_eventfd(self, stream: int, fd: int) -> int:
        if self.run_callbacks:
            os.eventfd_write(fd, 1 + self.stream_status)
        else:
            self.pending_fds.append(fd)
        return 0

    def _kvc_stream_query(self, stream: int) -> int:
        return self.stream_status

    # ---- kernels: the real host twins
    def _kvc_fp8_encode(self, *args: Any) -> int:
        assert self.host is not None
        return self.host.try_call("kvc_fp8_encode_host", *args[:-1])  # no stream

    def _kvc_fp8_decode(self, *args: Any) -> int:
        assert self.host is not None
        return self.host.try_call("kvc_fp8_decode_host", *args[:-1])


_NOT_READY = 600


class _Event:
    def __init__(self) -> None:
        self.recorded = 0   # records enqueued
        self.reached = 0    # records the GPU has run


class StandInGpu(StandInLibrary):
    """The stand-in as a recording device with deferred streams: asynchronous calls
    (copies, kernels, event records and waits, stream callbacks) are queued on their
    stream and run only when the test says so (:meth:`run`), in stream order, a
    ``kvc_stream_wait_event`` holding its stream until the event's record has run --
    CUDA's ordering rules, so a missing event shows as wrong bytes.  Host-blocking
    calls (``kvc_stream_synchronize``, a synchronous copy) are recorded in ``syncs``.

    Stream 0 stands for the legacy default stream; any other integer a test uses as
    the engine's compute stream is a stream too (:meth:`enqueue` puts the engine's own
    work on it)."""

    SYNCHRONISING = ("kvc_stream_synchronize",)

    def __init__(self, host: Library | None = None, current: int = 0,
                 auto: bool = False) -> None:
        super().__init__(host, current)
        self.auto = auto  # run whatever can run after every call (a GPU that keeps up)
        # Streams ``auto`` leaves alone (their work runs only when a test says so): a GPU
        # that keeps up with the store's copies while the mover's stream is held back.
        self.held: set[int] = set()
        self.queues: dict[int, list[tuple[str, Any]]] = {}
        self.events: dict[int, _Event] = {}
        self.syncs: list[str] = []
        # Bytes each enqueued copy moves: (call, stream, bytes).
        self.copied: list[tuple[str, int, int]] = []
        # CUDA graph capture: streams capturing now (a test starts one with
        # begin_capture), and every operation enqueued into a capture -- which on a GPU
        # would become a node of the engine's graph, replayed at every graph launch,
        # or pull kvstore's stream into the capture (a wait on a captured event).
        self.capturing: set[int] = set()
        self.captured: list[str] = []
        self._captured_events: set[int] = set()
        self._next = 1000

    def try_call(self, name: str, *args: Any) -> int:
        code = super().try_call(name, *args)
        if self.auto:
            self.run([s for s in self.queues if s not in self.held])
        return code

    def begin_capture(self, stream: int) -> None:
        """``stream`` starts capturing a CUDA graph (``torch.cuda.graph``'s begin)."""
        self.capturing.add(stream)

    def end_capture(self, stream: int) -> None:
        self.capturing.discard(stream)

    def is_capturing(self, stream: int) -> bool:
        return stream in self.capturing

    # ---- the queue
    def enqueue(self, stream: int, fn: Any, what: str = "engine work") -> None:
        """Queue ``fn()`` on ``stream`` (the engine's kernels in a test)."""
        if stream in self.capturing and what != "engine work":
            self.captured.append(f"{what} on stream {stream}")
        self.queues.setdefault(stream, []).append((what, fn))

    def _runnable(self, op: tuple[str, Any]) -> bool:
        what, fn = op
        if what == "wait":
            event, target = fn
            return self.events[event].reached >= target
        return True

    def run(self, streams: list[int] | None = None) -> int:
        """Run queued work of ``streams`` (default: all) until nothing more can run;
        how many operations ran."""
        ran = 0
        progress = True
        while progress:
            progress = False
            for s in list(self.queues if streams is None else streams):
                q = self.queues.get(s, [])
                while q and self._runnable(q[0]):
                    what, fn = q.pop(0)
                    if what != "wait":
                        fn()
                    ran += 1
                    progress = True
        return ran

    def pending(self, stream: int | None = None) -> int:
        return sum(len(q) for s, q in self.queues.items() if stream in (None, s))

    # ---- streams and events
    def _kvc_stream_create(self, out: Any) -> int:
        self._next += 1
        out._obj.value = self._next
        self.queues.setdefault(self._next, [])
        return 0

    def _kvc_stream_destroy(self, stream: int) -> int:
        return 0

    def _kvc_stream_synchronize(self, stream: int) -> int:
        self.syncs.append(f"kvc_stream_synchronize({stream})")
        self.run()
        return self.stream_status

    def _kvc_stream_query(self, stream: int) -> int:
        return self.stream_status or (_NOT_READY if self.queues.get(stream) else 0)

    def _kvc_event_create(self, out: Any) -> int:
        self._next += 1
        self.events[self._next] = _Event()
        out._obj.value = self._next
        return 0

    def _kvc_event_destroy(self, event: int) -> int:
        return 0

    def _kvc_event_record(self, event: int, stream: int) -> int:
        if stream in self.capturing:
            self._captured_events.add(event)
        else:
            self._captured_events.discard(event)
        ev = self.events[event]
        ev.recorded += 1
        target = ev.recorded

        def reach() -> None:
            ev.reached = max(ev.reached, target)
        self.enqueue(stream, reach, "record")
        return 0

    def _kvc_stream_wait_event(self, stream: int, event: int) -> int:
        if event in self._captured_events and stream not in self.capturing:
            # CUDA: waiting on an event recorded in a capture joins the capture.
            self.captured.append(f"stream {stream} joined the capture")
            self.capturing.add(stream)
        self.enqueue(stream, (event, self.events[event].recorded), "wait")
        return 0

    def _kvc_event_query(self, event: int) -> int:
        ev = self.events[event]
        return 0 if ev.reached >= ev.recorded else _NOT_READY

    def _kvc_notify_eventfd(self, stream: int, fd: int) -> int:
        if not self.run_callbacks:
            self.pending_fds.append(fd)
            return 0
        self.enqueue(stream, lambda: os.eventfd_write(fd, 1 + self.stream_status), "callback")
        return 0

    # ---- copies and kernels, queued
    def _kvc_memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        if stream == 0:   # the legacy stream as DeviceBuffer.upload uses it: then synced
            ctypes.memmove(dst, src, nbytes)
            return 0
        self.copied.append(("kvc_memcpy_async", stream, nbytes))
        self.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes), "memcpy")
        return 0

    def _kvc_memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                            rows: int, stream: int) -> int:
        def copy() -> None:
            for r in range(rows):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        self.copied.append(("kvc_memcpy2d_async", stream, rows * width))
        self.enqueue(stream, copy, "memcpy2d")
        return 0

    def _blocks(self, layer_ptrs: int, n_layers: int, outer: int, outer_stride: int,
                block_stride: int, inner: int, block_ids: int, n_ids: int,
                staging: int, gather: bool) -> Any:
        layers = list((ctypes.c_uint64 * n_layers).from_address(layer_ptrs))
        ids = list((ctypes.c_int64 * n_ids).from_address(block_ids)) if n_ids else []

        def copy() -> None:   # cuda_ext/gather_scatter.cu's addressing
            per_block = n_layers * outer * inner
            for i, b in enumerate(ids):
                for li, base in enumerate(layers):
                    for o in range(outer):
                        cache = base + o * outer_stride + b * block_stride
                        stage = staging + i * per_block + (li * outer + o) * inner
                        if gather:
                            ctypes.memmove(stage, cache, inner)
                        else:
                            ctypes.memmove(cache, stage, inner)
        return copy

    def _kvc_gather(self, *args: Any) -> int:
        self.enqueue(args[-1], self._blocks(*args[:-1], gather=True), "gather")
        return 0

    def _kvc_scatter(self, *args: Any) -> int:
        self.enqueue(args[-1], self._blocks(*args[:-1], gather=False), "scatter")
        return 0

    def _kvc_fp8_encode(self, *args: Any) -> int:
        assert self.host is not None
        host = self.host
        self.enqueue(args[-1], lambda: host.call("kvc_fp8_encode_host", *args[:-1]), "fp8")
        return 0

    def _kvc_fp8_decode(self, *args: Any) -> int:
        assert self.host is not None
        host = self.host
        self.enqueue(args[-1], lambda: host.call("kvc_fp8_decode_host", *args[:-1]),
                     "fp8 decode")
        return 0


# What stays on the device: memory allocated "like" a device tensor, and views of it
# (they alias its memory).  Everything else an OnDevice computes is a plain CPU tensor.
_STAYS_ON_DEVICE = frozenset((
    "new_empty", "new_zeros", "new_ones", "new_full", "view", "view_as", "reshape",
    "__getitem__", "unbind", "narrow", "select", "detach", "as_strided", "flatten",
    "unflatten", "transpose", "permute", "movedim", "squeeze", "unsqueeze", "split",
    "chunk", "expand"))


def _on_device(result: Any) -> Any:
    if type(result) is torch.Tensor:
        return result.as_subclass(OnDevice)
    if isinstance(result, (tuple, list)):
        return type(result)(_on_device(r) for r in result)
    return result


class OnDevice(torch.Tensor):
    """Host memory that says it is on ``cuda:0`` (for the stand-in GPU, whose "device
    memory" is host memory), recording every call that would copy device memory to the
    host and so wait for the GPU (``.to``, ``.cpu``, ``.item``, ``.tolist``, ``.numpy``).
    Memory allocated like it (``new_empty``, ``new_zeros``, ...) and its views
    (``view``, slices, ``unbind``, ...) are on the device too, as a CUDA tensor's are;
    anything else it computes, it computes as the CPU tensor it is (a plain tensor)."""

    log: list[str] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__get__" and owner == "device":
            return torch.device("cuda", 0)
        if name == "__get__" and owner == "is_cuda":
            return True
        if name in ("to", "cpu", "item", "tolist", "numpy", "__array__", "synchronize"):
            cls.log.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        return _on_device(result) if name in _STAYS_ON_DEVICE else result
