"""Deletes a promotion must respect: a delete that returned is never undone by a put
that started before it, and a remote-tier promotion is such a put whose keys are known
before its fetch begins.  Its own module: the store and the remote tier's adapter both
use it, and neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DeleteWatch", "DeleteWatches"]


class DeleteWatch:
    """Keys a promotion fetched from the remote tier, registered before the fetch began
    (``DeleteWatches.watch``): a delete of any of them meanwhile adds it to
    ``deleted``, and the promotion's put skips those keys (a delete that returned is
    never undone by a promotion that started before it)."""

    __slots__ = ("keys", "deleted")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = frozenset(keys)
        self.deleted: set[bytes] = set()


class DeleteWatches:
    """The watches of one store's promotions in flight; ``deleting`` tells each of them
    about a delete (before it waits for puts of its keys)."""

    def __init__(self) -> None:
        self._watches: set[DeleteWatch] = set()

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, keys: Sequence[bytes]) -> DeleteWatch:
        watch = DeleteWatch(keys)
        self._watches.add(watch)
        return watch

    def unwatch(self, watch: DeleteWatch) -> None:
        self._watches.discard(watch)

    def deleting(self, keys: Sequence[bytes]) -> None:
        for watch in self._watches:
            watch.deleted.update(k for k in keys if k in watch.keys)
