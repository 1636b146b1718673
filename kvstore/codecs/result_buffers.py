"""Memory for the tensors a get returns when the caller gives no ``out=``: recycled,
not fresh, so that a read does not pay the kernel to fault in and zero every page.

Why: a get into new tensors used to cost 5-8x the client CPU of a get into the caller's
own buffers (``benchmarks/remote.py``: 2.6-7.1 core-s/GiB against 1.4-1.9 with ``out=``,
rising as a process runs), and almost all of the difference was the first touch of
fresh memory: glibc hands allocations this large to ``mmap`` and gives them back with
``munmap`` when the tensor dies, so every 4 KiB page of every result is faulted and
zeroed again (262k faults per GiB), under the mm lock that the reading threads share.
Transparent huge pages, which would make that 512x rarer, do not take on the VMs this
was measured on.  A tensor's memory that is handed back here when the tensor dies is
already mapped: the next result of that size is written at memcpy speed.

How the memory comes back: each result is a ``torch.from_numpy`` view of a numpy view of
a pooled slab.  torch's storage holds the numpy view until the storage itself is freed
(every tensor viewing it is gone, whatever the caller did with it), and a weak reference
on the numpy view returns the slab then.  So memory is reused exactly when ``free``
would have made it reusable, as with ``torch.empty``: never while any tensor, or a numpy
array or ``memoryview`` taken from one, still holds the storage.  (Like ``free``, it
does not see raw pointers: a ``t.numpy()`` array taken before ``t.share_memory_()``,
which moves the data to shared memory and frees the old pages, pointed at freed memory
before too.)

Unlike ``torch.empty``'s, a result's storage cannot grow (``resize_`` past its size
raises, as for any ``torch.from_numpy`` tensor); ``clone()`` one that must.

Bounds: only results of at least ``MIN_BYTES`` are pooled (smaller ones come from
malloc's own free lists, already warm); at most ``max_bytes`` of idle slabs are kept
(default 256 MiB, ``KVSTORE_RESULT_BUFFER_BYTES`` or :func:`configure`; 0 turns pooling
off); past it the least recently returned sizes are dropped.  Memory handed out is the
caller's: it counts only once it is idle again.  The pool is process-wide, as an
allocator is: the tensors outlive the store that read them.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

MIN_BYTES = 256 << 10
DEFAULT_MAX_BYTES = 256 << 20
_ENV = "KVSTORE_RESULT_BUFFER_BYTES"


@dataclass
class ResultBufferStats:
    reused: int = 0  # results written into a recycled slab
    allocated: int = 0  # results that needed a new slab (pool empty for that size)
    idle_bytes: int = 0  # slabs kept for reuse now
    dropped: int = 0  # slabs given back to the system past the bound (returned or trimmed)


class ResultBuffers:
    """A bounded, thread-safe pool of idle result slabs, keyed by exact size."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # size -> idle slabs; dict order = least recently returned size first
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        # Slabs come back from weakref callbacks, which run wherever the last reference
        # died: possibly inside ``empty`` on this very thread (a collection triggered by
        # an allocation) with the lock held.  So a callback appends here (atomic under
        # the GIL) and files what is queued only if it gets the lock without waiting;
        # else the holder files it (every holder drains this queue, then checks it
        # again once it let go of the lock).
        self._returned: deque[np.ndarray] = deque()
        self._stats = ResultBufferStats()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised, contiguous, writable CPU tensor of ``shape`` and ``dtype``
        (``torch.empty``), in recycled memory when the pool has a slab of its size."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if nbytes < MIN_BYTES or self.max_bytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            self._file_returned()
            slabs = self._idle.get(nbytes)
            if slabs:
                slab = slabs.pop()
                self._idle_bytes -= nbytes
                if not slabs:
                    del self._idle[nbytes]
                self._stats.reused += 1
            else:
                slab = None
                self._stats.allocated += 1
        self._collect()  # what came back while the lock was held
        if slab is None:
            slab = np.empty(nbytes, dtype=np.uint8)
        view = slab[:]
        # not at exit: the slab is freed with the process
        weakref.finalize(view, self._release, slab).atexit = False
        return torch.from_numpy(view).view(dtype).view(shape)

    def _release(self, slab: np.ndarray) -> None:
        """The finalizer of a slab's view: its last user is gone."""
        self._returned.append(slab)
        self._collect()

    def _collect(self) -> None:
        """File the returned slabs now if the lock is free (never waits for it)."""
        if self._returned and self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        """With the lock: file the slabs returned since, dropping the least recently
        returned sizes past ``max_bytes``."""
        while self._returned:
            slab = self._returned.popleft()
            size = slab.nbytes
            if size > self.max_bytes:
                self._stats.dropped += 1
                continue
            slabs = self._idle.pop(size, [])
            slabs.append(slab)
            self._idle[size] = slabs  # now the most recently returned size
            self._idle_bytes += size
            self._trim()

    def _trim(self) -> None:
        """With the lock: drop idle slabs of the least recently returned sizes until
        at most ``max_bytes`` are idle."""
        while self._idle and self._idle_bytes > self.max_bytes:
            oldest = next(iter(self._idle))
            victims = self._idle[oldest]
            victims.pop(0)
            self._idle_bytes -= oldest
            self._stats.dropped += 1
            if not victims:
                del self._idle[oldest]

    def resize(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of idle slabs from now on (0: no pooling); idle
        slabs past the new bound are dropped now, the least recently returned first."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        with self._lock:
            self.max_bytes = max_bytes
            self._file_returned()
            self._trim()

    def release(self) -> None:
        """Drop every idle slab (memory handed out stays the callers')."""
        with self._lock:
            self._file_returned()
            self._idle.clear()
            self._idle_bytes = 0

    def stats(self) -> ResultBufferStats:
        with self._lock:
            self._file_returned()
            s = self._stats
            return ResultBufferStats(s.reused, s.allocated, self._idle_bytes, s.dropped)

    def _after_fork(self) -> None:
        """In a forked child: another thread may have held the lock, in the middle of
        an update, at the fork.  The child starts with an empty pool; results it
        inherited still come back to it when they die there."""
        self._lock = threading.Lock()
        self._idle.clear()
        self._idle_bytes = 0
        self._returned.clear()


def _default_max_bytes() -> int:
    text = os.environ.get(_ENV)
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{_ENV}={text!r}: expected a number of bytes (0 turns the "
                         f"pool off)") from None
    if value < 0:
        raise ValueError(f"{_ENV}={text!r}: expected a number of bytes >= 0")
    return value


_pool = ResultBuffers(_default_max_bytes())
os.register_at_fork(after_in_child=_pool._after_fork)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new result tensor from the process's pool (see :meth:`ResultBuffers.empty`)."""
    return _pool.empty(shape, dtype)


def configure(max_bytes: int) -> None:
    """Keep at most ``max_bytes`` of idle result memory in this process (0: no
    pooling); idle memory past the new bound is given back now."""
    _pool.resize(max_bytes)


def stats() -> ResultBufferStats:
    return _pool.stats()


def release() -> None:
    """Give every idle result slab back to the system."""
    _pool.release()
