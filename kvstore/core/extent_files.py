"""The open extent files of one store: a descriptor per extent, opened through the I/O
engine, each the store's own regular file, never a link (:mod:`kvstore.disk.store_files`).
The transfers read and write through these descriptors; the put path opens the extents
the allocator adds (:class:`~kvstore.core.allocator.Changes`), and a read opens an
extent another process sharing the store added when an entry first names it
(:meth:`ExtentFiles.open_known`)."""

from __future__ import annotations

import errno
import os

from kvstore.disk import store_files
from kvstore.disk.extents import extent_path
from kvstore.errors import StoreIOError, from_os_error
from kvstore.io.protocol import IOEngine

__all__ = ["ExtentFiles"]


class ExtentFiles:
    """Extent id -> open descriptor (``fds``, shared with the transfers)."""

    def __init__(self, path: str, engine: IOEngine) -> None:
        self._path, self._engine = path, engine
        self.fds: dict[int, int] = {}

    def open(self, extent_id: int) -> None:
        """Open an extent file through the engine: the store's own regular file, not a
        link (checked before the open, and the descriptor after it: the engine's
        ``open_file`` takes a path).  FileNotFoundError: missing.  Already open: nothing
        to do."""
        if extent_id in self.fds:
            return
        path = extent_path(self._path, extent_id)
        fix = (f"Put the real extent file at {path} in place of it, or run `python -m "
               f"kvstore fsck {self._path} --repair` to remove the link (extent {extent_id}'s "
               "blocks are then lost; its target is left alone).")
        before = store_files.check_file(path, fix)
        if before is None:
            raise FileNotFoundError(path)
        try:
            fd = self._engine.open_file(path)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise from_os_error(e, f"cannot open extent file {path}") from e
        try:
            store_files.check_same(path, os.fstat(fd), before, fix)
        except BaseException:
            self._engine.close_file(fd)
            raise
        self.fds[extent_id] = fd

    def open_known(self, extent_id: int) -> bool:
        """Open an extent another process sharing the store added (an index entry names
        it; issue 43): True once open, False if its file does not exist (missing).
        Other failures (a link there, an open error) raise, as :meth:`open` does."""
        if extent_id in self.fds:
            return True
        try:
            self.open(extent_id)
        except FileNotFoundError:
            return False
        return True

    def missing_error(self, extent_id: int) -> StoreIOError:
        """The put's error when an extent another owner added is gone (deleted while
        the store was open; :meth:`open` raised FileNotFoundError)."""
        return StoreIOError(errno.ENOENT, f"extent file {extent_path(self._path, extent_id)} "
                            "is missing (deleted while the store was open): nothing of this "
                            "put was stored; retry it (its blocks go elsewhere). The "
                            f"extent's blocks are lost (misses); `python -m kvstore fsck "
                            f"{self._path}` lists them.")

    def close(self) -> None:
        for fd in self.fds.values():
            self._engine.close_file(fd)
        self.fds.clear()
