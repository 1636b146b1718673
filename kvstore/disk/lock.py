"""The store's locks: ``PATH/LOCK`` and the owners' lock files (issue 43).

``PATH/LOCK`` (:class:`StoreLock`) is taken *shared* by every open ``Store`` (the
default: several processes serve one store directory) and by fsck's check (which reads
beside them and writes nothing), and *exclusively* by ``open(..., exclusive=True)`` and
by fsck's repairs, which assume nothing else runs.  An exclusive holder writes its pid into the file, for the error another opener
sees; shared holders write nothing: their owner lock files name them.

An owner lock file, ``PATH/owners/NNNNNNNN.lock`` (:class:`OwnerLock`), is held with an
exclusive ``flock`` by one open ``Store`` for its whole life and holds its pid: the
kernel drops the lock when the process dies, so whoever can lock the file knows its
owner is dead (:func:`probe_owner`; no pid is trusted for that, pids are reused).  The
owners' rows in the index are :mod:`kvstore.core.owners`'.

Fork: a ``flock`` belongs to the open file description, which a forked child shares
through its copy of the descriptor, so a child that kept a copy kept the store locked for
as long as it ran (and an owner alive after its death).  The child closes every copy at
fork (``_after_fork_in_child``), and a fork waits for a thread that is opening or
releasing a lock (``_FORK_GUARD``): the store opens and closes on worker threads, and a
child forked between the ``open`` of the descriptor and its registration, or between
its unregistration and its ``close``, got a copy nobody closed (issue 31).  And
``release`` unlocks (``LOCK_UN``) before it closes: a child closes its copy only when
it runs its at-fork hook, which may come after the parent closed and reopened the store
(a child not scheduled yet: the reopen got ``StoreLockedError``), and a process forked
by native code runs no hook at all; the unlock drops the lock whatever copies other
processes still hold.  Only ``os.fork`` (and ``multiprocessing``'s fork start method,
which calls it) runs these hooks; ``subprocess`` children exec at once and every
descriptor is ``O_CLOEXEC``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from kvstore.disk import layout, permissions
from kvstore.disk.layout import LOCK_FILE
from kvstore.disk.store_files import check_file, check_same, open_regular
from kvstore.errors import StoreLockedError, from_os_error

__all__ = ["LOCK_FILE", "OwnerLock", "StoreLock", "held_owner_locks", "live_owner_pids",
           "probe_owner"]

_FIX = ("Remove it (rm {path}) if it is not a file of another program: the store makes "
        "its LOCK file again.")

_HELD: weakref.WeakSet[_Flock] = weakref.WeakSet()
# Held while a descriptor of a lock file exists that ``_HELD`` does not name (opening,
# releasing), and by a fork from its before-hook to its after-hooks: so a child never
# inherits a descriptor its at-fork hook does not know.  Never held across a blocking call
# (every flock is non-blocking).
_FORK_GUARD = threading.Lock()


class _Flock:
    """A descriptor holding a ``flock``, closed by a forked child (module docstring)."""

    fd = -1

    def release(self) -> None:
        with _FORK_GUARD:
            self._unlock()

    def _unlock(self) -> None:
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


class StoreLock(_Flock):
    """A ``flock`` on PATH/LOCK, shared or ``exclusive``, held until ``release``; an
    exclusive holder's pid is in the file, for the error another opener sees."""

    def __init__(self, path: str, *, exclusive: bool = True) -> None:
        self.path, self.exclusive = path, exclusive
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
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                os.close(fd)
                raise StoreLockedError(11, _in_use(path, holder, exclusive)) from None
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
            _HELD.add(self)
        if not exclusive:
            return
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

    def _unlock(self) -> None:
        if self.fd >= 0 and self.exclusive:
            with suppress(OSError):  # the pid of a holder that is gone
                os.ftruncate(self.fd, 0)
        super()._unlock()


