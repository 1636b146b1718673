"""Deletes a promotion must respect: a delete that returned is never undone by a put
that started before it, and a remote-tier promotion is such a put whose keys are known
before its fetch begins.  Its own module: the store and the remote tier's adapter both
use it, and neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DeleteWatch"]


class DeleteWatch:
    """Keys a promotion fetched from the remote tier, registered before the fetch began
    (``Store._watch_deletes``): a delete of any of them meanwhile adds it to
    ``deleted``, and the promotion's put skips those keys (a delete that returned is
    never undone by a promotion that started before it)."""

    __slots__ = ("keys", "deleted")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = frozenset(keys)
        self.deleted: set[bytes] = set()
