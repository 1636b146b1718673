"""Page-locked host memory: the staging arena registered with ``cudaHostRegister``.

"Page-locked" is what CUDA calls host memory the device can DMA to and from (torch says
"pinned"); kvstore keeps *pin* for the never-evict feature (``Store.pin``).

kvstore never allocates page-locked memory of its own: it registers the store's staging
arena (kvstore/io/arena.py), the same pages io_uring reads into, so a get lands where
the GPU can DMA it with no extra host copy.  Hygiene, the recurring leak in peers
(LMCache #1285, #2017: pinned (page-locked) buffers allocated per request, freed late or never):

* bounded: a process-wide :class:`PageLockedPool` refuses registrations beyond
  ``limit_bytes`` (``$KVSTORE_CUDA_PAGE_LOCKED_LIMIT``, default half of physical memory:
  page-locked pages cannot be swapped or reclaimed, so unbounded page-locking starves the
  host; the old name ``$KVSTORE_CUDA_PINNED_LIMIT`` is read, with a DeprecationWarning,
  when the new one is unset, for one release);
* registered once per arena, at open; unregistered at close, *before* the arena is
  unmapped (cudaHostUnregister of an unmapped range fails and leaves driver state);
* an ``atexit`` hook unregisters whatever is still registered when the process exits
  without closing its stores.

``page_lock_arena(arena, mode)`` is the store's page locker: ``mode=None`` page-locks when
CUDA is usable and otherwise just records why not; ``True`` requires it (raises
:class:`CudaError`); ``False`` never page-locks.  Registration goes through kvstore's CUDA library, or, where it
is not built but torch drives a GPU, through torch's binding of the same runtime call
(``torch.cuda.cudart().cudaHostRegister``): the arena is then still page-locked for the
copies :mod:`kvstore.cuda.torch_copies` makes from it.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from contextlib import suppress
from dataclasses import dataclass

from kvstore.cuda._lib import CudaError, runtime
from kvstore.cuda.device import on_device
from kvstore.io.arena import Arena

__all__ = ["LIMIT_ENV", "CudaArenaPageLock", "PageLockedPool", "page_lock_arena", "pool"]

LIMIT_ENV = "KVSTORE_CUDA_PAGE_LOCKED_LIMIT"
# Its name before "pin" came to mean only never-evict: still read for one release.
_OLD_LIMIT_ENV = "KVSTORE_CUDA_PINNED_LIMIT"


def _default_limit() -> int:
    env = os.environ.get(LIMIT_ENV)
    if not env and (env := os.environ.get(_OLD_LIMIT_ENV)):
        warnings.warn(f"{_OLD_LIMIT_ENV} is renamed {LIMIT_ENV}; the old name goes in the "
                      "next release", DeprecationWarning, stacklevel=3)
    if env:
        return int(env)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class _Region:
    address: int
    nbytes: int
    owner: str
    via_torch: bool = False   # registered through torch's cudart, not kvstore's library


def _torch_cudart() -> object | None:
    """torch's CUDA runtime binding when torch drives a GPU here (and kvstore's library is
    not usable), else None."""
    from kvstore.cuda import torch_copies

    if not torch_copies.usable():
        return None
    import torch

    cudart: object = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return cudart


def _torch_call(name: str, *args: int) -> None:
    code = int(getattr(_torch_cudart(), name)(*args))
    if code:
        raise CudaError(name, code, f"CUDA error {code} (through torch's cudart)")


class PageLockedPool:
    """Every host range this process registered, with a byte budget."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit_bytes = _default_limit() if limit_bytes is None else limit_bytes
        self._regions: dict[int, _Region] = {}
        self._lock = threading.Lock()
        self._atexit = False

    @property
    def registered_bytes(self) -> int:
        return sum(r.nbytes for r in self._regions.values())

    @property
    def regions(self) -> int:
        return len(self._regions)

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies inside one registered range (the
        device can then read and write it in place)."""
        with self._lock:
            return any(r.address <= address and address + nbytes <= r.address + r.nbytes
                       for r in self._regions.values())

    def register(self, address: int, nbytes: int, owner: str) -> None:
        rt = runtime()
        via_torch = not rt.usable or rt.lib is None
        if via_torch and _torch_cudart() is None:
            raise CudaError("cudaHostRegister", -1, rt.reason)
        with self._lock:
            if address in self._regions:
                raise ValueError(f"{owner}: range at {address:#x} is already registered")
            if self.registered_bytes + nbytes > self.limit_bytes:
                raise CudaError("cudaHostRegister", -1,
                                f"page-locking {nbytes} more bytes for {owner} would exceed "
                                f"the page-locked memory limit of {self.limit_bytes} bytes "
                                f"({self.registered_bytes} in use); raise {LIMIT_ENV} or "
                                "use a smaller staging_bytes")
            if via_torch:   # torch's current device; it keeps the thread's as it was
                _torch_call("cudaHostRegister", address, nbytes, 0)
            else:
                assert rt.lib is not None
                # On kvstore's device, and the thread's current device back afterwards:
                # the engine's own CUDA work on this thread must not move to another GPU.
                with on_device(rt.device, rt.lib):
                    rt.lib.call("kvc_host_register", address, nbytes)
            self._regions[address] = _Region(address, nbytes, owner, via_torch)
            if not self._atexit:
                # Registered after CUDA initialised, so it runs before the runtime's own
                # teardown (atexit is LIFO).
                atexit.register(self.release_all)
                self._atexit = True

    def unregister(self, address: int) -> None:
        with self._lock:
            region = self._regions.pop(address, None)
        if region is None:
            return
        if region.via_torch:
            _torch_call("cudaHostUnregister", address)
            return
        lib = runtime().lib
        if lib is not None:
            lib.call("kvc_host_unregister", address)

    def release_all(self) -> None:
        for address in list(self._regions):
            # At exit the driver may already be gone; then nothing is left to leak.
            with suppress(CudaError):
                self.unregister(address)


_pool: PageLockedPool | None = None


def pool() -> PageLockedPool:
    global _pool
    if _pool is None:
        _pool = PageLockedPool()
    return _pool


class CudaArenaPageLock:
    """The outcome of :func:`page_lock_arena` (a
    :class:`kvstore.io.page_locking.ArenaPageLock`); ``status`` is what
    ``Store.stats().cuda`` shows."""

    def __init__(self, arena: Arena, status: str, locked: bool) -> None:
        self.arena, self.status, self.locked = arena, status, locked

    def close(self) -> None:
        """Unregister (before the arena is unmapped).  Idempotent."""
        if self.locked:
            self.locked = False
            pool().unregister(self.arena.address)
            self.status = "cuda: arena unlocked (store closed)"


def page_lock_arena(arena: Arena, mode: bool | None) -> CudaArenaPageLock:
    """Register ``arena`` as page-locked memory per ``mode`` (module docstring)."""
    if mode is False:
        return CudaArenaPageLock(arena, "cuda: not used (page_lock_staging=False)", False)
    rt = runtime()
    via_torch = not rt.usable and _torch_cudart() is not None
    if not rt.usable and not via_torch:
        if mode:
            raise CudaError("page_lock_staging=True", -1, rt.reason)
        return CudaArenaPageLock(arena, f"cuda: unavailable ({rt.reason})", False)
    try:
        pool().register(arena.address, arena.size, f"staging arena at {arena.address:#x}")
    except CudaError as e:
        if mode:
            raise
        return CudaArenaPageLock(arena, f"cuda: arena not page-locked ({e})", False)
    if via_torch:
        import torch

        return CudaArenaPageLock(
            arena, f"cuda: page-locked arena ({arena.size} bytes) on device "
                   f"{torch.cuda.current_device()} through torch (kvstore's CUDA library: "
                   f"{rt.reason})", True)
    return CudaArenaPageLock(arena, f"cuda: page-locked arena ({arena.size} bytes) on device "
                                    f"{rt.device} ({rt.device_name})", True)
