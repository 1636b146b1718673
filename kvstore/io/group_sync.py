"""Group sync: concurrent puts that need the same extent file made durable share one
fdatasync instead of queueing one each (the data-file twin of the index writer's group
commit).

A put may share a sync only if that sync *started* after the put's writes returned:
``datasync`` is ordered after every write that returned before it was called (the
engine contract), not after writes that were still in flight.  So per file descriptor
there is at most one sync running; a caller arriving while one runs waits for it to end
and then joins the next one, which every caller that arrived meanwhile shares.  Four
callers that each finish a batch while a sync is running cost two fdatasyncs, not four.

The leader's sync is shielded from cancellation: the callers riding on it must get an
answer, and an fdatasync cannot be taken back anyway.

A failed sync fails every caller, then and from then on, of every fd: on Linux a failed
fsync reports the error once and may drop the dirty pages it could not write, so a
later sync that succeeds proves nothing about writes that returned before the failure
(PostgreSQL's "fsyncgate").  A caller whose writes returned while the failing sync ran
waits for the next sync; had that one succeeded, it would have been acknowledged with
bytes the kernel may have thrown away.  The store goes read-only on the first failure
(G5); reopening it (after fsck) is the way back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from kvstore.io.protocol import IOEngine


@dataclass
class _FileSyncs:
    started: int = 0  # syncs started on this fd so far; the running one is number `started`
    done: int = 0  # the newest sync number that completed successfully
    running: anyio.Event | None = None


class GroupSync:
    """``datasync(fds)`` with concurrent callers of the same fd sharing fdatasyncs."""

    def __init__(self, engine: IOEngine) -> None:
        self._engine = engine
        self._files: dict[int, _FileSyncs] = {}
        self.failure: Exception | None = None  # the first failed sync: every call fails
        self.syncs = 0  # fdatasyncs issued (one per fd per sync)
        self.requests = 0  # fds callers asked to make durable

    async def datasync(self, fds: Sequence[int]) -> None:
        """Return once every write to ``fds`` that returned before this call is durable."""
        if self.failure is not None:
            raise self.failure
        targets = {fd: self._file(fd).started + 1 for fd in fds}
        self.requests += len(targets)
        for fd, target in targets.items():  # one leader syncs every fd that is due at once
            await self._until_synced(fd, target, targets)

    def _file(self, fd: int) -> _FileSyncs:
        state = self._files.get(fd)
        if state is None:
            state = self._files[fd] = _FileSyncs()
        return state

    async def _until_synced(self, fd: int, target: int, targets: dict[int, int]) -> None:
        state = self._file(fd)
        while state.done < target:
            if self.failure is not None:  # sticky: see the module's docstring
                raise self.failure
            if state.running is not None:
                await state.running.wait()
                continue
            # Lead a sync of every fd of this call that still needs one and has none running.
            await self._lead([f for f, t in targets.items()
                              if self._file(f).running is None and self._file(f).done < t])

    async def _lead(self, fds: list[int]) -> None:
        states = [self._file(fd) for fd in fds]
        numbers = []
        for state in states:
            state.started += 1
            numbers.append(state.started)
            state.running = anyio.Event()
        try:
            with anyio.CancelScope(shield=True):
                self.syncs += len(fds)
                await self._engine.datasync(fds)
        except Exception as e:
            if self.failure is None:
                self.failure = e
            raise
        else:
            for state, n in zip(states, numbers):
                state.done = max(state.done, n)
        finally:
            for state in states:
                event, state.running = state.running, None
                assert event is not None
                event.set()

    def forget(self, fd: int) -> None:
        """The fd was closed (its number may be reused for another file)."""
        self._files.pop(fd, None)
