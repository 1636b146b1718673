"""A new extent file, made through the I/O engine: its space, its header and their
durability go the same road as every slot's bytes, so the simulated engine's faults
(no room, an I/O error) and crashes reach it too.

The steps (``create_extent_file``; data first, then the index, as for every change):

1. The file is made empty, the store's own (:func:`kvstore.disk.extents.new_extent_file`:
   no link followed, exactly the store's file mode).  Its id was reserved in a
   transaction before (``Index.reserve_extent_id``), so no other process sharing the
   store makes it too; a file of this id can only be an orphan of an older build's
   crash before its index commit, and is replaced.
2. The engine opens it and initialises it (``IOEngine.initialise``: preallocated with
   ``posix_fallocate``, so a put never finds a hole there on a full disk, the extent
   header written, both made durable).
3. The directory entry is made durable.

Every failure is a typed error with the kernel's errno (no room: ENOSPC, EDQUOT, EFBIG
is :class:`~kvstore.errors.StoreFullError`) and leaves no file behind, so the space a
failed preallocation took returns to the file system.  The caller then records the
extent in the index; a crash in between leaves a file no index entry names under an id
that is never handed out again: fsck reports it as a reclaimable orphan.
"""

from __future__ import annotations

import errno
import os

import anyio

from kvstore.disk import permissions
from kvstore.disk.extents import fsync_dir, new_extent_file, remove_new_extent_file
from kvstore.disk.format import ExtentHeader
from kvstore.disk.layout import extents_dir
from kvstore.disk.store_files import check_same
from kvstore.errors import from_os_error
from kvstore.io.protocol import IOEngine

__all__ = ["create_extent_file"]


async def create_extent_file(engine: IOEngine, store_path: str, extent_id: int,
                             extent_bytes: int, store_uuid: bytes,
                             file_mode: int = permissions.FILE_MODE) -> None:
    """Create, preallocate and durably initialise one extent file (the module docstring's
    steps), mode ``file_mode``."""
    directory = extents_dir(store_path)
    path, made = await anyio.to_thread.run_sync(new_extent_file, store_path, extent_id,
                                                file_mode)
    try:
        with anyio.CancelScope(shield=True):  # a half-made file is removed, never left
            await _initialise(engine, path, made, extent_id, extent_bytes, store_uuid)
    except Exception:
        # A failure: its space goes back now.  A stop of the process (or of the simulated
        # machine) leaves the file, an orphan fsck reclaims.
        remove_new_extent_file(store_path, extent_id)
        raise
    try:
        await anyio.to_thread.run_sync(fsync_dir, directory)
    except OSError as e:
        raise from_os_error(e, f"cannot make the new extent file {path} durable") from e


async def _initialise(engine: IOEngine, path: str, made: os.stat_result, extent_id: int,
                      extent_bytes: int, store_uuid: bytes) -> None:
    try:
        fd = engine.open_file(path)
    except OSError as e:
        raise from_os_error(e, f"cannot create extent file {path}") from e
    try:
        # the engine opens by name: the file made above, not one swapped in meanwhile
        check_same(path, os.fstat(fd), made, "Remove what was put there; the store makes "
                   "the extent file again.")
        header = ExtentHeader(extent_id, extent_bytes, store_uuid).encode()
        try:
            await engine.initialise(fd, extent_bytes, header)
        except OSError as e:
            raise from_os_error(
                e, f"no room for a new {extent_bytes}-byte extent in {os.path.dirname(path)}"
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                else f"cannot initialise extent file {path}",
                full_hint="free disk space, delete blocks, or open the store with a "
                "smaller extent size") from e
    finally:
        engine.close_file(fd)
