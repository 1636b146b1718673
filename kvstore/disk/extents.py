"""Extent files: large preallocated files under ``PATH/extents/`` that hold the slots.

``create_extent_file`` runs on a worker thread (fallocate of a GiB can take a while)
and makes the file durable *before* the index learns about it: data first, then the
index, as for every other change.  A crash in between leaves an extent file no index
entry names, which ``open`` reuses and fsck reports as a reclaimable orphan.
"""

from __future__ import annotations

import errno
import os
from contextlib import suppress

from kvstore.disk import permissions
from kvstore.disk.format import ExtentHeader
from kvstore.disk.layout import EXTENT_DIR, extent_path, extents_dir
from kvstore.disk.store_files import check_dir
from kvstore.errors import from_os_error

__all__ = ["EXTENT_DIR", "create_extent_file", "extent_path", "fsync_dir",
           "remove_new_extent_file"]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_extent_file(store_path: str, extent_id: int, extent_bytes: int,
                       store_uuid: bytes, file_mode: int = permissions.FILE_MODE) -> None:
    """Create, preallocate and durably initialise one extent file (mode ``file_mode``).

    Every failure is a typed error with the kernel's errno (no room: ENOSPC, EDQUOT,
    EFBIG is :class:`StoreFullError`) and leaves no file behind, so the space a failed
    preallocation took returns to the file system.  Neither ``extents/`` nor the file
    is reached through a link (:mod:`kvstore.disk.store_files`)."""
    directory = extents_dir(store_path)
    path = extent_path(store_path, extent_id)
    check_dir(directory, f"Move the extents directory itself to {directory}.")
    try:
        permissions.make_dirs(directory, file_mode)
        # A file of this id can only be an orphan of a crash before its index commit
        # (or a link planted there): replaced, and the new one made with O_EXCL and
        # O_NOFOLLOW, so nothing outside the store is truncated or written.
        with suppress(FileNotFoundError):
            os.unlink(path)
        fd = permissions.open_file(path, os.O_RDWR | os.O_CLOEXEC, file_mode)
    except OSError as e:
        raise from_os_error(e, f"cannot create extent file {path}") from e
    try:
        try:
            os.posix_fallocate(fd, 0, extent_bytes)
        except OSError as e:
            raise from_os_error(
                e, f"no room for a new {extent_bytes}-byte extent in {directory}"
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                else f"cannot preallocate {path}",
                full_hint="free disk space, delete blocks, or open the store with a "
                "smaller extent size") from e
        try:
            os.pwrite(fd, ExtentHeader(extent_id, extent_bytes, store_uuid).encode(), 0)
            os.fsync(fd)
        except OSError as e:
            raise from_os_error(e, f"cannot initialise extent file {path}") from e
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    try:
        fsync_dir(directory)
    except OSError as e:
        raise from_os_error(e, f"cannot make the new extent file {path} durable") from e


def remove_new_extent_file(store_path: str, extent_id: int) -> None:
    """Remove an extent file :func:`create_extent_file` made whose index commit then
    failed: no index entry names it, and on a full disk its preallocated space is what
    the index needs (a crash instead would leave it as an orphan fsck reclaims)."""
    with suppress(FileNotFoundError):
        os.unlink(extent_path(store_path, extent_id))
