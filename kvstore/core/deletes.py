"""Deletes a promotion must respect: a delete that returned is never undone by a put
that started before it, and a remote-tier promotion is such a put whose keys are known
before its fetch begins.  Its own module: the store and the remote tier's adapter both
use it, and neither imports the other for it.

A promotion starts when the call that asked for it starts: a get at its index lookup, a
prefetch when ``prefetch()`` is called (its fetch runs later, in the background), a
match_prefix at its lookup.  So the watch is taken then, not when the fetch begins
(``since``: the fetch's own watch starts with what was deleted since the call's).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

__all__ = ["DeleteWatch", "DeleteWatches"]


class DeleteWatch:
    """Keys a promotion fetched from the remote tier, registered before the fetch began
    (``DeleteWatches.watch``): a delete of any of them meanwhile adds it to
    ``deleted``, and the promotion's put skips those keys (a delete that returned is
    never undone by a promotion that started before it)."""

    __slots__ = ("keys", "deleted", "__weakref__")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = frozenset(keys)
        self.deleted: set[bytes] = set()


class DeleteWatches:
    """The watches of one store's promotions in flight; ``deleting`` tells each of them
    about a delete (before it waits for puts of its keys).  Held weakly: a watch whose
    owner dropped it without ``unwatch`` (a get that raised before its fetch) ends with
    it."""

    def __init__(self) -> None:
        self._watches: weakref.WeakSet[DeleteWatch] = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, keys: Sequence[bytes], since: DeleteWatch | None = None) -> DeleteWatch:
        """A watch of ``keys`` from now on; ``since``: an earlier watch of the same call
        (what it saw deleted of these keys counts as deleted here too)."""
        watch = DeleteWatch(keys)
        if since is not None:
            watch.deleted.update(since.deleted & watch.keys)
        self._watches.add(watch)
        return watch

    def unwatch(self, watch: DeleteWatch) -> None:
        self._watches.discard(watch)

    def deleting(self, keys: Sequence[bytes]) -> None:
        for watch in self._watches:
            watch.deleted.update(k for k in keys if k in watch.keys)
