"""The staging arena: one page-aligned anonymous mapping that all disk I/O goes through.

O_DIRECT needs 4 KiB-aligned buffers; Python's ``bytearray`` is not aligned, an
anonymous ``mmap`` is.  The arena is mapped once per store and carved into page runs
for the I/O in flight; ``cuda_ext`` registers this same mapping as pinned memory so
that NVMe -> host -> GPU needs no extra copy.  Tasks that find the arena full wait
(anyio) until another transfer returns its run, which bounds the memory a store uses.

No hold-and-wait: a transfer takes everything it needs as *one* run (``acquire`` the sum,
then ``split`` it into per-block runs), so a task never holds part of its staging while
it waits for the rest.  Runs held while waiting for the next chunk belong to transfers
already on the device, which return them without needing more.  Anything up to the
arena's size is therefore always granted eventually; more is refused at once.

Waiters are served in arrival order (issue 31): a transfer that does not fit queues, and
while anyone queues no later request goes ahead of it (``acquire`` queues behind,
``try_acquire`` is refused), so a waiting transfer waits at most for the runs handed out
before it arrived.  Without this, a large chunk waited for as long as smaller transfers
kept taking the room that came back (the arena never emptied enough for it).  A release
hands the room to the waiters at the head that now fit, in order (nobody slips in
between the release and the waiter's turn).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import threading
from collections import deque
from collections.abc import Callable
from contextlib import suppress

import anyio
import numpy as np
import torch

from kvstore.disk.format import PAGE, round_up
from kvstore.errors import BlockTooLargeError


class ArenaRun:
    """A page-aligned run of the arena, owned by one transfer until ``Arena.release``."""

    __slots__ = ("arena", "offset", "length", "view", "array", "_tensor")

    def __init__(self, arena: Arena, offset: int, length: int) -> None:
        self.arena = arena
        self.offset = offset
        self.length = length
        self.view = arena.view[offset:offset + length]
        self.array = arena.array[offset:offset + length]
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """The run as a uint8 tensor, made on first use: a torch slice costs ~4 us, more
        than the rest of a run, and most runs (every slot of a 64 KiB batch) never need
        one."""
        if self._tensor is None:
            self._tensor = self.arena.tensor[self.offset:self.offset + self.length]
        return self._tensor


class _Turn:
    """A transfer waiting for a run; ``run`` is set (and ``granted``) by the release that
    made room for it."""

    __slots__ = ("nbytes", "run", "granted")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.run: ArenaRun | None = None
        self.granted = anyio.Event()


class Arena:
    """Page-aligned host memory for staging; ``acquire`` waits when it is exhausted."""

    def __init__(self, nbytes: int) -> None:
        self.size = round_up(max(nbytes, PAGE))
        # Not MAP_POPULATE: creating an arena is free; its owner decides when pages are
        # faulted in.  The store's staging arena is populated whole at open
        # (``populate``, on open()'s worker thread); the memory tier's region in the
        # background (``prefault_all``: it may be large, and it is a cache).  Otherwise
        # (or where the kernel lacks MADV_POPULATE_WRITE) a transfer through a
        # never-touched page pays the zeroing itself, so a thread faults pages in *ahead
        # of use*: up to twice the highest offset handed out so far (at least 8 MiB).
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Transparent huge pages where the host allows them (THP "madvise" or "always";
        # "never" wins): a 2 MiB page is faulted in ~3.5x faster than 512 small ones
        # (12 vs 3.5 GB/s populate here), an O_DIRECT transfer pins one page instead of
        # 512 and is one scatter-gather segment instead of up to 512 (the block requests
        # stay the same), and verify/copy take fewer TLB misses.  Measured on a
        # long-lived store (benchmarks/steady.py): 1-2 MiB puts and gets 1.06-2.06x,
        # CPU per GB 10-30% lower (README, "Huge pages").  No-op where unsupported.
        with suppress(AttributeError, OSError):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        # Free runs as two parallel sorted lists (start, length), coalesced on release.
        self._starts: list[int] = [0]
        self._lengths: list[int] = [self.size]
        self._queue: deque[_Turn] = deque()  # transfers waiting, in arrival order
        self.closed = False
        self.prefaulted_bytes = 0  # pages [0, prefaulted_bytes) are resident
        self._high = 0  # the highest end of a run handed out so far
        self._wake = threading.Condition()
        self._prefault: threading.Thread | None = None

    def populate(self) -> bool:
        """Fault the whole region in now, on the calling thread (GIL released); False
        where the kernel lacks MADV_POPULATE_WRITE (pages then fault in on first use,
        with the ahead-of-use thread).  For a caller that is not on an event loop."""
        if _madvise is None:
            return False
        while self.prefaulted_bytes < self.size:
            if not self._fault_in_next(64 << 20):
                return False
        return True

    def _fault_in_next(self, step: int) -> bool:
        """madvise(MADV_POPULATE_WRITE) the next ``step`` bytes past ``prefaulted_bytes``
        (GIL released) and advance it; False if the kernel refused."""
        assert _madvise is not None
        start = self.prefaulted_bytes
        length = min(step, self.size - start)
        if _madvise(ctypes.c_void_p(self.address + start), ctypes.c_size_t(length),
                    _MADV_POPULATE_WRITE) != 0:
            return False
        self.prefaulted_bytes = start + length
        return True

    def prefault_all(self) -> None:
        """Fault the whole region in on the background thread now (a cache that will
        fill anyway: the memory tier), not only ahead of use."""
        self._note_high(self.size)
        with self._wake:
            self._high = max(self._high, self.size)

    def _note_high(self, end: int) -> None:
        """A run up to ``end`` was handed out: fault in ahead of it (background thread)."""
        if end <= self._high or _madvise is None or self.prefaulted_bytes >= self.size:
            return
        with self._wake:
            self._high = end
            if self._prefault is None:
                self._prefault = threading.Thread(target=self._populate, daemon=True,
                                                  name="kvstore-arena-prefault")
                self._prefault.start()
            self._wake.notify()

    def _populate(self) -> None:
        """Fault pages in, a few MiB per madvise(MADV_POPULATE_WRITE) with the GIL released,
        until ``close``.  Stops for good where the kernel lacks it (Linux < 5.14): pages
        then fault in on first use, as without this thread."""
        while True:
            with self._wake:
                while not self.closed and self.prefaulted_bytes >= self._goal():
                    self._wake.wait()
                if self.closed:
                    return
            if not self._fault_in_next(8 << 20):
                return

    def _goal(self) -> int:
        return min(self.size, max(2 * self._high, 8 << 20)) if self._high else 0

    @property
    def free_bytes(self) -> int:
        return sum(self._lengths)

    def try_acquire(self, nbytes: int) -> ArenaRun | None:
        """A run now, or None: none is free, or transfers wait for one (they go first)."""
        return None if self._queue else self._take(nbytes)

    def _take(self, nbytes: int) -> ArenaRun | None:
        need = round_up(nbytes)
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += need
                    self._lengths[i] -= need
                self._note_high(start + need)
                return ArenaRun(self, start, need)
        return None

    async def acquire(self, nbytes: int) -> ArenaRun:
        if round_up(nbytes) > self.size:
            raise BlockTooLargeError(
                f"a transfer of {nbytes} bytes does not fit the {self.size}-byte staging "
                "arena; open the store with a larger staging_bytes")
        run = self.try_acquire(nbytes)
        if run is not None:
            return run
        turn = _Turn(nbytes)
        self._queue.append(turn)
        try:
            await turn.granted.wait()
        except BaseException:
            if turn.run is not None:  # granted as it was cancelled: hand it on
                self.release(turn.run)
            else:
                self._queue.remove(turn)
                self._grant_waiting()  # the next in line may fit now
            raise
        assert turn.run is not None
        return turn.run

    def split(self, run: ArenaRun, lengths: list[int]) -> list[ArenaRun]:
        """Per-block runs carved, back to back, from one acquired ``run`` (they are released
        with it).  Adjacent in the arena, so the engines can merge their transfers."""
        runs, offset = [], run.offset
        for n in lengths:
            runs.append(ArenaRun(self, offset, round_up(n)))
            offset += round_up(n)
        if offset > run.offset + run.length:
            raise ValueError(f"{offset - run.offset} bytes do not fit a {run.length}-byte run")
        return runs

    def release(self, run: ArenaRun) -> None:
        run.view.release()
        start, length = run.offset, run.length
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            i -= 1
            self._lengths[i] += length
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, length)
        if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            del self._starts[i + 1]
        if self._queue:  # (never without waiters: a staging pool releases from threads)
            self._grant_waiting()

    def _grant_waiting(self) -> None:
        """Runs for the waiters at the head of the queue that fit now, in order."""
        while self._queue:
            run = self._take(self._queue[0].nbytes)
            if run is None:
                return
            turn = self._queue.popleft()
            turn.run = run
            turn.granted.set()

    def close(self) -> None:
        if self.closed:
            return
        with self._wake:
            self.closed = True
            self._wake.notify()
        if self._prefault is not None:
            self._prefault.join()  # at most one step: it checks ``closed`` between steps
        del self.tensor, self.array
        self.view.release()
        # A caller may still hold a view (a tensor aliasing the arena): then the mapping
        # is freed when that view goes away.
        with suppress(BufferError):
            self._map.close()


_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14


def _load_madvise() -> Callable[[ctypes.c_void_p, ctypes.c_size_t, int], int] | None:
    """libc's madvise through ctypes, which releases the GIL for the call (CPython's
    ``mmap.madvise`` holds it: 200 ms of page zeroing would stall the event loop)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return,unused-ignore]


_madvise = _load_madvise()
