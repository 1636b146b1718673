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
