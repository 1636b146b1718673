"""The runtime free map of the extent files and the read epochs that hold freed space
back from reuse while earlier readers may still be reading it; both belong to
:class:`~kvstore.core.allocator.Allocator`, whose module docstring gives the states a
byte of an extent is in."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import anyio

from kvstore.io.marks import NO_MARK

__all__ = ["FreeSpace", "ReadEpochs", "wait_for_change"]


class FreeSpace:
    """Free runs ``(extent, offset) -> length``, coalesced; best-fit allocation."""

    def __init__(self, lost: Iterable[int] = ()) -> None:
        self.lost = frozenset(lost)  # extents whose file is missing: never free space
        self._by_start: dict[tuple[int, int], int] = {}
        self._by_end: dict[tuple[int, int], int] = {}  # (extent, end) -> offset
        self._sizes: list[tuple[int, int, int]] = []  # sorted (length, extent, offset)
        self.free_bytes = 0

    def __len__(self) -> int:
        return len(self._by_start)

    def _insert(self, extent: int, offset: int, length: int) -> None:
        self.free_bytes += length
        self._by_start[(extent, offset)] = length
        self._by_end[(extent, offset + length)] = offset
        bisect.insort(self._sizes, (length, extent, offset))

    def _remove(self, extent: int, offset: int) -> int:
        length = self._by_start.pop((extent, offset))
        self.free_bytes -= length
        del self._by_end[(extent, offset + length)]
        i = bisect.bisect_left(self._sizes, (length, extent, offset))
        del self._sizes[i]
        return length

    def allocate(self, length: int) -> tuple[int, int] | None:
        """Reserve ``length`` bytes from the smallest run that fits; None if none fits."""
        i = bisect.bisect_left(self._sizes, (length, -1, -1))
        if i == len(self._sizes):
            return None
        run_len, extent, offset = self._sizes[i]
        self._remove(extent, offset)
        if run_len > length:
            self._insert(extent, offset + length, run_len - length)
        return extent, offset

    def lose(self, extent: int) -> None:
        """``extent``'s file turned out missing after the open: as one missing at open
        (its runs must be out already: ``withdraw``)."""
        self.lost = self.lost | {extent}

    def withdraw(self, extent: int, offset: int, length: int) -> None:
        """Take the free run ``(extent, offset)`` of exactly ``length`` bytes out."""
        if self._by_start.get((extent, offset)) != length:
            raise AssertionError(f"extent {extent} offset {offset}: no free run of {length}")
        self._remove(extent, offset)

    def runs(self) -> list[tuple[int, int, int]]:
        """Every free run (extent, offset, length), largest first."""
        return [(extent, offset, length) for length, extent, offset in reversed(self._sizes)]

    def take_runs(self, most: int | None = None) -> list[tuple[int, int, int]]:
        """Take free runs out, largest first, until ``most`` bytes (every run if None;
        a run that would go past ``most`` stays): what an owner gives back."""
        taken, left = [], self.free_bytes if most is None else most
        for extent, offset, length in self.runs():
            if length <= left:
                self._remove(extent, offset)
                taken.append((extent, offset, length))
                left -= length
        return taken

    def free(self, extent: int, offset: int, length: int) -> None:
        """Return a range; it must not overlap a free run (checked: overlap is a bug).
        A range of a lost extent stays used (its file is gone: nothing can go there)."""
        if extent in self.lost:
            return
        end = offset + length
        if (extent, offset) in self._by_start:
            raise AssertionError(f"double free of extent {extent} offset {offset}")
        prev_start = self._by_end.get((extent, offset))
        if prev_start is not None:
            offset = prev_start
            length += self._remove(extent, prev_start)
        if (extent, end) in self._by_start:
            length += self._remove(extent, end)
        self._insert(extent, offset, length)


STALLED_S = 0.1
"""How long a reserve waits for other owners' reads before it probes for dead owners."""


class ReadEpochs:
    """Reads in flight, so that freed ranges are reused only once no reader can still be
    transferring them.  ``on_release`` is told when held space became free.

    Freed ranges are ``pending`` rows in the index until they ripen
    (kvstore/index/space_counters.py): each one released here is also kept in
    :attr:`ripe` until a transaction moves its row back to the free pool
    (:meth:`take_ripe`; one that did not commit gives them back with :meth:`unripe`).
    That transaction must come before the commit of any slot placed in them.

    Reads of the other owners of the store are not in these epochs: they publish read
    marks (kvstore/core/read_marks.py).  A range freed when the newest LMDB snapshot id
    was ``t`` (:attr:`newest`, read after the freeing transaction committed, so at least
    its txnid) is released only once ``t <= horizon()`` too, the oldest mark of any
    owner: no reader anywhere looked it up before the free.  Other owners' reads end
    unseen here, so :meth:`release_ripe` is called again by whoever needs the space
    (the allocator, before it reserves and while it waits).  Once ripe by that rule a
    row stays ripe (a read beginning later marks at least the snapshot the free made),
    which is why its ``pending`` row may be moved by a later commit without looking
    again."""

    def __init__(self, space: FreeSpace, on_release: Callable[[], None] = lambda: None) -> None:
        self._space = space
        self._on_release = on_release
        self._epoch = 0
        self._active: Counter[int] = Counter()
        # (epoch, newest snapshot id at the free, extent, offset, length)
        self._held: list[tuple[int, int, int, int, int]] = []
        self.held_bytes = 0
        self.horizon: Callable[[], int] = lambda: NO_MARK  # set by the store (its marks)
        self.newest: Callable[[], int] = lambda: 0
        self.ripe: list[tuple[int, int, int]] = []  # released, still pending in the index

    def take_ripe(self) -> list[tuple[int, int, int]]:
        ripe, self.ripe = self.ripe, []
        return ripe

    def unripe(self, runs: list[tuple[int, int, int]]) -> None:
        """Runs a transaction took but did not move (it failed): ahead of the others."""
        self.ripe[:0] = runs

    def begin(self) -> int:
        self._active[self._epoch] += 1
        return self._epoch

    def end(self, epoch: int) -> None:
        self._active[epoch] -= 1
        if not self._active[epoch]:
            del self._active[epoch]
        self._release()

    def free(self, extent: int, offset: int, length: int) -> None:
        """Free a range once every read that began up to now has ended."""
        self._held.append((self._epoch, self.newest(), extent, offset, length))
        self.held_bytes += length
        self._epoch += 1
        self._release()

    def release_ripe(self) -> bool:
        """Release what no read of any owner can hold now; whether some held range is
        waiting for other owners' reads alone (its own have ended)."""
        if not self._held:
            return False
        self._release()
        oldest = min(self._active) if self._active else self._epoch
        return any(held[0] < oldest for held in self._held)

    def _release(self) -> None:
        if not self._held:
            return
        oldest = min(self._active) if self._active else self._epoch
        horizon = self.horizon() if any(held[0] < oldest for held in self._held) else 0
        keep = []
        for held in self._held:
            if held[0] < oldest and held[1] <= horizon:
                self._space.free(*held[2:])
                self.ripe.append(held[2:])
                self.held_bytes -= held[4]
            else:
                keep.append(held)
        if len(keep) != len(self._held):
            self._held = keep
            self._on_release()


async def wait_for_change(changed: anyio.Event, epochs: ReadEpochs,
                          stalled: Callable[[], Awaitable[object]] | None = None) -> None:
    """Until ``changed`` is set (a read of this owner ended, a put ended, space came
    back) or, when freed space waits for other owners' reads alone, until some of it
    is released: their ends are told to nobody here, so look again after a short
    while, backing off from 0.5 ms to 20 ms (DESIGN 6.4).  Once such a wait has lasted
    :data:`STALLED_S`, ``stalled`` runs once (the owner probes for dead owners, whose
    marks would hold the space for ever: kvstore/core/claim_requests.py)."""
    delay, waited, probed = 0.0005, 0.0, stalled is None
    while not changed.is_set():
        if not epochs.release_ripe():  # (what it released, if any, set ``changed``)
            await changed.wait()
            return
        if not probed and waited >= STALLED_S:
            probed = True
            assert stalled is not None
            await stalled()
            continue
        with anyio.move_on_after(delay):
            await changed.wait()
        waited += delay
        delay = min(delay * 2, 0.02)
