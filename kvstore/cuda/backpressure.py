"""The data mover's backpressure (:mod:`kvstore.cuda.mover`): a staging lease is handed
back only once the copies that use it have completed (:class:`PendingLeases`), and saves'
copy-out is capped in bytes per second (:class:`RateCap`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvstore.cuda._lib import CudaError
from kvstore.cuda.device import Notice
from kvstore.cuda.staging import DeviceLease, Lease

__all__ = ["PendingLeases", "RateCap", "fired"]


def fired(notice: Notice) -> bool:
    """Whether the copies before ``notice`` are over (done, or their stream failed: the
    callback ran either way, nothing uses the staging any more)."""
    try:
        return notice.poll()
    except CudaError:
        return True


class PendingLeases:
    """Leases whose copies may still run, each with the notice that fires after them;
    never handed back before it fired, whatever the caller does (``release`` early, a
    cancelled wait, an abort).  ``lock`` is the mover's (shared with its stats and its
    enqueues)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._pending: list[tuple[Notice, Lease | DeviceLease]] = []

    def __len__(self) -> int:
        """How many leases wait for their copies (call with the lock held)."""
        return len(self._pending)

    def retire(self, lease: Lease | DeviceLease, notice: Notice | None) -> None:
        """Hand ``lease`` back now if its copies are done (no ``notice``: nothing was
        enqueued), else once ``notice`` fired (see :meth:`reap`)."""
        with self._lock:
            if notice is None or fired(notice):
                lease.release()
            else:
                self._pending.append((notice, lease))

    def reap(self) -> int:
        """Hand back the leases whose copies completed (non-blocking); how many."""
        with self._lock:
            keep, done = [], 0
            for notice, lease in self._pending:
                if fired(notice):
                    lease.release()
                    done += 1
                else:
                    keep.append((notice, lease))
            self._pending = keep
            return done

    def release_all(self) -> None:
        """At close, once the streams are drained: hand every lease back."""
        with self._lock:
            for _, lease in self._pending:
                lease.release()
            self._pending = []


class RateCap:
    """A token bucket of ``rate`` bytes per second with one second of burst (``None``:
    no cap); ``clock`` in seconds."""

    def __init__(self, rate: float | None, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._clock = clock
        self._tokens = float(rate or 0)
        self._refilled = clock()

    def allow(self, nbytes: int) -> bool:
        """Take ``nbytes`` from the bucket if it holds that many; whether it did."""
        if self._rate is None:
            return True
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        if nbytes > self._tokens:
            return False
        self._tokens -= nbytes
        return True
