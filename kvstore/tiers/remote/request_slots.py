"""``RequestSlots``: the remote tier's ``concurrency``, counted where the cluster counts it.

A slot is taken before a request is sent and given back by the thread that sent it when
its call returns, not when the caller stops waiting.  A read that gives up at its
deadline abandons its request (the blocking client cannot be interrupted); that request
keeps its slot until the cluster answers it or ``request_timeout_s`` ends it.  So:

* requests in flight at the cluster never exceed ``concurrency``, however many reads
  time out (an ``anyio.CapacityLimiter`` gives its token back when the awaiting task
  is cancelled, while the request still runs: slow clusters used to collect a new batch
  of requests, and of threads, at every deadline);
* no thread is started for a request without a slot, so the threads a slow cluster
  can tie up are at most ``concurrency``;
* uploads hold at most ``concurrency - 1`` slots (when ``concurrency > 1``): a read
  a caller awaits always has one that background writes cannot take.

Slots are taken on the event loop (:meth:`take_nowait`, :meth:`take`) and given back
from any thread (:meth:`RequestSlot.release`); a task waiting for one is woken through its
event loop's thread-safe call (asyncio ``call_soon_threadsafe``, trio
``TrioToken.run_sync_soon``), which never blocks the thread that gives the slot back,
and does nothing once that loop is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable

import anyio


class RequestSlot:
    """One taken slot, given back exactly once: by the thread that used it
    (``claim`` when it starts, ``release`` when its request returned), or by the event
    loop (``drop``) if no thread claimed it (the task was cancelled before its thread
    started: such a thread, should it start later, finds the slot gone and sends
    nothing)."""

    __slots__ = ("_slots", "_id", "taken_at", "_state")

    def __init__(self, slots: RequestSlots, id_: int, taken_at: float) -> None:
        self._slots, self._id, self.taken_at = slots, id_, taken_at
        self._state = 0  # 0 taken, 1 claimed by a thread, 2 given back

    def claim(self) -> bool:
        """On the thread about to send: False if the slot was given back already."""
        with self._slots._lock:
            if self._state != 0:
                return False
            self._state = 1
            return True

    def release(self) -> None:
        """On the claiming thread, once its last request returned."""
        self._slots._give(self, claimed=True)

    def drop(self) -> None:
        """On the event loop: give the slot back unless a thread claimed it (then that
        thread gives it back when its request returns)."""
        self._slots._give(self, claimed=False)


class RequestSlots:
    def __init__(self, size: int) -> None:
        self.size = size
        self.upload_cap = max(1, size - 1)
        self._lock = threading.Lock()
        self._held: dict[int, tuple[float, bool]] = {}  # slot id -> (taken at, upload)
        self._uploads = 0
        self._ids = itertools.count()
        self._waiters: list[Callable[[], None]] = []

    @property
    def in_flight(self) -> int:
        """Slots held now: requests sent or about to be, abandoned ones included."""
        return len(self._held)

    def oldest_s(self) -> float:
        """How long the oldest held slot has been held (0 if none)."""
        with self._lock:
            oldest = min((t for t, _ in self._held.values()), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def take_nowait(self, *, upload: bool = False) -> RequestSlot | None:
        with self._lock:
            return self._take_locked(upload)

    async def take(self, *, upload: bool = False) -> RequestSlot:
        """A slot, waiting (in the caller's cancel scope: a read's deadline) until one
        is given back."""
        call: Callable[[Callable[[], None]], None] | None = None
        while True:
            with self._lock:
                slot = self._take_locked(upload)
                if slot is None:
                    event = anyio.Event()
                    call = call or _thread_safe_caller()
                    wake = _bind(call, event.set)
                    self._waiters.append(wake)
            if slot is not None:
                return slot
            try:
                await event.wait()
            finally:
                with self._lock:
                    if wake in self._waiters:
                        self._waiters.remove(wake)

    def _take_locked(self, upload: bool) -> RequestSlot | None:
        if len(self._held) >= self.size or (upload and self._uploads >= self.upload_cap):
            return None
        now = time.monotonic()
        slot = RequestSlot(self, next(self._ids), now)
        self._held[slot._id] = (now, upload)
        self._uploads += upload
        return slot

    def _give(self, slot: RequestSlot, *, claimed: bool) -> None:
        with self._lock:
            if slot._state == 2 or (slot._state == 1 and not claimed):
                return
            slot._state = 2
            _, upload = self._held.pop(slot._id)
            self._uploads -= upload
            waiters, self._waiters = self._waiters, []
        for wake in waiters:  # each re-checks; the losers wait again
            wake()


def _bind(call: Callable[[Callable[[], None]], None], fn: Callable[[], None]
          ) -> Callable[[], None]:
    return lambda: call(fn)


def _thread_safe_caller() -> Callable[[Callable[[], None]], None]:
    """For the running event loop: a function that, from any thread, schedules a call
    on that loop without waiting for it (and does nothing once the loop is gone)."""
    try:
        import trio

        token = trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        loop = asyncio.get_running_loop()

        def call_asyncio(fn: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(fn)

        return call_asyncio

    def call_trio(fn: Callable[[], None]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(fn)

    return call_trio
