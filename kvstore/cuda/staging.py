"""Bounded page-locked staging for the data mover (:mod:`kvstore.cuda.mover`).

One anonymous page-aligned mapping (:class:`kvstore.io.arena.Arena`'s allocator), made
and, when CUDA is usable, registered as page-locked memory *once*, at construction, through
the process-wide :func:`kvstore.cuda.page_locked.pool` (bounded, unregistered at close and at
exit).  Copies between the GPU and a lease are DMAs; no pageable buffer is involved.

:meth:`StagingPool.try_take` never waits: a caller that finds no room gets ``None`` and
decides (the mover drops the save and counts it: an engine step must never wait for the
disk).  A lease is handed back with :meth:`Lease.release`; the mover defers that until the
copies that use it have completed (their copy-done event), so staging is never reused
while the GPU may still read or write it.  Thread-safe: the engine's thread takes leases,
the store's event loop returns them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvstore.cuda._lib import Library
from kvstore.io.arena import Arena, ArenaRun

__all__ = ["DeviceLease", "DeviceStagingPool", "Lease", "StagingPool", "StagingStats"]


@dataclass
class StagingStats:
    capacity_bytes: int = 0
    in_use_bytes: int = 0
    peak_bytes: int = 0
    leases: int = 0      # leases handed out
    refused: int = 0     # try_take calls that found no room
    page_locked: bool = False


class Lease:
    """A run of the pool owned by one batch until :meth:`release` (idempotent)."""

    __slots__ = ("pool", "run", "nbytes", "released")

    def __init__(self, pool: StagingPool, run: ArenaRun, nbytes: int) -> None:
        self.pool, self.run, self.nbytes, self.released = pool, run, nbytes, False

    @property
    def address(self) -> int:
        return self.pool.arena.address + self.run.offset

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The lease's first bytes as a CPU tensor of ``dtype`` and ``shape``."""
        return _view(self.pool.arena.tensor, self.run.offset, self.nbytes, dtype, shape)

    def release(self) -> None:
        self.pool._give_back(self)


class StagingPool:
    """``capacity`` bytes of page-locked host staging (module docstring).  ``lib``: the
    CUDA library to register it with (``None``: plain host memory, for CPU engines)."""

    def __init__(self, capacity: int, lib: Library | None = None,
                 owner: str = "kvstore data mover") -> None:
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1 byte, got {capacity}")
        self.arena = Arena(capacity)
        self._lock = threading.Lock()
        self._stats = StagingStats(capacity_bytes=self.arena.size)
        self._registered = False
        if lib is not None:
            from kvstore.cuda.page_locked import pool

            # Registered once, here: never per copy (the LMCache leak: page-locked buffers
            # per request, freed late or never).
            self.arena.populate()
            pool().register(self.arena.address, self.arena.size, owner)
            self._registered = True
        self._stats.page_locked = self._registered
        self.closed = False

    @property
    def capacity(self) -> int:
        return self.arena.size

    def try_take(self, nbytes: int) -> Lease | None:
        """A lease of ``nbytes`` (rounded up to pages), or ``None`` at once if there is no
        room now (never waits)."""
        with self._lock:
            run = None if self.closed else self.arena.try_acquire(max(nbytes, 1))
            if run is None:
                self._stats.refused += 1
                return None
            s = self._stats
            s.leases += 1
            s.in_use_bytes += run.length
            s.peak_bytes = max(s.peak_bytes, s.in_use_bytes)
            return Lease(self, run, nbytes)

    def _give_back(self, lease: Lease) -> None:
        with self._lock:
            if lease.released:
                return
            lease.released = True
            self._stats.in_use_bytes -= lease.run.length
            self.arena.release(lease.run)

    def stats(self) -> StagingStats:
        with self._lock:
            s = self._stats
            return StagingStats(s.capacity_bytes, s.in_use_bytes, s.peak_bytes, s.leases,
                                s.refused, s.page_locked)

    def close(self) -> None:
        """Unregister (before unmapping) and unmap.  The caller makes sure no copy still
        uses a lease (the mover waits for its streams first)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if self._registered:
            from kvstore.cuda.page_locked import pool

            self._registered = False
            pool().unregister(self.arena.address)
        self.arena.close()


class DeviceLease:
    """A run of a :class:`DeviceStagingPool`, owned by one batch until :meth:`release`."""

    __slots__ = ("pool", "offset", "nbytes", "length", "released")

    def __init__(self, pool: DeviceStagingPool, offset: int, nbytes: int, length: int) -> None:
        self.pool, self.offset, self.nbytes, self.length = pool, offset, nbytes, length
        self.released = False

    @property
    def address(self) -> int:
        return self.pool.address + self.offset

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The lease's first bytes as a tensor of ``dtype`` and ``shape`` on the device."""
        return _view(self.pool.backing, self.offset, self.nbytes, dtype, shape)

    def release(self) -> None:
        self.pool._give_back(self)


class DeviceStagingPool:
    """Bounded staging in the device's memory, for loads: the store's reads land there
    straight from its page-locked arena (one DMA, no host copy), and the mover scatters
    from there.  One allocation (``like.new_empty``: torch's allocator, made once), handed
    out first-fit in 256-byte-aligned runs; :meth:`try_take` never waits.  Same interface
    as :class:`StagingPool`."""

    ALIGN = 256

    def __init__(self, capacity: int, like: torch.Tensor) -> None:
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1 byte, got {capacity}")
        self.capacity = -(-capacity // self.ALIGN) * self.ALIGN
        with torch.inference_mode(False):
            self.backing = like.new_empty((self.capacity,), dtype=torch.uint8)
        self.address = int(self.backing.data_ptr())
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (start, length), sorted
        self._lock = threading.Lock()
        self._stats = StagingStats(capacity_bytes=self.capacity)
        self.closed = False

    def try_take(self, nbytes: int) -> DeviceLease | None:
        need = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (start, length) in enumerate([] if self.closed else self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, length - need)
                    s = self._stats
                    s.leases += 1
                    s.in_use_bytes += need
                    s.peak_bytes = max(s.peak_bytes, s.in_use_bytes)
                    return DeviceLease(self, start, nbytes, need)
            self._stats.refused += 1
            return None

    def _give_back(self, lease: DeviceLease) -> None:
        with self._lock:
            if lease.released:
                return
            lease.released = True
            self._stats.in_use_bytes -= lease.length
            free = sorted([*self._free, (lease.offset, lease.length)])
            merged: list[tuple[int, int]] = []
            for start, length in free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged

    def stats(self) -> StagingStats:
        with self._lock:
            s = self._stats
            return StagingStats(s.capacity_bytes, s.in_use_bytes, s.peak_bytes, s.leases,
                                s.refused, False)

    def close(self) -> None:
        with self._lock:
            self.closed = True
        del self.backing


def _view(backing: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype,
          shape: tuple[int, ...]) -> torch.Tensor:
    """A lease's first bytes (``nbytes`` of ``backing`` from ``offset``) as a tensor of
    ``dtype`` and ``shape``.  Not an inference tensor, also when made under
    ``torch.inference_mode`` (vLLM's hooks): the store writes loads into it from its own
    thread."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n > nbytes:
        raise ValueError(f"{n} bytes do not fit a {nbytes}-byte lease")
    with torch.inference_mode(False):
        return backing[offset:offset + n].view(dtype).view(shape)
