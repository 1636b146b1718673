"""The one thread that runs the index's LMDB write transactions, with group commit.

LMDB allows one write transaction at a time, bound to the thread that began it
(py-lmdb ChangeLog 2.3.0): every write kvstore makes runs here, as a job ``fn(txn)``.
Jobs that queue up while a commit is being fsynced are applied together in the next
transaction, each in a nested transaction so one failing job cannot undo the others.
A job that fills the memory map is retried after the map grows (between transactions)
up to the index's limit, past which it fails with
:class:`~kvstore.errors.StoreFullError`; other LMDB errors become ``StoreIOError`` or
``IndexCorruptionError``: nothing LMDB raises leaves this module untranslated.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
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

__all__ = ["IndexWriter", "WriterPort"]

T = TypeVar("T")
Txn = Any  # lmdb.Transaction (untyped module)


class WriterPort(Protocol):
    """What the writer needs of the index: its environment, and growing its map."""

    env: Any  # lmdb.Environment
    map_limit: int

    def grow_map(self) -> bool: ...


class IndexWriter:
    """The one thread that runs LMDB write transactions, with group commit."""

    def __init__(self, index: WriterPort) -> None:
        self._index = index
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
                if self._index.grow_map():
                    retry = full  # applied first in the next transaction, on a larger map
                else:
                    err = StoreFullError(
                        28, f"the LMDB index reached its limit, index_map_bytes="
                        f"{self._index.map_limit}; reopen the store with a larger "
                        "index_map_bytes (it is address space: the index file only grows "
                        "as it fills), or delete blocks")
                    done += [(fut, None, err) for _, fut in full]
            for fut, value, exc in done:
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(value)

    def _commit(self, batch: list[tuple[Callable[[Txn], Any], Future[Any]]]) -> tuple[
            list[tuple[Future[Any], Any, BaseException | None]],
            list[tuple[Callable[[Txn], Any], Future[Any]]]]:
        """Apply every job in one transaction, each in a nested one; returns the results
        and the jobs that found the map full (to run again after it grows)."""
        env = self._index.env
        results: list[tuple[Future[Any], Any, BaseException | None]] = []
        full: list[tuple[Callable[[Txn], Any], Future[Any]]] = []
        try:
            with env.begin(write=True) as txn:
                for fn, fut in batch:
                    child = env.begin(write=True, parent=txn)
                    try:
                        value = fn(child)
                    except lmdb.MapFullError:
                        child.abort()
                        full.append((fn, fut))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        child.abort()
                        results.append((fut, None, _translate(e)))
                    else:
                        child.commit()
                        results.append((fut, value, None))
            self.commits += 1
        except lmdb.MapFullError:  # the commit itself needed pages: run the whole batch again
            return [], batch
        except lmdb.Error as e:
            err = StoreIOError(5, f"LMDB commit failed: {e}")
            return [(fut, None, err) for _, fut in batch], []
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
        call_soon = _loop_callback()
        fut.add_done_callback(lambda _: call_soon(done.set))
        with anyio.CancelScope(shield=True):
            await done.wait()
        return fut.result()

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._thread.join()


def _translate(e: BaseException) -> BaseException:
    """What a job raised, as the caller should see it: LMDB's errors become KVStoreErrors."""
    if isinstance(e, lmdb.Error) and not isinstance(e, KVStoreError):
        if isinstance(e, (lmdb.CorruptedError, lmdb.PageNotFoundError)):
            return IndexCorruptionError(f"the LMDB index is damaged ({e}); run "
                                        "`python -m kvstore fsck` on the store")
        return StoreIOError(getattr(e, "errno", 5) or 5, f"LMDB write failed: {e}")
    return e


def _loop_callback() -> Callable[[Callable[[], object]], object]:
    """The running event loop's thread-safe "call this soon" (asyncio or trio)."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token().run_sync_soon  # type: ignore[no-any-return]
        except RuntimeError:  # not inside trio: asyncio runs this task
            pass
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe
