"""The remote tier against a cluster that is slow or hung (issue 31, item 5): a real
HTTP server on loopback (tests/tiers/remote/slow_s3.py) that holds requests until the test
releases them, and counts what reaches it.

What must hold while the cluster does not answer:

* requests in flight at the cluster never exceed ``concurrency``: a request abandoned at
  its read deadline keeps its slot until it actually returns;
* the client's threads stay bounded (no thread per abandoned request piling up);
* requests that get no answer by their read's deadline are failures to the circuit
  breaker, which opens; then gets are misses at once, without a request;
* opening a store does not wait for a cluster that does not answer;
* uploads never take the last slot: a get always has one.

No sleeps: the server holds every request until ``release()``, so what is in flight
does not depend on timing; deadlines only bound how long each get waits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from kvstore.remote import RemoteConfig
from kvstore.tiers.remote.tier import RemoteTier
from tests.concurrency import until
from tests.conformance import NS, keys, same
from tests.tiers.remote.slow_s3 import SlowS3, client_threads
from tests.tiers.remote.test_tier import open_store, parents, value

pytestmark = pytest.mark.anyio
CONCURRENCY = 4
THREADS_SLACK = 4  # threads beyond baseline + concurrency: a get's own short hand-offs


def slow_config(s3: SlowS3, **kw: Any) -> RemoteConfig:
    kw.setdefault("read_deadline_s", 0.2)
    kw.setdefault("concurrency", CONCURRENCY)
    # a held request is ended by the test's release, never by the client's timeout
    kw.setdefault("request_timeout_s", 120.0)
    kw.setdefault("close_drain_s", 0.0)
    return RemoteConfig(bucket="kvstore", endpoint=s3.endpoint, prefix="slow",
                        access_key_id="slow", secret_access_key="slow-secret", **kw)


async def get_misses(store: Any, ks: list[bytes]) -> None:
    assert await store.get_many(ks) == [None] * len(ks)


async def test_in_flight_requests_never_exceed_concurrency_and_threads_stay_bounded(
        tmp_path: Path, anyio_backend: str) -> None:
    ks = keys(4 + 4 * 6)
    stored, missing = ks[:4], ks[4:]
    with SlowS3("kvstore", hold=()) as s3:
        # a writer puts 4 blocks in the bucket while the cluster answers
        async with open_store(tmp_path / "w", slow_config(s3)) as w:
            await w.put_many(stored, [value(i) for i in range(4)], parents=parents(ks)[:4])
            await w.remote.flush()
            assert w.remote.stats().uploaded_blocks == 4
        s3.hold.add("GET")  # from now on GETs get no answer until the release
        # the breaker never opens here: every get asks the cluster
        cfg = slow_config(s3, breaker_failures=1_000_000)
        with anyio.fail_after(120):
            async with open_store(tmp_path / "r", cfg) as r:
                baseline = client_threads()
                most = baseline
                for _ in range(6):  # rounds of 4 concurrent gets of 6 blocks each
                    async with anyio.create_task_group() as tg:
                        for g in range(4):
                            tg.start_soon(get_misses, r, missing[6 * g:6 * g + 6])
                    most = max(most, client_threads())
                    assert s3.max_in_flight <= CONCURRENCY, s3.max_in_flight
                assert s3.max_in_flight == CONCURRENCY  # the bound was reached, not more
                assert s3.requests["GET"] == CONCURRENCY  # nothing sent past a held slot
                assert most <= baseline + CONCURRENCY + THREADS_SLACK, (baseline, most)
                st = r.remote.stats()
                assert st.requests_in_flight == CONCURRENCY
                assert st.deadline_misses == 6 * 4 * 6 and st.hits == 0
                # the cluster answers again: the abandoned requests return, give their
                # slots back, and a get is served from the bucket
                s3.release()
                await until(lambda: r.remote.stats().requests_in_flight == 0)
                got = await r.get_many(stored)
                assert all(same(g, value(i)) for i, g in enumerate(got))
                assert r.remote.stats().hits == 4


async def test_uploads_leave_a_slot_to_gets(tmp_path: Path, anyio_backend: str) -> None:
    """Uploads of a slow cluster hold at most ``concurrency - 1`` slots: a get always
    has one, and reads and uploads together stay within ``concurrency``."""
    ks = keys(8 + 4)
    with SlowS3("kvstore", hold=("GET", "PUT")) as s3:
        cfg = slow_config(s3, breaker_failures=1_000_000, upload_workers=CONCURRENCY)
        with anyio.fail_after(120):
            async with open_store(tmp_path / "a", cfg) as a:
                await a.put_many(ks[:8], [value(i) for i in range(8)], parents=parents(ks)[:8])
                await until(lambda: s3.requests["PUT"] >= CONCURRENCY - 1)
                for _ in range(3):
                    await get_misses(a, ks[8:])
                assert s3.requests["GET"] >= 1  # a get had a slot the uploads could not take
                assert s3.requests["PUT"] == CONCURRENCY - 1
                assert s3.max_in_flight == CONCURRENCY
                s3.release()
                await a.remote.flush()
                assert a.remote.stats().uploaded_blocks == 8
            assert s3.max_in_flight <= CONCURRENCY


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("batch", [1, 8])
async def test_deadline_misses_open_the_breaker_then_gets_cost_nothing(
        tmp_path: Path, anyio_backend: str, batch: int) -> None:
    """Gets of ``batch`` blocks against a cluster that never answers: each pays at most
    one read deadline, the requests that outlived it are failures, and once
    ``breaker_failures`` of them happened the breaker is open: gets are misses at once,
    no request.  A due probe that finds every slot still held waits for nothing."""
    ks = keys(64)
    failures = 3
    with SlowS3("kvstore", hold=("GET",)) as s3:
        cfg = slow_config(s3, breaker_failures=failures, breaker_reset_s=60.0)
        with anyio.fail_after(120):
            async with open_store(tmp_path / "a", cfg) as a:
                assert a.remote is not None
                clock = Clock()
                a.remote.breaker._clock = clock
                paid = 0  # gets that waited for their deadline
                while a.remote.stats().state == "ok":
                    await get_misses(a, ks[batch * paid:batch * (paid + 1)])
                    paid += 1
                    assert paid <= failures  # it opens; every get counted
                # one request per block, up to concurrency, failed per get
                assert paid == -(-failures // min(batch, CONCURRENCY))
                st = a.remote.stats()
                assert st.breaker_trips == 1 and st.state == "unreachable"
                assert "deadline" in st.reason
                sent, deadline_misses = s3.requests["GET"], st.deadline_misses
                assert sent == st.requests_in_flight <= CONCURRENCY
                for _ in range(20):  # open: misses at once, nothing sent, no deadline
                    await get_misses(a, ks[32:32 + batch])
                st = a.remote.stats()
                assert s3.requests["GET"] == sent and st.deadline_misses == deadline_misses
                assert st.fast_misses == 20 * batch
                # breaker_reset_s later one probe goes out; it gets no answer either
                # and the breaker opens again (one more deadline, once)
                while s3.requests["GET"] < CONCURRENCY:
                    clock.now += cfg.breaker_reset_s
                    await get_misses(a, ks[40:40 + batch])
                    assert a.remote.stats().state == "unreachable"
                assert a.remote.stats().breaker_trips == 1
                # every slot is held by an unanswered request: a due probe is a fast
                # miss, it does not wait for a slot
                clock.now += cfg.breaker_reset_s
                deadline_misses = a.remote.stats().deadline_misses
                await get_misses(a, ks[48:48 + batch])
                st = a.remote.stats()
                assert s3.requests["GET"] == CONCURRENCY == s3.max_in_flight
                assert st.deadline_misses == deadline_misses
                s3.release()
                await until(lambda: a.remote.stats().requests_in_flight == 0)
                # late answers tell the breaker nothing: it stays open until a probe
                assert a.remote.stats().state == "unreachable"


def test_open_does_not_wait_for_a_cluster_that_does_not_answer(tmp_path: Path) -> None:
    """The access check at open gives up at its deadline (the breaker opens: the store
    opens with fast misses) while its request is still out, instead of waiting for
    the client's request timeout."""
    with SlowS3("kvstore", hold=("LIST",)) as s3:
        cfg = slow_config(s3, request_timeout_s=10.0)

        async def no_slot(key: bytes, buffer: Any) -> None:
            return None

        tier = RemoteTier(cfg, NS.digest, no_slot)
        tier.check_access()
        st = tier.stats().as_dict()
        s3.release()
        assert s3.wait_idle()
        # the probe was still waiting when check_access returned, and got its answer
        assert s3.requests["LIST"] == 1 and s3.abandoned == 0
        assert st["state"] == "unreachable" and st["breaker_trips"] == 1
        assert st["requests_in_flight"] == 1  # the probe kept its slot until it returned
