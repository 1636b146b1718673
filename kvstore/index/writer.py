"""The one thread that runs the index's LMDB write transactions, with group commit.

LMDB allows one write transaction at a time, bound to the thread that began it
(py-lmdb ChangeLog 2.3.0): every write kvstore makes runs here, as a job ``fn(txn)``.
Jobs that queue up while a commit is being fsynced are applied together in the next
transaction, each in a nested transaction so one failing job cannot undo the others.
A job that fills the memory map is retried after the map grows (between transactions)
up to the index's limit, past which it fails with
:class:`~kvstore.errors.StoreFullError`; other LMDB errors are translated by
:func:`lmdb_error` (which the index's reads use too): nothing LMDB raises leaves
kvstore untranslated, and no error stops the writer thread.  A map another process
grew (LMDB's ``MapResizedError`` when a transaction begins) is adopted
(``Index.adopt_map``) and the batch begun again.

A commit that finds no room on the file system (ENOSPC, EDQUOT: ``data.mdb`` cannot
grow) fails every job of its transaction with ``StoreFullError``, and nothing of it
is applied: LMDB writes a transaction's pages where no committed page lives and only
then the meta page that makes them visible, so a failed commit leaves the index as it
was and the next one can succeed once space is back.  Other commit failures (EIO,
EROFS, ...) are ``StoreIOError`` with the kernel's errno, which makes a put fail the
store closed (G5).

Events: with an event sink that has subscribers, each transaction carries a
:class:`~kvstore.index.journal.Journal` of its content changes; a job that aborts
truncates its part, and the records reach the sink only after the commit succeeded
(kvstore/index/journal.py).  Without subscribers no journal is made.
"""

from __future__ import annotations

import errno
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import anyio
import lmdb

from kvstore.errors import (
    IndexCorruptionError,
    KVStoreError,
    StoreClosedError,
    StoreFullError,
    StoreIOError,
)
from kvstore.index.journal import Journal, JournalSink

__all__ = ["ADOPT_TRIES", "IndexWriter", "WriterPort", "loop_callback"]

T = TypeVar("T")
Txn = Any  # lmdb.Transaction (untyped module)


class WriterPort(Protocol):
    """What the writer needs of the index: its environment, and growing its map."""

    env: Any  # lmdb.Environment
    map_limit: int
    path: str  # the index directory (PATH/index), for error messages
    journal: Journal | None  # what the transaction changes, while events are wanted

    def grow_map(self) -> bool: ...

    def adopt_map(self) -> None: ...

    def writing(self) -> AbstractContextManager[None]: ...


class IndexWriter:
    """The one thread that runs LMDB write transactions, with group commit."""

    def __init__(self, index: WriterPort, sink: JournalSink | None = None) -> None:
        self._index = index
        self._sink = sink
        self._jobs: queue.SimpleQueue[tuple[Callable[[Txn], Any], Future[Any]] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-lmdb-writer", daemon=True)
        self._thread.start()
        self.commits = 0

    def _run(self) -> None:
        retry: list[tuple[Callable[[Txn], Any], Future[Any]]] = []
        while True:
            if retry:
                batch, retry = retry, []
            else:
                first = self._jobs.get()
                if first is None:
                    return
                batch = [first]
            while True:  # group commit: take everything that queued meanwhile
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)
                    break
                batch.append(nxt)
            done, full = self._commit(batch)
            if full:
                try:
                    grown = self._index.grow_map()
                except Exception as e:  # noqa: BLE001 - handed to the jobs' callers
                    done += [(fut, None, _translate(e, self._index.path)) for _, fut in full]
                else:
                    if grown:
                        retry = full  # applied first in the next transaction, on a larger map
                    else:
                        done += [(fut, None, self._map_full()) for _, fut in full]
            for fut, value, exc in done:
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(value)

    def _map_full(self) -> StoreFullError:
        return StoreFullError(
            errno.ENOSPC, f"the LMDB index reached its limit, index_map_bytes="
            f"{self._index.map_limit}; reopen the store with a larger index_map_bytes (it "
            "is address space: the index file only grows as it fills), or delete blocks")

    def _commit(self, batch: list[tuple[Callable[[Txn], Any], Future[Any]]]) -> tuple[
            list[tuple[Future[Any], Any, BaseException | None]],
            list[tuple[Callable[[Txn], Any], Future[Any]]]]:
        """Apply every job in one transaction, each in a nested one; returns the results
        and the jobs that found the map full (to run again after it grows)."""
        for tries in range(1, ADOPT_TRIES + 1):
            with self._index.writing():
                try:
                    txn = self._index.env.begin(write=True)
                except lmdb.MapResizedError as e:
                    if tries == ADOPT_TRIES:
                        return self._failed(batch, e), []
                else:
                    return self._commit_in(txn, batch)
            # Another process grew the map: adopt its size (no transaction of this
            # writer is open now) and begin again.  The failed begin left LMDB's write
            # mutex free.
            try:
                self._index.adopt_map()
            except KVStoreError as e:
                return self._failed(batch, e), []
        raise AssertionError("unreachable")

    def _failed(self, batch: list[tuple[Callable[[Txn], Any], Future[Any]]],
                e: BaseException) -> list[tuple[Future[Any], Any, BaseException | None]]:
        # One error object per caller (each raise adds to its traceback).
        return [(fut, None, _translate(e, self._index.path, "the index commit failed"))
                for _, fut in batch]

    def _commit_in(self, txn: Txn, batch: list[tuple[Callable[[Txn], Any], Future[Any]]]
                   ) -> tuple[list[tuple[Future[Any], Any, BaseException | None]],
                              list[tuple[Callable[[Txn], Any], Future[Any]]]]:
        env, index, sink = self._index.env, self._index, self._sink
        results: list[tuple[Future[Any], Any, BaseException | None]] = []
        full: list[tuple[Callable[[Txn], Any], Future[Any]]] = []
        journal = index.journal = Journal() if sink is not None and sink.wants() else None
        try:
            with txn:
                for fn, fut in batch:
                    mark = journal.mark() if journal is not None else 0
                    child = env.begin(write=True, parent=txn)
                    try:
                        value = fn(child)
                    except lmdb.MapFullError:
                        child.abort()
                        full.append((fn, fut))
                        if journal is not None:
                            journal.truncate(mark)
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        child.abort()
                        results.append((fut, None, _translate(e, self._index.path)))
                        if journal is not None:
                            journal.truncate(mark)
                    else:
                        child.commit()
                        results.append((fut, value, None))
            self.commits += 1
        except lmdb.MapFullError:  # the commit itself needed pages: run the whole batch again
            return [], batch
        except Exception as e:  # noqa: BLE001 - every job of the transaction gets it
            return self._failed(batch, e), []
        finally:
            index.journal = None
        if journal is not None and journal.records:
            assert sink is not None
            # Before the jobs' callers are told: a put's "stored" event never trails the
            # moment its caller could act on the acknowledgement.
            sink.publish(journal.records)
        return results, full

    def submit(self, fn: Callable[[Txn], T]) -> Future[T]:
        if self._closed:
            raise StoreClosedError("the index writer is closed (the store was closed)")
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def queued(self) -> int:
        """Jobs waiting for the writer thread (not counting the batch being committed)."""
        return self._jobs.qsize()

    def run_sync(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a write transaction and wait (for use off the event loop)."""
        return self.submit(fn).result()

    async def run(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a write transaction; returns after it is durably committed.

        Not cancellable midway: a commit that has started is waited for, so the caller
        never mistakes an applied change for an absent one.  The result comes back through
        the event loop's thread-safe callback, so no worker thread waits per job.
        """
        fut = self.submit(fn)
        done = anyio.Event()
        call_soon = loop_callback()
        fut.add_done_callback(lambda _: call_soon(done.set))
        with anyio.CancelScope(shield=True):
            await done.wait()
        return fut.result()

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._thread.join()


def _translate(e: BaseException, index_path: str,
               what: str = "an index write failed") -> BaseException:
    """What a job (or its commit) raised, as the caller should see it: LMDB's errors
    become KVStoreErrors (:func:`lmdb_error`)."""
    if isinstance(e, lmdb.Error):
        return lmdb_error(e, what, index_path)
    return e


ADOPT_TRIES = 8
"""Adoptions of a map another process grew that one transaction's begin (a read's or
a batch's) tries before it fails: each takes the size recorded then, so only a map that
keeps growing faster than this process can begin exhausts them."""

_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError,
           lmdb.VersionMismatchError)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# Below this much free space, LMDB's EIO is taken for a short write (see _file_system_full).
