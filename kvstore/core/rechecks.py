"""Blocks quarantined because they could not be read are read again later, in the
background, and put back when they verify (DESIGN: "a block excluded for an I/O error is
re-read later and restored when it verifies").

When.  A read that failed was already tried again at once, alone, twice
(:func:`kvstore.io.coalesce.reread_failed`), so what reaches quarantine outlasted a few
milliseconds: a device reset, a path failover, a controller timeout.  Such a block is
read again after 1 s, 10 s, 60 s and 600 s (:data:`RECHECK_DELAYS_S`), in the store's
background task group, as background reads (gets go first), until none is left; a new
one arriving starts the schedule again.  Not on the next get or lookup of the key: a
lookup (``match_prefix``) must answer from the index at once, without a read, and an
engine that was told "miss" recomputes and stores the block again anyway.  Bounded: a
dead sector is read four more times an open, not for ever.  After that the scrub (every pass
re-reads every quarantine record) and fsck do; and every ``open()`` of a store that has
quarantine records starts the schedule again (it only asks the table's size: no scan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from kvstore.errors import KVStoreError
from kvstore.io.scheduler import PREFETCH, as_class

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvstore.core.operations import Health, Operations
    from kvstore.core.reads import VerifiedReads
    from kvstore.index.index import Index

__all__ = ["RECHECK_DELAYS_S", "Rechecks"]

RECHECK_DELAYS_S = (1.0, 10.0, 60.0, 600.0)
BATCH = 64  # records read again per transaction


class Rechecks:
    """The background re-reads of one open store's unreadable blocks."""

    def __init__(self, *, index: Index, reads: VerifiedReads, ops: Operations,
                 health: Health, task_group: Callable[[], TaskGroup | None]) -> None:
        self._index, self._reads, self._ops, self._health = index, reads, ops, health
        self._task_group = task_group
        self.delays = RECHECK_DELAYS_S  # (tests shorten it)
        self._round = 0  # bumped by schedule(): the running task starts its delays again
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None  # set when the running task ends

    def schedule(self) -> None:
        """Blocks were quarantined as unreadable (or the store opened with quarantine
        records): read them again after the delays, starting from the first."""
        self._round += 1
        group = self._task_group()
        if self._scope is not None or group is None or self._ops.closed \
                or self._health.read_only:
            return
        self._scope, self._done = anyio.CancelScope(), anyio.Event()
        group.start_soon(self._run, self._scope, self._done)

    def cancel(self) -> None:
        """Stop (the store is closing); records stay for the next open."""
        if self._scope is not None:
            self._scope.cancel()

    async def wait_idle(self) -> None:
        """Until no re-read is scheduled or running (an operator's tool or a test that
        must know the background work settled; an event, not a poll)."""
        while self._done is not None:
            await self._done.wait()

    async def _run(self, scope: anyio.CancelScope, done: anyio.Event) -> None:
        try:
            with scope, self._ops.track():
                step, round_ = 0, self._round
                while step < len(self.delays):
                    await anyio.sleep(self.delays[step])
                    left = await self.once()
                    if round_ != self._round:  # new ones meanwhile: from the first delay
                        step, round_ = 0, self._round
                    elif not left:
                        break
                    else:
                        step += 1
        except KVStoreError:  # the store failed closed meanwhile: nothing to record
            pass
        finally:
            self._scope = self._done = None
            done.set()

    async def once(self) -> int:
        """Read every unreadable record again, once; returns how many stay quarantined."""
        left, after = 0, None
        while not self._health.read_only:
            with self._reads.marked():  # (before the lookup: kvstore/core/read_marks.py)
                rows, after = self._index.quarantine_records.rows(
                    after, BATCH, unreadable_only=True)
                if rows:
                    with as_class(PREFETCH):  # gets first
                        done = await self._reads.recheck([(k, e) for k, e, _ in rows])
                    left += len(rows) - len(done.restored) - len(done.freed)
            if after is None:
                return left
        return left
