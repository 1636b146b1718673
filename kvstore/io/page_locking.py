"""Page-locking the store's host memory for device DMA: a hook the store calls when it
maps its staging arena (and the memory tier's region).

"Page-locked" is CUDA's name for host memory the device can copy to and from directly
(``cudaHostRegister``; torch calls it "pinned").  kvstore says *page-locked* for this and
keeps *pin* for the never-evict feature (``Store.pin``), so that one word means one thing.

The default locker is :func:`page_lock_arena`: it loads :mod:`kvstore.cuda` on the first
store that asks for page-locking (``page_lock_staging`` None or True), never on
``import kvstore`` and never for ``page_lock_staging=False``.  A test or an embedding
engine with its own page-locking installs another with :func:`set_default_page_locker`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvstore.io.arena import Arena

__all__ = ["ArenaPageLock", "PageLocker", "default_page_locker", "page_lock_arena",
           "set_default_page_locker"]


class ArenaPageLock(Protocol):
    """What page-locking an arena gave: ``status`` is what ``Store.stats().cuda`` shows;
    ``close()`` unlocks it before the arena is unmapped (idempotent)."""

    status: str

    def close(self) -> None: ...


PageLocker = Callable[[Arena, "bool | None"], ArenaPageLock]
"""``locker(arena, mode)``: ``mode`` is ``open(page_lock_staging=...)``: True must
page-lock or raise, None page-locks where it can, False never does."""


class _NotLocked:
    def __init__(self, status: str) -> None:
        self.status = status

    def close(self) -> None:
        return


def page_lock_arena(arena: Arena, mode: bool | None) -> ArenaPageLock:
    """The default locker: CUDA host registration (:func:`kvstore.cuda.page_locked.page_lock_arena`),
    loaded on first use.  ``mode=False`` loads nothing."""
    if mode is False:
        return _NotLocked("cuda: not used (page_lock_staging=False)")
    from kvstore.cuda.page_locked import page_lock_arena as cuda_page_lock  # loaded when used

    return cuda_page_lock(arena, mode)


_installed: PageLocker | None = None


def set_default_page_locker(locker: PageLocker | None) -> None:
    """Install the locker every store opened from now on uses (None: the built-in
    :func:`page_lock_arena` again)."""
    global _installed
    _installed = locker


def default_page_locker() -> PageLocker:
    """The locker a store opened now uses."""
    return _installed if _installed is not None else page_lock_arena
