"""Page-locking the store's host memory for device DMA: a hook the store calls when it
maps its staging arena (and the memory tier's region).

"Page-locked" is CUDA's name for host memory the device can copy to and from directly
(``cudaHostRegister``; torch calls it "pinned").  kvstore says *page-locked* for this and
keeps *pin* for the never-evict feature (``Store.pin``), so that one word means one thing.

io/ names what page-locking gives (:class:`ArenaPageLock`, :data:`PageLocker`) and never
loads the GPU path: the store hands ``StoreParts`` its locker, CUDA host registration
(``kvstore._cuda_path.page_lock``, which loads :mod:`kvstore.cuda` on the first
store that asks for page-locking, never for ``page_lock_staging=False``).  A test or an
embedding engine with its own page-locking installs another for every store opened from
then on with :func:`set_default_page_locker`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvstore.io.arena import Arena

__all__ = ["ArenaPageLock", "NotLocked", "PageLocker", "default_page_locker",
           "set_default_page_locker"]


class ArenaPageLock(Protocol):
    """What page-locking an arena gave: ``status`` is what ``Store.stats().cuda`` shows;
    ``close()`` unlocks it before the arena is unmapped (idempotent)."""

    status: str

    def close(self) -> None: ...


PageLocker = Callable[[Arena, "bool | None"], ArenaPageLock]
"""``locker(arena, mode)``: ``mode`` is ``open(page_lock_staging=...)``: True must
page-lock or raise, None page-locks where it can, False never does."""


class NotLocked:
    """What a locker gives for memory it did not page-lock: ``status`` says why."""

    def __init__(self, status: str) -> None:
        self.status = status

    def close(self) -> None:
        return


_installed: PageLocker | None = None


def set_default_page_locker(locker: PageLocker | None) -> None:
    """Install the locker every store opened from now on uses (None: the store's own,
    CUDA host registration, again)."""
    global _installed
    _installed = locker


def default_page_locker() -> PageLocker | None:
    """The locker installed with :func:`set_default_page_locker`; None when the store
    uses its own."""
    return _installed
