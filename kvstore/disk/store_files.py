"""Every path the store opens under its directory is its own: a regular file or a
directory, never reached through a symbolic link.

A store reads and writes nothing outside its directory (docs/security.md).  A link
inside it would break that: an extent file replaced by a link to another file makes
every put write into that file, with the store's user's rights (in a group-shared
store, ``file_mode=0o660``, any member of the group can plant one).  So:

1. The store directory itself is the caller's choice and may be reached through links;
   nothing under it is followed.
2. Files kvstore opens itself are opened with ``O_NOFOLLOW`` and checked with ``fstat``
   to be regular files (:func:`open_regular`); a link is ``ELOOP``, reported as
   :class:`~kvstore.errors.UnsafePathError`.
3. Files opened by code that cannot pass ``O_NOFOLLOW`` (an I/O engine's
   ``open_file``, LMDB's ``data.mdb`` and ``lock.mdb``) are ``lstat``-ed first
   (:func:`check_file`) and the descriptor (or the path, for LMDB) is checked after
   the open to be that same regular file (:func:`check_same`): a link swapped in
   between is caught before any byte is read or written through an engine's
   descriptor; LMDB's own opens are checked after the fact.
4. Directories the store keeps files in (``index/``, ``extents/``) are checked to be
   directories, not links (:func:`check_dir`).

Every refusal names the path, what it is, and what to do; nothing is changed.  fsck
uses :func:`unsafe_reason` to report the same paths (a linked extent file is damage
that ``--repair`` removes: the link, never its target).
"""

from __future__ import annotations

import errno
import os
import stat

from kvstore.errors import UnsafePathError

__all__ = ["check_dir", "check_file", "check_same", "open_regular", "unsafe_reason"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _describe(path: str, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    for test, name in _KINDS:
        if test(st.st_mode):
            return name
    return "not a regular file"


def unsafe_reason(path: str, *, directory: bool = False) -> str | None:
    """Why ``path`` is not a store file (or, ``directory=True``, not a store directory)
    kvstore may open: ``"a symbolic link (to /x)"``, ``"a FIFO"``...; None if it is
    one, or does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    return None if ok else _describe(path, st)


def _refuse(path: str, reason: str, fix: str, kind: str = "file") -> UnsafePathError:
    code = errno.ELOOP if reason.startswith("a symbolic link") else errno.EINVAL
    return UnsafePathError(
        code, f"{path} is {reason}, not the store's own {kind}: kvstore reads and writes "
        "nothing outside its directory and follows no link inside it, so it did not use "
        f"it (nothing was changed). {fix}")


def check_dir(path: str, fix: str) -> bool:
    """``path`` is a directory and not a link (False: it does not exist); else
    :class:`UnsafePathError` with ``fix``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        reason = _describe(path, st) if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise _refuse(path, reason, fix, "directory")
    return True


def check_file(path: str, fix: str) -> os.stat_result | None:
    """``lstat`` of ``path`` if it is a regular file (None: it does not exist); else
    :class:`UnsafePathError` with ``fix``.  Pass the result to :func:`check_same` after
    the open."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, _describe(path, st), fix)
    return st


def check_same(path: str, now: os.stat_result, before: os.stat_result | None, fix: str) -> None:
    """The file opened at ``path`` (``now``: an ``fstat`` of its descriptor, or an
    ``lstat`` of the path after a library opened it) is the regular file ``before``
    saw (or, ``before=None``, a regular file at all)."""
    same = before is None or (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino)
    if not (same and stat.S_ISREG(now.st_mode)):
        reason = "not the file that was checked before it was opened (replaced meanwhile)" \
            if not same else _describe(path, now)
        raise _refuse(path, reason, fix)


def open_regular(path: str, flags: int, fix: str, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)``, refusing a link or anything
    but a regular file with :class:`UnsafePathError`; other ``OSError`` as raised."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a link
            raise _refuse(path, _describe(path, os.lstat(path)), fix) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, _describe(path, st), fix)
        if not flags & os.O_NONBLOCK:  # O_NONBLOCK only kept a FIFO from blocking the open
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
