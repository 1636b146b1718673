"""The scheduler's lookups with a wait budget (kvstore.integrations.vllm.scheduler.lookup_pool).

The lookup function is held at a gate (a threading.Event) where a test needs a lookup to
be still running; tests wait on the lookup's own future, never on a clock.  The connector
on a real engine, whose lookups vLLM asks again after a None, is covered by
tests/integrations/vllm/test_vllm_remote.py (``lookup_wait_ms: 0``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import wait

import pytest

from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.scheduler.lookup_pool import MAX_PENDING, LookupPool


class GatedMatch:
    """A lookup that answers ``len(hashes) - 1`` once its gate opens; records calls."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[list[bytes]] = []
        self.threads: set[str] = set()
        self.fail: Exception | None = None

    def __call__(self, hashes: list[bytes]) -> int:
        self.calls.append(hashes)
        self.threads.add(threading.current_thread().name)
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return len(hashes) - 1


@pytest.fixture
def match() -> Iterator[GatedMatch]:
    m = GatedMatch()
    yield m
    m.gate.set()  # never leave a pool thread parked


def settle(lookups: LookupPool, request_id: str, *, held: bool = False) -> None:
    """Wait until the lookup held for ``request_id`` (if any; ``held``: there must be
    one) has returned."""
    future = lookups.running(request_id)
    assert future is not None or not held
    if future is not None:
        wait([future])


def hashes(n: int, tag: bytes = b"h") -> list[bytes]:
    return [tag + bytes([i]) for i in range(n)]


def test_without_a_wait_every_lookup_runs_on_the_callers_thread(match: GatedMatch) -> None:
    match.gate.set()
    lookups = LookupPool(match, None)
    assert lookups.ask("r1", hashes(4)) == 3
    assert match.threads == {threading.current_thread().name}
    assert lookups.running("r1") is None and lookups.deferred == 0


def test_a_slow_lookup_is_deferred_then_answered_once(match: GatedMatch) -> None:
    lookups = LookupPool(match, 0.0)
    try:
        assert lookups.ask("r1", hashes(4)) is None  # still at the gate
        assert lookups.ask("r1", hashes(4)) is None  # the same lookup, not a second one
        assert len(match.calls) == 1 and lookups.deferred == 2
        assert threading.current_thread().name not in match.threads
        match.gate.set()
        settle(lookups, "r1", held=True)
        assert lookups.ask("r1", hashes(4)) == 3
        # answered once: the next ask is a new lookup (the store may have changed)
        assert lookups.running("r1") is None
        assert lookups.ask("r1", hashes(4)) in (None, 3)
        settle(lookups, "r1")
        assert len(match.calls) == 2
    finally:
        lookups.close()


def test_a_fast_lookup_is_answered_within_the_wait(match: GatedMatch) -> None:
    match.gate.set()
    lookups = LookupPool(match, 3600.0)  # waits as long as the lookup takes
    try:
        assert lookups.ask("r1", hashes(5)) == 4
        assert lookups.deferred == 0 and lookups.running("r1") is None
    finally:
        lookups.close()


def test_a_changed_query_drops_the_old_lookups_answer(match: GatedMatch) -> None:
    lookups = LookupPool(match, 0.0)
    try:
        assert lookups.ask("r1", hashes(6)) is None
        old = lookups.running("r1")
        # vLLM computed part of the prefix meanwhile: it asks about fewer blocks
        assert lookups.ask("r1", hashes(6)[2:]) is None
        new = lookups.running("r1")
        assert old is not None and new is not None and new is not old
        match.gate.set()
        wait([new])
        assert lookups.ask("r1", hashes(6)[2:]) == 3  # the new query's answer, not 5
    finally:
        lookups.close()


def test_answers_go_to_the_request_that_asked(match: GatedMatch) -> None:
    lookups = LookupPool(match, 0.0, workers=4)
    try:
        sizes = {f"r{i}": 2 + i for i in range(8)}
        for rid, n in sizes.items():  # eight lookups in flight at once, then answered
            assert lookups.ask(rid, hashes(n, rid.encode())) is None
        match.gate.set()
        futures = [lookups.running(rid) for rid in sizes]
        wait([f for f in futures if f is not None])
        for rid, n in reversed(sizes.items()):
            assert lookups.ask(rid, hashes(n, rid.encode())) == n - 1
    finally:
        lookups.close()


def test_a_finished_requests_lookup_is_never_answered(match: GatedMatch) -> None:
    lookups = LookupPool(match, 0.0)
    try:
        assert lookups.ask("r1", hashes(4)) is None
        lookups.forget("r1")  # vLLM finished (aborted) the request
        assert lookups.running("r1") is None
        match.gate.set()
        # a new request that reuses the id asks anew: the old answer is gone
        assert lookups.ask("r1", hashes(3)) in (None, 2)
    finally:
        lookups.close()


def test_a_failed_lookup_raises_once_and_the_next_ask_retries(match: GatedMatch) -> None:
    match.fail = ConnectionError("worker went away")
    lookups = LookupPool(match, 0.0)
    try:
        assert lookups.ask("r1", hashes(4)) is None
        match.gate.set()
        settle(lookups, "r1", held=True)
        with pytest.raises(ConnectionError, match="worker went away"):
            lookups.ask("r1", hashes(4))
        match.fail = None
        assert lookups.ask("r1", hashes(4)) in (None, 3)
        settle(lookups, "r1")
        assert len(match.calls) == 2
    finally:
        lookups.close()


def test_held_lookups_are_bounded(match: GatedMatch) -> None:
    lookups = LookupPool(match, 0.0, workers=1)
    try:
        for i in range(MAX_PENDING + 3):
            assert lookups.ask(f"r{i}", hashes(2)) is None
        assert lookups.running("r0") is None and lookups.running("r2") is None
        assert lookups.running(f"r{MAX_PENDING + 2}") is not None
    finally:
        match.gate.set()
        lookups.close()


def test_after_close_lookups_run_on_the_callers_thread(match: GatedMatch) -> None:
    lookups = LookupPool(match, 0.0)
    assert lookups.ask("r1", hashes(4)) is None
    match.gate.set()
    lookups.close()  # waits for the running lookup
    assert lookups.running("r1") is None
    assert lookups.ask("r2", hashes(4)) == 3
    assert threading.current_thread().name in match.threads


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0 seconds"):
        LookupPool(lambda h: 0, -1.0)


@pytest.mark.parametrize("bad", [-1, True, "5", float("nan"), float("inf")])
def test_the_config_refuses_a_bad_lookup_wait(bad: object) -> None:
    with pytest.raises(ValueError, match="lookup_wait_ms must be a number of milliseconds"):
        ConnectorConfig.from_extra({"path": "/tmp/kv", "lookup_wait_ms": bad})


def test_the_lookup_wait_defaults_to_waiting_unless_a_remote_may_answer() -> None:
    local = ConnectorConfig.from_extra({"path": "/tmp/kv"})
    assert local.lookup_wait_s() is None
    remote = ConnectorConfig.from_extra({"path": "/tmp/kv", "remote": {"bucket": "b"}})
    assert remote.lookup_wait_s() == pytest.approx(0.005)
    chosen = ConnectorConfig.from_extra({"path": "/tmp/kv", "lookup_wait_ms": 0,
                                         "remote": {"bucket": "b"}})
    assert chosen.lookup_wait_s() == 0.0
