"""Extent files: large preallocated files under ``PATH/extents/`` that hold the slots.

This module names and makes them as files (the store's own, never through a link:
:mod:`kvstore.disk.store_files`); their space, header and durability are written through
the I/O engine (:func:`kvstore.io.extent_files.create_extent_file`), as every slot is.
"""

from __future__ import annotations

import os
from contextlib import suppress

from kvstore.disk import permissions
from kvstore.disk.layout import EXTENT_DIR, extent_path, extents_dir
from kvstore.disk.store_files import check_dir
from kvstore.errors import from_os_error

__all__ = ["EXTENT_DIR", "extent_path", "fsync_dir", "new_extent_file",
           "remove_new_extent_file"]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_extent_file(store_path: str, extent_id: int, file_mode: int
                    ) -> tuple[str, os.stat_result]:
    """Make extent ``extent_id``'s file, empty, with exactly ``file_mode``; its path and
    ``fstat`` (to check that a later open by name got this file).  Neither ``extents/``
    nor the file is reached through a link; errors are typed with the kernel's errno."""
    directory = extents_dir(store_path)
    path = extent_path(store_path, extent_id)
    check_dir(directory, f"Move the extents directory itself to {directory}.")
    try:
        permissions.make_dirs(directory, file_mode)
        # The id was reserved in a transaction (Index.reserve_extent_id): no other
        # process or task makes this file, so one already there can only be an orphan
        # of an older build's crash before its index commit (or a link planted there):
        # replaced, and the new one made with O_EXCL and O_NOFOLLOW, so nothing outside
        # the store is truncated or written.
        with suppress(FileNotFoundError):
            os.unlink(path)
        fd = permissions.open_file(path, os.O_RDWR | os.O_CLOEXEC, file_mode)
        try:
            return path, os.fstat(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise from_os_error(e, f"cannot create extent file {path}") from e


def remove_new_extent_file(store_path: str, extent_id: int) -> None:
    """Remove an extent file :func:`kvstore.io.extent_files.create_extent_file` made
    whose initialisation or index commit then failed: no index entry names it, and on a
    full disk its preallocated space is what the index needs (a crash instead would
    leave it as an orphan fsck reclaims)."""
    with suppress(FileNotFoundError):
        os.unlink(extent_path(store_path, extent_id))