def _in_use(path: str, holder: str, exclusive: bool) -> str:
    """Why a lock of ``path`` was refused, naming who holds it: the owners that share
    it, else the pid an exclusive holder wrote."""
    pids = live_owner_pids(path) if exclusive else []
    if pids:
        what = f"open in {len(pids)} process(es) (pid {', '.join(map(str, pids))})"
    elif holder:
        what = f"open exclusively (holder pid {holder}: an exclusive open or fsck)"
    else:
        what = "open in another process"
    if exclusive:
        return (f"store {path} is {what}; this needs it alone: close the store there "
                "first, then run it again")
    return f"store {path} is {what}; close it there first, then open it again"


class OwnerLock(_Flock):
    """The lock file of owner ``owner_id``, created if missing and held with an
    exclusive ``flock`` until ``release`` (which removes the file); it holds the pid.
    :class:`StoreLockedError` if another live process holds it."""

    def __init__(self, store_path: str, owner_id: int, file_mode: int, *,
                 wait_s: float = 0.0) -> None:
        """``wait_s``: how long a lock held by someone else is tried again (an owner
        taking its own new id: only a prober's brief shared lock can be in the way)."""
        self.path = layout.owner_lock_path(store_path, owner_id)
        fix = f"Remove {self.path} if it is not a file of another program."
        with _FORK_GUARD:
            try:
                permissions.make_dirs(layout.owners_dir(store_path), file_mode)
                check_file(self.path, fix)
                fd = permissions.open_file(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK,
                                           file_mode)
            except OSError as e:
                raise from_os_error(e, f"cannot open the owner lock file {self.path}") from e
            try:
                check_same(self.path, os.fstat(fd), None, fix)
                os.set_blocking(fd, True)
                _lock_within(fd, wait_s)
            except BlockingIOError:
                os.close(fd)
                raise StoreLockedError(11, f"owner lock file {self.path} is held by another "
                                       "process (its registration is in progress)") from None
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
            _HELD.add(self)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # the pid names the owner in messages only
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                self.remove()
                raise from_os_error(e, f"cannot write the owner lock file {self.path}") from e

    def remove(self) -> None:
        """Unlink the file, then drop the lock (a prober that locks it meanwhile finds
        the owner dead, and its row gone or about to go)."""
        with suppress(FileNotFoundError):
            os.unlink(self.path)
        self.release()


def _lock_within(fd: int, wait_s: float) -> None:
    """An exclusive ``flock`` on ``fd``, tried again every millisecond for ``wait_s``;
    :class:`BlockingIOError` if still held by then."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def probe_owner(store_path: str, owner_id: int) -> OwnerLock | None:
    """Is owner ``owner_id`` alive?  None if it is (its lock file is held); else its
    lock file, now locked by the caller, who may recover the owner and then
    :meth:`OwnerLock.remove` it.  A missing file is a dead owner too (a lock file
    created again, empty, and locked)."""
    try:
        return OwnerLock(store_path, owner_id, permissions.FILE_MODE)
    except StoreLockedError:
        return None


def live_owner_pids(store_path: str) -> list[int]:
    """The pids in the owner lock files that are held now (for messages; a file being
    created or removed at that moment may be missed)."""
    return [pid for pid in held_owner_locks(store_path).values() if pid is not None]


def held_owner_locks(store_path: str) -> dict[int, int | None]:
    """Owner id -> pid (None if the file names none) of each owner lock file held now:
    the live owners, seen without writing anything (each file opened read-only and
    probed with a shared ``flock``, dropped at once; a file being created or removed at
    that moment may be missed, and a registration probing that owner at that instant
    sees it alive, which only delays its recovery)."""
    directory = layout.owners_dir(store_path)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return {}
    held: dict[int, int | None] = {}
    for name in names:
        owner_id = layout.owner_id_of(name)
        if owner_id is None:
            continue
        try:
            fd = open_regular(os.path.join(directory, name), os.O_RDONLY, "")
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: a live owner
                raw = os.pread(fd, 32, 0).decode(errors="replace").strip()
                held[owner_id] = int(raw) if raw.isdigit() else None
        finally:
            os.close(fd)
    return held


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
