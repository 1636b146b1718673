"""A circuit breaker for the remote tier: when the cluster stops answering, remote calls
become fast misses instead of timeouts on every request.

States: *closed* (requests go out; ``failures`` consecutive failures open it), *open*
(no request; every call is a fast miss for ``reset_s``), *half-open* (one probe request
is let through; success closes the breaker, failure opens it for another ``reset_s``).
Only transport failures count (refused connections, timeouts, 5xx, and a request
still unanswered at its read's deadline): a 404 is an answer.  Only answers that come
in time count as successes: a request answered after its read gave up on it tells the
breaker nothing (its miss was already counted), and while the breaker is open a late
answer to a request sent before it opened does not close it; only the probe does.
Thread-safe: reads ask it from their worker threads, uploads from the event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failures: int, reset_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self._clock = clock
        self.state = CLOSED
        self.consecutive = 0
        self.trips = 0  # times it opened
        self.fast_fails = 0  # calls answered without a request because it was open
        self._opened_at = 0.0
        self._probing = False
        self.last_error = ""
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a request may go out now (counted as a fast fail if not)."""
        if self.state == CLOSED:
            return True
        with self._lock:
            if self.state == OPEN and self._clock() - self._opened_at >= self.reset_s:
                self.state = HALF_OPEN
            if self.state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            self.fast_fails += 1
            return False

    def retry_in(self) -> float:
        """Seconds until a probe may go out (0 when closed)."""
        if self.state == CLOSED:
            return 0.0
        return max(0.0, self.reset_s - (self._clock() - self._opened_at))

    def success(self) -> None:
        """A request answered (in time): resets the count; closes a half-open breaker.
        An open one stays open: the answer is to a request sent before it opened."""
        if self.state == CLOSED and not self.consecutive:
            return  # the common case, without the lock
        with self._lock:
            if self.state != OPEN:
                self.state, self.consecutive, self._probing = CLOSED, 0, False

    def failure(self, why: str, count: int = 1) -> None:
        """``count`` requests got no answer (at most one trip for them all)."""
        with self._lock:
            self.last_error = why
            self.consecutive += count
            if self.state == HALF_OPEN or (self.state == CLOSED
                                           and self.consecutive >= self.threshold):
                if self.state == CLOSED:
                    self.trips += 1
                self.state, self._opened_at, self._probing = OPEN, self._clock(), False

    def release_probe(self) -> None:
        """A request ended without an answer either way (cancelled, or an unexpected
        error): a half-open probe it was counts as failed, so the next one can go."""
        if self.state == HALF_OPEN:
            self.failure("request abandoned")
