"""A blocking facade for engines whose worker code is synchronous.

``open_blocking()`` runs the async store on an event loop in a background thread (an
anyio blocking portal) and forwards each call to it; calls from any number of threads
are safe and are served concurrently by that loop.

A script that forgets ``close()`` must still exit.  anyio's ``start_blocking_portal``
runs its loop on a non-daemon executor thread, which the interpreter joins *before*
``atexit`` handlers run, so an unclosed store hung the exit forever.  The loop here runs
on a daemon thread instead, and an ``atexit`` handler (daemon threads still run then)
closes every store still open, as ``close()`` would: acknowledged puts are durable
already; closing waits for calls in flight and releases the lock.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import anyio
import torch
from anyio.from_thread import BlockingPortal

from kvstore.store import PutResult, Store, StoreStats
from kvstore.store import open as open_async


class BlockingStore:
    """Synchronous twin of :class:`~kvstore.store.Store`; same methods, same semantics."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        self._portal, self._thread = _start_portal()
        try:
            self._store_cm = self._portal.wrap_async_context_manager(open_async(path, **options))
            self._store: Store = self._store_cm.__enter__()
        except BaseException:
            self._stop_portal()
            raise
        self._closed = False
        _OPEN.add(self)

    def __enter__(self) -> BlockingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self._store_cm.__exit__(None, None, None)
        finally:
            self._stop_portal()

    def _stop_portal(self) -> None:
        self._portal.call(self._portal.stop)
        self._thread.join()

    @property
    def store(self) -> Store:
        return self._store

    def put_many(self, keys: Sequence[bytes], values: Sequence[torch.Tensor], *,
                 parents: Sequence[bytes | None] | None = None) -> PutResult:
        return self._portal.call(lambda: self._store.put_many(keys, values, parents=parents))

    def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor | None] | None = None
                 ) -> list[torch.Tensor | None]:
        return self._portal.call(self._store.get_many, keys, out)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self._portal.call(self._store.contains_many, keys)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return self._portal.call(self._store.match_prefix, keys)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return self._portal.call(self._store.delete_many, keys)

    def pin(self, keys: Sequence[bytes]) -> None:
        self._portal.call(self._store.pin, keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._portal.call(self._store.unpin, keys)

    def put(self, key: bytes, value: torch.Tensor, *, parent: bytes | None = None) -> bool:
        return self._portal.call(lambda: self._store.put(key, value, parent=parent))

    def get(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._portal.call(self._store.get, key, out)

    def contains(self, key: bytes) -> bool:
        return self._portal.call(self._store.contains, key)

    def delete(self, key: bytes) -> bool:
        return self._portal.call(self._store.delete, key)

    def stats(self) -> StoreStats:
        return self._portal.call(self._sync_stats)

    async def _sync_stats(self) -> StoreStats:
        return self._store.stats()


def _start_portal() -> tuple[BlockingPortal, threading.Thread]:
    """A blocking portal whose event loop runs on a daemon thread (see the module doc)."""
    handoff: queue.Queue[BlockingPortal | BaseException] = queue.Queue(maxsize=1)

    async def serve() -> None:
        async with BlockingPortal() as portal:
            handoff.put(portal)
            await portal.sleep_until_stopped()

    def run() -> None:
        try:
            anyio.run(serve)
        except BaseException as e:  # noqa: BLE001 - handed to the opening thread
            if handoff.empty():
                handoff.put(e)

    thread = threading.Thread(target=run, name="kvstore-blocking-portal", daemon=True)
    thread.start()
    got = handoff.get()
    if isinstance(got, BaseException):
        raise got
    return got, thread


# Stores opened by open_blocking() and not closed yet, closed at interpreter exit (held
# strongly: the portal thread keeps the store open anyway until it is closed).
_OPEN: set[BlockingStore] = set()


@atexit.register
def _close_at_exit() -> None:
    for store in list(_OPEN):
        with suppress(Exception):  # exiting anyway; acknowledged puts are durable
            store.close()


def open_blocking(path: str | os.PathLike[str], **options: Any) -> BlockingStore:
    """Open a store for synchronous code; same options as :func:`kvstore.open`.
    Use as ``with open_blocking(path) as store:`` or call ``close()``; a store still
    open when the interpreter exits is closed then."""
    return BlockingStore(path, **options)
