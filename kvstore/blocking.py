"""A blocking facade for engines whose worker code is synchronous.

``open_blocking()`` runs the async store on an event loop in a background thread (an
anyio blocking portal) and forwards each call to it; calls from any number of threads
are safe and are served concurrently by that loop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvstore.store import PutResult, Store, StoreStats
from kvstore.store import open as open_async


class BlockingStore:
    """Synchronous twin of :class:`~kvstore.store.Store`; same methods, same semantics."""

    def __init__(self, path: str | os.PathLike[str], **options: Any) -> None:
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._store_cm = self._portal.wrap_async_context_manager(open_async(path, **options))
            self._store: Store = self._store_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._closed = False

    def __enter__(self) -> BlockingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._store_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

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


def open_blocking(path: str | os.PathLike[str], **options: Any) -> BlockingStore:
    """Open a store for synchronous code; same options as :func:`kvstore.open`.
    Use as ``with open_blocking(path) as store:`` or call ``close()``."""
    return BlockingStore(path, **options)
