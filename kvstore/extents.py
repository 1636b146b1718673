"""Extent files: large preallocated files under ``PATH/extents/`` that hold the slots.

``create_extent_file`` runs on a worker thread (fallocate of a GiB can take a while)
and makes the file durable *before* the index learns about it: data first, then the
index, as for every other change.  A crash in between leaves an extent file no index
entry names, which ``open`` reuses and fsck reports as a reclaimable orphan.
"""

from __future__ import annotations

import errno
import os

from kvstore import permissions
from kvstore.errors import StoreFullError, StoreIOError
from kvstore.format import ExtentHeader

EXTENT_DIR = "extents"


def extent_path(store_path: str, extent_id: int) -> str:
    return os.path.join(store_path, EXTENT_DIR, f"{extent_id:08d}.kvx")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_extent_file(store_path: str, extent_id: int, extent_bytes: int,
                       store_uuid: bytes, file_mode: int = permissions.FILE_MODE) -> None:
    """Create, preallocate and durably initialise one extent file (mode ``file_mode``)."""
    directory = os.path.join(store_path, EXTENT_DIR)
    permissions.make_dirs(directory, file_mode)
    path = extent_path(store_path, extent_id)
    # O_TRUNC: a file of this id can only be an orphan of a crash before its index commit.
    fd = permissions.create_file(path, os.O_RDWR | os.O_TRUNC | os.O_CLOEXEC, file_mode)
    try:
        try:
            os.posix_fallocate(fd, 0, extent_bytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StoreFullError(
                    e.errno, f"no room for a new {extent_bytes}-byte extent in {directory} "
                    f"({e.strerror}); free disk space, delete blocks, or open the store with "
                    "a smaller extent size") from e
            raise StoreIOError(e.errno, f"cannot preallocate {path}: {e.strerror}") from e
        os.pwrite(fd, ExtentHeader(extent_id, extent_bytes, store_uuid).encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    fsync_dir(directory)
