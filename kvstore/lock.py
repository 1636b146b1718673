"""The store's process lock: one store directory is served by one ``Store`` (or one fsck)
at a time, because LMDB's writer lock and the in-memory allocator both assume it."""

from __future__ import annotations

import fcntl
import os
import weakref

from kvstore import permissions
from kvstore.errors import StoreLockedError

LOCK_FILE = "LOCK"

_HELD: weakref.WeakSet[StoreLock] = weakref.WeakSet()


class StoreLock:
    """An exclusive ``flock`` on PATH/LOCK, held until ``release``; the file names the
    holder's pid, for the error another opener sees."""

    def __init__(self, path: str) -> None:
        self.fd = permissions.open_file(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise StoreLockedError(
                11, f"store {path} is already open (holder pid {holder}); close it there "
                "first: one store directory is served by one Store at a time") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        _HELD.add(self)

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            _HELD.discard(self)
            os.close(fd)  # closing the descriptor drops the flock

    def _forget_in_child(self) -> None:
        """A forked child's copy of the descriptor: closed, not unlocked.  A flock
        belongs to the open file description, which parent and child share; it drops
        when the last descriptor on it closes, so a child that kept its copy (a worker
        process running on) kept the store locked after the parent closed it, while
        ``LOCK_UN`` here would unlock the parent's store under it."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _after_fork_in_child() -> None:
    for lock in list(_HELD):
        lock._forget_in_child()
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
