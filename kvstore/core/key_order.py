"""Puts and deletes of the same key take effect in the order they started.

Each ``put_many`` and ``delete_many`` registers its keys in the step it starts, before
its first await (:meth:`KeyOrder.register`), and waits, before it decides anything,
for every call registered earlier on any of its keys (:meth:`KeyOrder.wait_earlier`).
So ``put(K)`` then ``delete(K)`` (two tasks started in that order, or two calls handed
to ``BlockingStore.submit``) ends with K absent, and ``delete(K)`` then ``put(K)`` with
K stored, whatever either waits for on its way: room in the backlog, capacity, the
index writer.  Registered only after such a wait (as puts were), a call could be
overtaken by one that started after it: a delete found nothing and returned, and then
the put that had been waiting for backlog room landed.

A call waits only for calls registered before it, so the waits form no cycle; a put's
backlog turn is taken in the same step as its registration, so the puts it waits for
here are never behind it in the backlog.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio

__all__ = ["KeyOrder", "Turn"]


class Turn:
    """One call's place in line on each of its keys; ``done`` once it took effect (or
    failed, or was cancelled)."""

    __slots__ = ("keys", "done", "waiting")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = tuple(dict.fromkeys(keys))  # (a key twice in a batch: one place)
        self.done = anyio.Event()
        self.waiting = False  # in wait_earlier now


class KeyOrder:
    """The calls in flight per key, in the order they started (see the module doc)."""

    def __init__(self) -> None:
        self._lines: dict[bytes, list[Turn]] = {}

    def register(self, keys: Sequence[bytes]) -> Turn:
        """Take a place behind every call of these keys in flight.  Call it in the
        step the call starts, before any await; end it with :meth:`finish`."""
        turn = Turn(keys)
        for key in turn.keys:
            self._lines.setdefault(key, []).append(turn)
        return turn

    def finish(self, turn: Turn) -> None:
        """The call took effect (or never will): the calls behind it go on."""
        for key in turn.keys:
            line = self._lines[key]
            line.remove(turn)
            if not line:
                del self._lines[key]
        turn.done.set()

    async def wait_earlier(self, turn: Turn, check: Callable[[], None] | None = None
                           ) -> None:
        """Until every call registered before ``turn`` on one of its keys has finished;
        ``check`` runs after each wait (the store may have failed closed meanwhile)."""
        earlier: dict[int, Turn] = {}
        for key in turn.keys:
            for other in self._lines[key]:
                if other is turn:
                    break
                earlier[id(other)] = other
        if not earlier:
            return
        turn.waiting = True
        try:
            for other in earlier.values():
                await other.done.wait()
                if check is not None:
                    check()
        finally:
            turn.waiting = False

    def __contains__(self, key: bytes) -> bool:
        """Whether a put or delete of ``key`` is in flight."""
        return key in self._lines
