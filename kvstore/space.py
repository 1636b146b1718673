"""In-memory free-space map of the extent files, and read epochs that delay reuse.

The LMDB ``free`` table is the durable free map; this is its runtime mirror plus the
space reserved by puts in flight.  A put reserves here *before* it writes (it must know
where), and the same range leaves the durable map in the transaction that indexes the
block, so a crash before that commit leaves the space free in the index and the written
bytes as reclaimable orphans (FORMAT.md, "Allocation").

Freed space (delete, quarantine repair) does not return here at once: a read that
looked the block up before the delete may still be transferring it.  ``ReadEpochs``
holds freed ranges until every read that began before the free has finished, so reused
space is never overwritten under a reader.
"""

from __future__ import annotations

import bisect
from collections import Counter


class FreeSpace:
    """Free runs ``(extent, offset) -> length``, coalesced; best-fit allocation."""

    def __init__(self) -> None:
        self._by_start: dict[tuple[int, int], int] = {}
        self._by_end: dict[tuple[int, int], int] = {}  # (extent, end) -> offset
        self._sizes: list[tuple[int, int, int]] = []  # sorted (length, extent, offset)
        self.free_bytes = 0

    def __len__(self) -> int:
        return len(self._by_start)

    def runs(self) -> list[tuple[int, int, int]]:
        return sorted((e, o, n) for (e, o), n in self._by_start.items())

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

    def free(self, extent: int, offset: int, length: int) -> None:
        """Return a range; it must not overlap a free run (checked: overlap is a bug)."""
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


class ReadEpochs:
    """Tracks reads in flight so that freed ranges are reused only once no reader can
    still be transferring them."""

    def __init__(self, space: FreeSpace) -> None:
        self._space = space
        self._epoch = 0
        self._active: Counter[int] = Counter()
        self._held: list[tuple[int, int, int, int]] = []  # (epoch, extent, offset, length)

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
        self._held.append((self._epoch, extent, offset, length))
        self._epoch += 1
        self._release()

    @property
    def held_bytes(self) -> int:
        return sum(h[3] for h in self._held)

    def _release(self) -> None:
        oldest = min(self._active) if self._active else self._epoch
        keep = []
        for held in self._held:
            if held[0] < oldest:
                self._space.free(*held[1:])
            else:
                keep.append(held)
        self._held = keep