_NEARLY_FULL_BYTES = 1 << 20


def _file_system_full(index_path: str) -> bool:
    """Whether the index's file system is (nearly) out of space.

    LMDB turns a short ``pwritev`` of a commit's pages, which is what a disk with room
    for some of them and not all gives, into ``EIO`` ("short write, filesystem full?",
    mdb.c) and aborts the transaction: the meta page was not written, so nothing of the
    commit is visible and the environment goes on.  The short write itself used up the
    last free blocks, so an ``EIO`` with (almost) nothing free is a full disk, and the
    store answers StoreFullError instead of turning read-only.  A device's own EIO on a
    disk with room stays StoreIOError."""
    try:
        st = os.statvfs(index_path)
    except OSError:
        return False
    free_blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use reserve
    return free_blocks * st.f_frsize < _NEARLY_FULL_BYTES


def lmdb_error(e: Exception, what: str, index_path: str) -> KVStoreError:
    """An ``lmdb.Error`` as the store's typed error, keeping LMDB's errno (py-lmdb's
    ``code``): damage (a page of the wrong kind, a page not found, not an LMDB file)
    is :class:`IndexCorruptionError` pointing at ``fsck --rebuild-index``; no room on
    the file system (ENOSPC, or LMDB's EIO for a short write on a disk left full) is :class:`StoreFullError` (the store goes on); the rest is
    :class:`StoreIOError` with the kernel's errno (EIO for LMDB's own codes)."""
    if isinstance(e, KVStoreError):
        return e
    store = os.path.dirname(index_path)
    code = getattr(e, "code", 0) or 0
    if isinstance(e, _DAMAGE):
        return IndexCorruptionError(
            f"{what}: the LMDB index at {index_path} is damaged ({e}); run `python -m "
            f"kvstore fsck {store} --rebuild-index` to rebuild it from the extent files")
    if code in _NO_ROOM or (code == errno.EIO and _file_system_full(index_path)):
        return StoreFullError(code, f"{what}: no room for the index on its file system "
                              f"({os.strerror(code)}); nothing of it was applied. Free disk "
                              "space (or delete blocks), then retry")
    if isinstance(e, lmdb.PanicError):
        return StoreIOError(errno.EIO, f"{what}: the LMDB index stopped after an earlier "
                            f"fatal error ({e}); reopen the store")
    return StoreIOError(code if code > 0 else errno.EIO, f"{what}: {e}")


def loop_callback() -> Callable[[Callable[[], object]], object]:
    """The running event loop's thread-safe "call this soon" (asyncio or trio)."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token().run_sync_soon  # type: ignore[no-any-return]
        except RuntimeError:  # not inside trio: asyncio runs this task
            pass
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe
