"""Backpressure on puts: the bytes of puts in flight, bounded by ``backlog_bytes``.

Puts enter the backlog in arrival order: a foreground put that does not fit waits in a
queue, and while anyone waits there no later put goes ahead of it (a background put is
dropped, a foreground one queues behind), so a waiting put waits at most for the puts
admitted before it.  A put leaving the backlog admits the waiters at the head that now
fit, in order (hand-off: nobody can slip in between the release and the waiter's turn).
One put always goes when none is in flight, so a put above the bound goes alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import anyio

__all__ = ["Backlog"]


class _Turn:
    """A foreground put waiting for room; ``admitted`` is set once its bytes were added
    to the backlog for it (by the put that made room)."""

    __slots__ = ("nbytes", "admitted")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.admitted = anyio.Event()


class Backlog:
    """Bytes of puts in flight (``nbytes``), at most ``limit`` but for one put alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        self._queue: deque[_Turn] = deque()  # foreground puts waiting, in arrival order

    def _fits(self, nbytes: int) -> bool:
        return not self.nbytes or self.nbytes + nbytes <= self.limit

    def try_enter(self, nbytes: int) -> bool:
        """A background put: in at once if nobody waits and it fits, else refused."""
        if self._queue or not self._fits(nbytes):
            return False
        self.nbytes += nbytes
        return True

    async def enter(self, nbytes: int, check: Callable[[], None]) -> None:
        """A foreground put: in now, or after every put queued before it; ``check``
        runs once admitted (the store may have failed closed meanwhile) and may raise."""
        if self.try_enter(nbytes):
            return
        turn = _Turn(nbytes)
        self._queue.append(turn)
        try:
            await turn.admitted.wait()
            check()
        except BaseException:
            if turn.admitted.is_set():
                self.leave(nbytes)
            else:
                self._queue.remove(turn)
                self._admit_waiting()  # the next in line may fit now
            raise

    def leave(self, nbytes: int) -> None:
        self.nbytes -= nbytes
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self._queue and self._fits(self._queue[0].nbytes):
            turn = self._queue.popleft()
            self.nbytes += turn.nbytes
            turn.admitted.set()
