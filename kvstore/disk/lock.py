"""The store's process lock: one store directory is served by one ``Store`` (or one fsck)
at a time, because LMDB's writer lock and the in-memory allocator both assume it.

Fork: a ``flock`` belongs to the open file description, which a forked child shares
through its copy of the descriptor, so a child that kept a copy kept the store locked for
as long as it ran.  The child closes every copy at fork (``_after_fork_in_child``), and a
fork waits for a thread that is opening or releasing a lock (``_FORK_GUARD``): the store
opens and closes on worker threads, and a child forked between the ``open`` of the
descriptor and its registration, or between its unregistration and its ``close``, got a
copy nobody closed (issue 31).  And ``release`` unlocks (``LOCK_UN``) before it closes:
a child closes its copy only when it runs its at-fork hook, which may come after the
parent closed and reopened the store (a child not scheduled yet: the reopen got
``StoreLockedError``), and a process forked by native code runs no hook at all; the
unlock drops the lock whatever copies other processes still hold.  Only ``os.fork`` (and ``multiprocessing``'s fork start
method, which calls it) runs these hooks; ``subprocess`` children exec at once and the
descriptor is ``O_CLOEXEC``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.disk import layout, permissions
from kvstore.disk.layout import LOCK_FILE
from kvstore.disk.store_files import check_file, check_same
from kvstore.errors import StoreLockedError, from_os_error

__all__ = ["LOCK_FILE", "StoreLock"]

_FIX = ("Remove it (rm {path}) if it is not a file of another program: the store makes "
        "its LOCK file again.")

_HELD: weakref.WeakSet[StoreLock] = weakref.WeakSet()
# Held while a descriptor of a LOCK file exists that ``_HELD`` does not name (opening,
# releasing), and by a fork from its before-hook to its after-hooks: so a child never
# inherits a descriptor its at-fork hook does not know.  Never held across a blocking call
# (the flock is non-blocking).
_FORK_GUARD = threading.Lock()


class StoreLock:
    """An exclusive ``flock`` on PATH/LOCK, held until ``release``; the file names the
    holder's pid, for the error another opener sees."""

    def __init__(self, path: str) -> None:
        self.path = path
        lock_path = layout.lock_path(path)
        with _FORK_GUARD:
            # A link, FIFO or directory there is refused (UnsafePathError), never used;
            # the file is created if missing with O_EXCL and opened without following a
            # link (a link swapped in meanwhile: ELOOP, refused too).
            fix = _FIX.format(path=lock_path)
            check_file(lock_path, fix)
            try:
                fd = permissions.open_file(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as e:
                raise from_os_error(e, f"cannot open the lock file {lock_path}") from e
            try:
                check_same(lock_path, os.fstat(fd), None, fix)
                os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise StoreLockedError(
                    11, f"store {path} is already open (holder pid {holder}); close it there "
                    "first: one store directory is served by one Store at a time") from None
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
            _HELD.add(self)
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            # The pid only names the holder in another opener's error; the flock is the
            # lock.  A full disk (no block for it) must not keep a store from opening.
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                self.release()
                raise from_os_error(e, f"cannot write the lock file {lock_path}") from e

    @contextmanager
    def released_on_error(self) -> Iterator[None]:
        """Releases the lock if the block raises: a caller that cannot use what it locked
        (fsck finding the index damaged) must not keep the store locked."""
        try:
            yield
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        with _FORK_GUARD:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                _HELD.discard(self)
                try:  # the lock, not only this descriptor: a child may hold a copy
                    fcntl.flock(fd, fcntl.LOCK_UN)
                finally:
                    os.close(fd)

    def _forget_in_child(self) -> None:
        """A forked child's copy of the descriptor: closed, not unlocked.  A flock
        belongs to the open file description, which parent and child share; it drops
        when the last descriptor on it closes, so a child that kept its copy (a worker
        process running on) kept the store locked after the parent closed it, while
        ``LOCK_UN`` here would unlock the parent's store under it."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _before_fork() -> None:
    _FORK_GUARD.acquire()


def _after_fork_in_parent() -> None:
    _FORK_GUARD.release()


def _after_fork_in_child() -> None:
    global _FORK_GUARD
    _FORK_GUARD = threading.Lock()  # the forking thread's acquisition: not this process's
    for lock in list(_HELD):
        lock._forget_in_child()
    _HELD.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
