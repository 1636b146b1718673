"""The optional CUDA path as the store hands it to its parts: the device copier
(:class:`kvstore.io.device_copies.DeviceCopier`) and the page locker
(:data:`kvstore.io.page_locking.PageLocker`).

io/ and core/ stay below :mod:`kvstore.cuda` (tests/test_imports.py): they name what they
need as protocols, and ``Store`` passes these implementations to ``StoreParts``.  Each
one loads :mod:`kvstore.cuda` on first use, never on ``import kvstore``: a store whose
values and outputs are on the CPU and that opens with ``page_lock_staging=False`` never
loads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.io import page_locking
from kvstore.io.arena import Arena
from kvstore.io.device_copies import DeviceCopies, HostCopies, copied_by_torch, on_device
from kvstore.io.page_locking import ArenaPageLock, NotLocked, PageLocker

__all__ = ["CUDA_COPIER", "CudaCopier", "page_lock", "page_locker"]


class CudaCopier:
    """Copies through kvstore's CUDA library (eventfd completion, FP8 decoded on the GPU)
    when it is usable, else through torch's CUDA API (a side stream, an event waited for
    on a worker thread), else host copies (a device only a test's stand-in claims)."""

    def copies(self) -> DeviceCopies:
        from kvstore.cuda import available, torch_copies

        if available():
            from kvstore.cuda.copies import DeviceCopies as LibraryCopies

            return LibraryCopies()
        return torch_copies.TorchCopies() if torch_copies.usable() else HostCopies()

    async def to_host(self, values: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """A put's values with tensors on a device copied to page-locked host memory by
        stream-ordered copies, awaited, never a synchronize (:func:`kvstore.cuda.copies.
        to_host` or, without kvstore's library, :func:`kvstore.cuda.torch_copies.to_host`).
        ``values`` itself when none is on a device; a value on a device neither can drive
        (only a stand-in) is copied by torch as it can."""
        if not on_device(values):
            return values
        from kvstore.cuda import available, torch_copies

        if available():
            from kvstore.cuda.copies import to_host

            values = await to_host(values)
        elif torch_copies.usable():
            values = await torch_copies.to_host(values)
        return copied_by_torch(values)


CUDA_COPIER = CudaCopier()


def page_lock(arena: Arena, mode: bool | None) -> ArenaPageLock:
    """The store's own locker: CUDA host registration
    (:func:`kvstore.cuda.page_locked.page_lock_arena`).  ``mode=False`` loads nothing."""
    if mode is False:
        return NotLocked("cuda: not used (page_lock_staging=False)")
    from kvstore.cuda.page_locked import page_lock_arena as cuda_page_lock

    return cuda_page_lock(arena, mode)


def page_locker() -> PageLocker:
    """The locker a store opened now uses: the one installed with
    :func:`kvstore.io.page_locking.set_default_page_locker`, else :func:`page_lock`."""
    return page_locking.default_page_locker() or page_lock
