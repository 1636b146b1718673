"""ctypes binding of ``libkvcuda.so`` (ABI in ``cuda_ext/kvcuda.h``) and the probe that
decides whether the GPU path is used.

Loading never raises: :func:`runtime` returns a :class:`Runtime` whose ``lib`` is the
bound library (or None) and whose ``reason`` says, in one sentence, why CUDA is or is
not used -- library not built, built from other sources (ABI mismatch), no driver or a
driver too old for the runtime, no device.  Errors of calls into a working library
raise :class:`CudaError` with CUDA's own message.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import KVStoreError

__all__ = ["ABI_VERSION", "CudaError", "Library", "Runtime", "load", "runtime"]

ABI_VERSION = 3  # cuda_ext/kvcuda.h KVC_ABI_VERSION

_c_int_p = ctypes.POINTER(ctypes.c_int)
_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_ptr = ctypes.c_void_p

# name -> argument types (every function returns int)
_SIGNATURES: dict[str, list[type]] = {
    "kvc_abi_version": [],
    "kvc_runtime_version": [_c_int_p],
    "kvc_driver_version": [_c_int_p],
    "kvc_device_count": [_c_int_p],
    "kvc_set_device": [ctypes.c_int],
    "kvc_get_device": [_c_int_p],
    "kvc_device_name": [ctypes.c_int, ctypes.c_char_p, ctypes.c_int],
    "kvc_host_register": [_ptr, _i64],
    "kvc_host_unregister": [_ptr],
    "kvc_malloc": [ctypes.POINTER(_ptr), _i64],
    "kvc_free": [_ptr],
    "kvc_memset_async": [_ptr, ctypes.c_int, _i64, _u64],
    "kvc_memcpy_async": [_ptr, _ptr, _i64, _u64],
    "kvc_memcpy2d_async": [_ptr, _i64, _ptr, _i64, _i64, _i64, _u64],
    "kvc_stream_create": [ctypes.POINTER(_u64)],
    "kvc_stream_destroy": [_u64],
    "kvc_stream_synchronize": [_u64],
    "kvc_stream_query": [_u64],
    "kvc_notify_eventfd": [_u64, ctypes.c_int],
    "kvc_event_create": [ctypes.POINTER(_u64)],
    "kvc_event_destroy": [_u64],
    "kvc_event_record": [_u64, _u64],
    "kvc_stream_wait_event": [_u64, _u64],
    "kvc_event_query": [_u64],
    "kvc_gather": [_ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _u64],
    "kvc_scatter": [_ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _u64],
    "kvc_fp8_encode": [_ptr, ctypes.c_int, _i64, _i64, _ptr, _i64, ctypes.c_int, _ptr, _ptr,
                       _ptr, _u64],
    "kvc_fp8_decode": [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_int, ctypes.c_int, _ptr, _u64],
    "kvc_fp8_encode_host": [_ptr, ctypes.c_int, _i64, _i64, _ptr, _i64, ctypes.c_int, _ptr,
                            _ptr, _ptr],
    "kvc_fp8_decode_host": [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_int, ctypes.c_int, _ptr],
}


class CudaError(KVStoreError):
    """A call into the CUDA library failed (raised by :mod:`kvstore.cuda`); ``code`` is
    the cudaError_t value (or a negative kvcuda code)."""

    def __init__(self, what: str, code: int, message: str) -> None:
        super().__init__(f"{what} failed: {message} (code {code})")
        self.code = code


class Library:
    """The bound library: ``lib.call("kvc_x", ...)`` raises :class:`CudaError` on failure."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dll = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self._dll, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self._dll.kvc_error_string.argtypes = [ctypes.c_int]
        self._dll.kvc_error_string.restype = ctypes.c_char_p
        self._dll.kvc_build_info.argtypes = []
        self._dll.kvc_build_info.restype = ctypes.c_char_p

    def error_string(self, code: int) -> str:
        msg: bytes | None = self._dll.kvc_error_string(code)
        return (msg or b"?").decode(errors="replace")

    @property
    def build_info(self) -> str:
        info: bytes | None = self._dll.kvc_build_info()
        return (info or b"").decode(errors="replace")

    def call(self, name: str, *args: object) -> None:
        code = int(getattr(self._dll, name)(*args))
        if code:
            raise CudaError(name, code, self.error_string(code))

    def try_call(self, name: str, *args: object) -> int:
        return int(getattr(self._dll, name)(*args))

    def get_int(self, name: str, *args: object) -> int:
        v = ctypes.c_int(0)
        self.call(name, *args, ctypes.byref(v))
        return v.value


