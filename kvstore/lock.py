"""The store's process lock: one store directory is served by one ``Store`` (or one fsck)
at a time, because LMDB's writer lock and the in-memory allocator both assume it."""

from __future__ import annotations

import fcntl
import os

from kvstore import permissions
from kvstore.errors import StoreLockedError

LOCK_FILE = "LOCK"


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

    def release(self) -> None:
        os.close(self.fd)  # closing the descriptor drops the flock
