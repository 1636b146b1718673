"""The circuit breaker (kvstore/tiers/remote/breaker.py) on a clock the test moves."""

from __future__ import annotations

import threading

from kvstore.tiers.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_probes_once_and_closes_on_success() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=2, reset_s=5.0, clock=clock)
    b.failure("refused")
    b.success()  # an answer resets the count
    b.failure("refused")
    assert b.state == CLOSED and b.allow()
    b.failure("refused")
    assert b.state == OPEN and b.trips == 1
    assert not b.allow() and not b.allow() and b.fast_fails == 2
    assert b.retry_in() == 5.0
    clock.now += 5.0
    assert b.allow() and b.state == HALF_OPEN  # the one probe
    assert not b.allow()  # others stay fast misses while it is out
    b.failure("still refused")
    assert b.state == OPEN and b.trips == 1 and not b.allow()
    clock.now += 5.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow() and b.retry_in() == 0.0


def test_threads_asking_a_half_open_breaker_let_exactly_one_probe_out() -> None:
    """Reads ask the breaker from their worker threads: however many ask at once, one
    probe goes out; an abandoned probe (``release_probe``) lets the next one go."""
    clock = Clock()
    b = CircuitBreaker(failures=1, reset_s=5.0, clock=clock)
    for round_ in range(20):
        b.failure("refused")
        clock.now += 5.0
        start = threading.Barrier(8)
        allowed: list[bool] = []
        threads = [threading.Thread(target=_ask, args=(b, start, allowed)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert allowed.count(True) == 1, (round_, allowed)
        assert b.state == HALF_OPEN
        b.release_probe()  # abandoned: the breaker opens again, the probe is free
        assert b.state == OPEN
    clock.now += 5.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()


def _ask(b: CircuitBreaker, start: threading.Barrier, allowed: list[bool]) -> None:
    start.wait()
    allowed.append(b.allow())


def test_a_late_answer_does_not_close_an_open_breaker() -> None:
    """An answer to a request sent before the breaker opened (a slow cluster answering
    at last) leaves it open: only the probe closes it."""
    clock = Clock()
    b = CircuitBreaker(failures=2, reset_s=5.0, clock=clock)
    b.failure("2 GET(s) unanswered at the read deadline", 2)
    assert b.state == OPEN and b.trips == 1
    b.success()
    assert b.state == OPEN and not b.allow()
    clock.now += 5.0
    assert b.allow()  # the probe
    b.success()
    assert b.state == CLOSED