@dataclass(frozen=True)
class Runtime:
    """What the probe found.  ``usable``: kernels can run (library loaded and >= 1 device)."""

    lib: Library | None
    reason: str
    device_count: int = 0
    device: int = 0
    device_name: str = ""
    driver_version: int = 0
    runtime_version: int = 0

    @property
    def usable(self) -> bool:
        return self.lib is not None and self.device_count > 0


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def load(path: Path | str | None = None) -> Runtime:
    """Load and probe the library at ``path`` (default: the build's output path).  Never
    raises; the returned Runtime's ``reason`` says why it is unusable."""
    from kvstore.cuda.build import default_library_path

    path = Path(path) if path is not None else default_library_path()
    if not path.is_file():
        return Runtime(None, f"CUDA library not built ({path} does not exist): run "
                             "`python -m kvstore cuda build` on a machine with nvcc")
    try:
        lib = Library(path)
    except (OSError, AttributeError) as e:
        return Runtime(None, f"CUDA library {path} does not load ({e}); rebuild it with "
                             "`python -m kvstore cuda build`")
    abi = lib.try_call("kvc_abi_version")
    if abi != ABI_VERSION:
        return Runtime(None, f"CUDA library {path} has ABI version {abi}, this kvstore needs "
                             f"{ABI_VERSION}; rebuild it with `python -m kvstore cuda build`")
    rt = ctypes.c_int(0)
    drv = ctypes.c_int(0)
    lib.try_call("kvc_runtime_version", ctypes.byref(rt))
    lib.try_call("kvc_driver_version", ctypes.byref(drv))
    count = ctypes.c_int(0)
    code = lib.try_call("kvc_device_count", ctypes.byref(count))
    if code:
        why = lib.error_string(code)
        if drv.value == 0:
            detail = "no NVIDIA driver found"
        elif drv.value < rt.value:
            detail = (f"driver supports CUDA {_version(drv.value)}, the library was built with "
                      f"CUDA {_version(rt.value)}: update the driver or rebuild with an older "
                      "toolkit")
        else:
            detail = f"driver CUDA {_version(drv.value)}"
        return Runtime(lib, f"no usable CUDA device: {why} (code {code}; {detail})",
                       driver_version=drv.value, runtime_version=rt.value)
    if count.value < 1:
        return Runtime(lib, "no CUDA device", driver_version=drv.value,
                       runtime_version=rt.value)
    device = int(os.environ.get("KVSTORE_CUDA_DEVICE", "0"))
    if not 0 <= device < count.value:
        return Runtime(lib, f"KVSTORE_CUDA_DEVICE={device} but only {count.value} device(s)",
                       driver_version=drv.value, runtime_version=rt.value)
    name = ctypes.create_string_buffer(256)
    lib.call("kvc_device_name", device, name, 256)
    dev_name = name.value.decode(errors="replace")
    return Runtime(lib, f"CUDA device {device}: {dev_name}, driver CUDA {_version(drv.value)}",
                   count.value, device, dev_name, drv.value, rt.value)


_lock = threading.Lock()
_runtime: Runtime | None = None


def runtime() -> Runtime:
    """The process-wide probe result (probed once, on first use)."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = load()
        return _runtime


def reset_for_tests(rt: Runtime | None) -> Runtime | None:
    """Swap the process-wide runtime (tests load a freshly built library); returns the old."""
    global _runtime
    with _lock:
        old, _runtime = _runtime, rt
        return old
