"""The LMDB memory map's size, changed safely in a process that reads on many threads.

LMDB allows ``set_mapsize`` only while no transaction of this process is open.  Readers
hold :meth:`MapGate.reading` around each read transaction, the writer thread holds
:meth:`MapGate.writing` around each write transaction, and a resize holds
:meth:`MapGate.exclusive`, which waits for both.  Lock order: the writer's lock, then
the readers' condition.

Two resizes: growth (:meth:`MapGate.grow`: the writer found the map full) and adoption
(:meth:`MapGate.adopt`): another process sharing the store grew the map, which LMDB
reports as ``MapResizedError`` when this process's next transaction begins, read or
write; ``set_mapsize(0)`` takes the size recorded in the data file, and nothing is lost
(issue 43; /work/notes/multiproc/results.md, section 1: 24-65 us).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from typing import Any

import lmdb

from kvstore.index.writer import ADOPT_TRIES, lmdb_error

__all__ = ["MapGate"]


class MapGate:
    """Readers on any thread vs. the map being resized (the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False
        self._write = threading.Lock()
        self._mine = threading.local()  # this thread's read transactions open
        self.adoptions = 0  # sizes another process grew the map to, taken

    def depth(self) -> int:
        """Read transactions this thread has open (through :meth:`reading`)."""
        depth: int = getattr(self._mine, "depth", 0)
        return depth

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1
        self._mine.depth = self.depth() + 1
        try:
            yield
        finally:
            self._mine.depth -= 1
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def read_transaction(self, env: Any, path: str, *, buffers: bool) -> Iterator[Any]:
        """A read-only transaction of ``env`` inside :meth:`reading`; a map another
        process grew is adopted (:meth:`adopt`) and the transaction begun again.  LMDB's
        errors leave as KVStoreErrors; a transaction LMDB turned bad after a damaged page
        as damage (``IndexCorruptionError``).  Inside :meth:`one_snapshot` on this
        thread: that transaction, left open."""
        held = getattr(self._mine, "held", None)
        if held is not None:
            yield held
            return
        for tries in count(1):
            with self.reading():
                try:
                    txn = env.begin(buffers=True) if buffers else env.begin()
                except lmdb.MapResizedError as e:
                    if tries >= ADOPT_TRIES or self.depth() > 1:
                        # (a transaction of this thread is open: it cannot resize)
                        raise lmdb_error(e, "cannot read the index", path) from e
                else:
                    try:
                        with txn:
                            yield txn
                    except lmdb.Error as e:
                        if isinstance(e, lmdb.BadTxnError):  # a read met a damaged page
                            e = lmdb.CorruptedError(f"{e} (after a damaged page)")
                        raise lmdb_error(e, "cannot read the index", path) from e
                    return
            self.adopt(env, path)  # outside reading(): it waits for every reader to leave

    @contextmanager
    def one_snapshot(self, env: Any, path: str) -> Iterator[None]:
        """Every read transaction this thread begins inside the block is one and the
        same, begun here: every table as of one commit (fsck beside live processes reads
        all its tables this way, then ends it: LMDB keeps the pages this snapshot sees
        from reuse until then).  Values are copies (no ``buffers``)."""
        with self.read_transaction(env, path, buffers=False) as txn:
            self._mine.held = txn
            try:
                yield
            finally:
                self._mine.held = None

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._write:
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._write:
            with self._cond:
                self._resizing = True
                while self._readers:
                    self._cond.wait()
            try:
                yield
            finally:
                with self._cond:
                    self._resizing = False
                    self._cond.notify_all()

    def adopt(self, env: Any, path: str) -> None:
        """Take the map size another process grew the index at ``path`` to, between
        transactions (waits for this process's readers and its writer's transaction to
        end).  The map may exceed this process's limit this way: it must cover the data.
        LMDB's errors leave as KVStoreErrors."""
        try:
            with self.exclusive():
                env.set_mapsize(0)
        except lmdb.Error as e:
            raise lmdb_error(e, "cannot adopt the index's grown memory map", path) from e
        self.adoptions += 1

    def grow(self, env: Any, limit: int, path: str) -> bool:
        """The writer found the map full (its thread, between transactions): adopt a size
        another process grew it to if there is one (which may be room enough), else
        double it up to ``limit``; False if it is at the limit already."""
        try:
            size: int = env.info()["map_size"]
            with self.exclusive():
                env.set_mapsize(0)  # another process's growth, if any
                adopted: int = env.info()["map_size"]
                if adopted > size:
                    self.adoptions += 1
                    return True
                target = min(limit, 2 * size)
                env.set_mapsize(max(size, target))  # (0 may have given a smaller one)
        except lmdb.Error as e:
            raise lmdb_error(e, "cannot grow the index's memory map", path) from e
        return target > size
