"""Device memory, streams, async copies, and completion the event loop can await.

Completion without blocking the loop: :func:`wait_stream` enqueues a stream callback
(``cudaStreamAddCallback``) that writes to an eventfd once everything queued before it
has finished, and awaits ``anyio.wait_readable`` on that fd -- the same way
:mod:`kvstore.io.uring` waits for io_uring completions.  No thread blocks in
``cudaStreamSynchronize``.  The callback runs exactly once, also when the stream has
failed (a "sticky" error such as a kernel's illegal address), and reports the stream's
status, which :func:`wait_stream` raises as :class:`CudaError`; a ``cudaLaunchHostFunc``
function, used before, is never called after such an error and the waiter slept for
ever.  In case a driver never runs the callback at all (a GPU lost), the waiter also
asks ``cudaStreamQuery`` once a second and gives up when it reports an error.

A cancelled waiter still waits (shielded) for the callback before the fd is closed,
because the callback writes to the fd number whenever the GPU gets there and that
number could otherwise belong to another file by then; GPU work cannot be cancelled
anyway, so this only delays a cancellation by the time the queued work needs.  When the
stream failed and the callback never ran, the fd is left open for the same reason: one
descriptor lost after a device failure, which leaves the CUDA context unusable anyway.

:func:`on_device` makes a device current for a block and restores the thread's previous
device after it (the current device is per-thread state that other CUDA code in the
process, torch's included, relies on).

These classes take raw device pointers and need no torch: the GPU checks use them
where torch has no CUDA build.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import anyio
import numpy as np
import numpy.typing as npt

from kvstore.cuda._lib import CudaError, Library, runtime

__all__ = ["DeviceBuffer", "Notice", "Stream", "copy_async", "on_device", "require_lib",
           "wait_stream"]

_NOT_READY = 600        # cudaErrorNotReady: kvc_stream_query's "still running"
CHECK_EVERY_S = 1.0     # how often a waiter asks cudaStreamQuery whether the stream failed


def require_lib() -> Library:
    """The library with a usable device, or :class:`CudaError` saying why not."""
    rt = runtime()
    if not rt.usable or rt.lib is None:
        raise CudaError("CUDA", -1, rt.reason)
    return rt.lib


@contextmanager
def on_device(device: int | None, lib: Library | None = None) -> Iterator[None]:
    """Run the block with ``device`` as this thread's current CUDA device (allocations,
    registrations and launches go there), then restore the device that was current,
    also when the block raises.  ``None`` leaves the current device alone."""
    if device is None:
        yield
        return
    lib = lib or require_lib()
    previous = lib.get_int("kvc_get_device")
    if previous == device:
        yield
        return
    lib.call("kvc_set_device", device)
    try:
        yield
    finally:
        # try_call: a failed restore (the context died in the block) must not hide the
        # block's own error.
        lib.try_call("kvc_set_device", previous)


class Stream:
    """A CUDA stream owned by kvstore (non-blocking w.r.t. the legacy default stream).
    ``handle`` is the cudaStream_t as an int, what every kernel entry point takes."""

    def __init__(self, lib: Library | None = None) -> None:
        self.lib = lib or require_lib()
        h = ctypes.c_uint64(0)
        self.lib.call("kvc_stream_create", ctypes.byref(h))
        self.handle = int(h.value)

    def synchronize(self) -> None:
        """Block this thread until the stream is idle (tests and tools, not the loop)."""
        self.lib.call("kvc_stream_synchronize", self.handle)

    async def wait(self) -> None:
        await wait_stream(self.handle, self.lib)

    def close(self) -> None:
        if self.handle:
            h, self.handle = self.handle, 0
            self.lib.call("kvc_stream_destroy", h)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


async def wait_stream(stream: int, lib: Library | None = None,
                      check_every: float = CHECK_EVERY_S) -> None:
    """Return once all work queued on ``stream`` so far has finished, without blocking
    the event loop; raise :class:`CudaError` if the stream failed (module docstring)."""
    lib = lib or require_lib()
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        lib.call("kvc_notify_eventfd", stream, efd)
    except BaseException:
        os.close(efd)
        raise
    fired, code = False, 0
    try:
        try:
            fired, code = await _await_callback(efd, stream, lib, check_every)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                fired, code = await _await_callback(efd, stream, lib, check_every)
            raise  # the cancellation wins; a sticky error shows again at the next call
    finally:
        if fired:
            os.close(efd)
    if code:
        raise CudaError("CUDA stream", code, lib.error_string(code))


class Notice:
    """Completion of the work queued on a stream *so far*, armed now and awaited later
    (possibly on another thread: the data mover arms on the engine's thread and the
    store's event loop awaits): the stream callback of :func:`wait_stream`, split in two.
    :meth:`poll` never blocks; :meth:`wait` awaits the eventfd; both raise
    :class:`CudaError` if the stream failed.  The fd is closed once the callback wrote."""

    def __init__(self, stream: int, lib: Library) -> None:
        self.stream, self.lib = stream, lib
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            lib.call("kvc_notify_eventfd", stream, self._efd)
        except BaseException:
            os.close(self._efd)
            raise
        self._code: int | None = None  # the stream's status once the callback ran

    @property
    def fired(self) -> bool:
        return self._code is not None

    def _take(self, code: int) -> None:
        self._code = code
        os.close(self._efd)

    def _raise(self) -> None:
        if self._code:
            raise CudaError("CUDA stream", self._code, self.lib.error_string(self._code))

    def poll(self) -> bool:
        """True once the work is done (a non-blocking eventfd read, no CUDA call)."""
        if self._code is None:
            try:
                self._take(os.eventfd_read(self._efd) - 1)
            except BlockingIOError:
                return False
        self._raise()
        return True

    async def wait(self, check_every: float = CHECK_EVERY_S) -> None:
        """Until the work is done; a cancelled waiter still waits (shielded) for the
        callback, so that nothing the copies use is freed under them."""
        if self._code is None:
            try:
                fired, code = await _await_callback(self._efd, self.stream, self.lib,
                                                    check_every)
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    fired, code = await _await_callback(self._efd, self.stream, self.lib,
                                                        check_every)
                if fired:
                    self._take(code)
                raise
            if fired:
                self._take(code)
            elif code:
                raise CudaError("CUDA stream", code, self.lib.error_string(code))
        self._raise()


async def _await_callback(efd: int, stream: int, lib: Library,
                          check_every: float) -> tuple[bool, int]:
    """(True, the stream's status) once the callback wrote to ``efd``; (False, error)
    when the stream reports an error and the callback has not run."""
    while True:
        with anyio.move_on_after(check_every):
            await anyio.wait_readable(efd)
        try:
            return True, os.eventfd_read(efd) - 1
        except BlockingIOError:
            pass
        code = lib.try_call("kvc_stream_query", stream)
        if code not in (0, _NOT_READY):
            return False, code


class DeviceBuffer:
    """``nbytes`` of device memory from ``cudaMalloc``; freed by ``close`` (or ``with``)."""

    def __init__(self, nbytes: int, lib: Library | None = None) -> None:
        if nbytes < 1:
            raise ValueError(f"a device buffer needs at least 1 byte, got {nbytes}")
        self.lib = lib or require_lib()
        p = ctypes.c_void_p(0)
        self.lib.call("kvc_malloc", ctypes.byref(p), nbytes)
        self.ptr = int(p.value or 0)
        self.nbytes = nbytes

    def upload(self, host: npt.NDArray[np.generic], stream: int = 0, offset: int = 0) -> None:
        """Synchronous copy of a contiguous host array into the buffer at ``offset``."""
        a = np.ascontiguousarray(host)
        if offset + a.nbytes > self.nbytes:
            raise ValueError(f"{a.nbytes} bytes at offset {offset} do not fit {self.nbytes}")
        self.lib.call("kvc_memcpy_async", self.ptr + offset, a.ctypes.data, a.nbytes, stream)
        self.lib.call("kvc_stream_synchronize", stream)

    def download(self, host: npt.NDArray[np.generic], stream: int = 0, offset: int = 0) -> None:
        """Synchronous copy from the buffer at ``offset`` into contiguous ``host``."""
        if not host.flags.c_contiguous or not host.flags.writeable:
            raise ValueError("download needs a writable C-contiguous array")
        if offset + host.nbytes > self.nbytes:
            raise ValueError(f"{host.nbytes} bytes at offset {offset} exceed {self.nbytes}")
        self.lib.call("kvc_memcpy_async", host.ctypes.data, self.ptr + offset, host.nbytes,
                      stream)
        self.lib.call("kvc_stream_synchronize", stream)

    def close(self) -> None:
        if self.ptr:
            p, self.ptr = self.ptr, 0
            self.lib.call("kvc_free", p)

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


async def copy_async(dst: int, src: int, nbytes: int, stream: int,
                     lib: Library | None = None) -> None:
    """Copy ``nbytes`` between any two addresses the device can reach (device memory,
    page-locked host memory; the direction follows from the pointers) on
    ``stream`` and await its completion without blocking the loop.  H2D/D2H from page-locked
    memory is a DMA that overlaps other work; from pageable memory CUDA stages it."""
    lib = lib or require_lib()
    lib.call("kvc_memcpy_async", dst, src, nbytes, stream)
    await wait_stream(stream, lib)
