"""Read-first I/O scheduling (kvstore/io/scheduler.py) over a real engine whose calls are
held at gates: reads go before queued writes and prefetches, writes shrink to their busy
bound while a read is in flight, a get in progress or the grace after one (a write call
then goes in pieces of that bound), prefetches wait for reads, a cancelled waiter leaves
the queue, one oversized call still goes alone.  The flushes the scheduler issues while
reads are served are tested on the simulated disk (test_scheduler_flushes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from kvstore.io.scheduler import PREFETCH, READ, WRITE, as_class
from tests.concurrency import (
    BACKENDS,
    ENGINES,
    GatedEngine,
    SchedulerBench,
    real_engine,
    run_within,
    until,
)

pytestmark = [pytest.mark.parametrize("backend", BACKENDS),
              pytest.mark.parametrize("kind", ENGINES)]

MIB = 1 << 20


class Bench(SchedulerBench):
    """A scheduler over a gated real engine."""

    def __init__(self, kind: str, path: Path, **limits: Any) -> None:
        self.gated = GatedEngine(real_engine(kind, path))
        super().__init__(self.gated, path, **limits)


def test_a_read_goes_before_queued_writes(tmp_path: Path, kind: str, backend: str) -> None:
    async def scenario() -> None:
        async with Bench(kind, tmp_path, write_bytes=4 * MIB, write_bytes_busy=4 * MIB) as b:
            order: list[str] = []

            async def write(name: str, offset: int) -> None:
                await b.sched.write(b.ops(4 * MIB, offset))
                order.append(name)

            async def read() -> None:
                await b.sched.read(b.ops(MIB))
                order.append("read")

            gate = b.gated.gate("write")
            async with anyio.create_task_group() as tg:
                tg.start_soon(write, "w1", 0)
                await gate.entered.wait()  # w1 holds the whole write budget
                tg.start_soon(write, "w2", 4 * MIB)
                await until(lambda: b.sched.waiting[WRITE] == 1)
                tg.start_soon(write, "w3", 8 * MIB)
                await until(lambda: b.sched.waiting[WRITE] == 2)
                tg.start_soon(read)
                await until(lambda: "read" in order)  # not queued behind w2, w3
                assert order == ["read"] and b.sched.waiting[WRITE] == 2
                gate.open()
            assert order == ["read", "w1", "w2", "w3"]
            assert b.sched.deferred == {READ: 0, WRITE: 2, PREFETCH: 0}

    run_within(scenario, backend)


def test_writes_shrink_to_their_busy_bound_while_a_read_is_in_flight(
        tmp_path: Path, kind: str, backend: str) -> None:
    async def scenario() -> None:
        async with Bench(kind, tmp_path, write_bytes=32 * MIB, write_bytes_busy=8 * MIB) as b:
            gate = b.gated.gate("read")
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.sched.read, b.ops(MIB))
                await gate.entered.wait()  # a read is in flight (held)
                for i in range(3):
                    tg.start_soon(b.sched.write, b.ops(4 * MIB, i * 4 * MIB))
                await until(lambda: b.sched.inflight[WRITE] == 8 * MIB
                            and b.sched.waiting[WRITE] == 1)
                gate.open()  # the read ends: the third write fits the full bound
            assert b.sched.inflight == {READ: 0, WRITE: 0, PREFETCH: 0}
            assert b.sched.admitted[WRITE] == 3 and b.sched.deferred[WRITE] == 1

    run_within(scenario, backend)


def test_a_prefetch_waits_while_a_read_is_in_flight(tmp_path: Path, kind: str,
                                                     backend: str) -> None:
    async def scenario() -> None:
        async with Bench(kind, tmp_path) as b:
            await b.sched.write(b.ops(2 * MIB))
            done: list[str] = []

            async def prefetch() -> None:
                with as_class(PREFETCH):
                    await b.sched.read(b.ops(MIB))
                done.append("prefetch")

            gate = b.gated.gate("read")
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.sched.read, b.ops(MIB))
                await gate.entered.wait()
                tg.start_soon(prefetch)
                await until(lambda: b.sched.waiting[PREFETCH] == 1)
                assert not done and b.sched.inflight[PREFETCH] == 0
                gate.open()
            assert done == ["prefetch"] and b.sched.deferred[PREFETCH] == 1

    run_within(scenario, backend)


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_goes(
        tmp_path: Path, kind: str, backend: str) -> None:
    async def scenario() -> None:
        async with Bench(kind, tmp_path, write_bytes=4 * MIB) as b:
            gate = b.gated.gate("write")
            finished: list[str] = []

            async def write(name: str, offset: int) -> None:
                await b.sched.write(b.ops(4 * MIB, offset))
                finished.append(name)

            async with anyio.create_task_group() as tg:
                tg.start_soon(write, "w1", 0)
                await gate.entered.wait()
                scope = anyio.CancelScope()

                async def doomed() -> None:
                    with scope:
                        await write("w2", 4 * MIB)

                tg.start_soon(doomed)
                await until(lambda: b.sched.waiting[WRITE] == 1)
                tg.start_soon(write, "w3", 8 * MIB)
                await until(lambda: b.sched.waiting[WRITE] == 2)
                scope.cancel()  # w2 gives up its place
                await until(lambda: b.sched.waiting[WRITE] == 1)
                gate.open()
            assert sorted(finished) == ["w1", "w3"]
            assert b.sched.inflight[WRITE] == 0

    run_within(scenario, backend)


def test_a_call_larger_than_its_bound_still_goes(tmp_path: Path, kind: str,
                                                 backend: str) -> None:
    """A prefetch larger than its bound goes alone; a write larger than its bound goes
    in pieces of the busy bound, one after another, and lands whole."""
    async def scenario() -> None:
        async with Bench(kind, tmp_path, write_bytes=MIB, write_bytes_busy=MIB,
                         prefetch_bytes=MIB) as b:
            written = b.ops(8 * MIB)
            written[0].run.array[:] = (np.arange(8 * MIB) % 251).astype(np.uint8)
            await b.sched.write(written)
            with as_class(PREFETCH):
                read = b.ops(8 * MIB)
                res = await b.sched.read(read)
            assert res == [8 * MIB]
            assert np.array_equal(read[0].run.array, written[0].run.array)
            assert b.sched.admitted == {READ: 0, WRITE: 8, PREFETCH: 1}

    run_within(scenario, backend)


async def _write_calls(b: Bench, nbytes: int, offset: int = 0) -> int:
    """Write ``nbytes`` in one scheduler call; how many engine calls it took."""
    before = b.sched.admitted[WRITE]
    await b.sched.write(b.ops(nbytes, offset))
    return b.sched.admitted[WRITE] - before


def test_a_write_goes_in_busy_bound_pieces_while_a_get_is_in_progress(
        tmp_path: Path, kind: str, backend: str) -> None:
    """foreground() covers a whole get, not only its reads on the device: a write started
    meanwhile has one piece (the busy bound) in flight at a time; the same write with no
    get in progress goes as one call."""
    async def scenario() -> None:
        async with Bench(kind, tmp_path, write_bytes=32 * MIB, write_bytes_busy=MIB,
                         dirty_bytes_busy=0) as b:
            with b.sched.foreground():
                gate = b.gated.gate("write")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_write_calls, b, 4 * MIB)
                    await gate.entered.wait()  # the first piece is on the device (held)
                    assert b.sched.inflight[WRITE] == MIB
                    gate.open()
                assert b.sched.admitted[WRITE] == 4
            assert await _write_calls(b, 4 * MIB, 4 * MIB) == 1

    run_within(scenario, backend)


@pytest.mark.parametrize("grace", [0.0, 3600.0])
def test_the_grace_after_a_get_keeps_writes_at_the_busy_bound(
        tmp_path: Path, kind: str, backend: str, grace: float) -> None:
    """The next get of an engine's load comes a moment after the last one ended: for
    ``read_grace_s`` after a get, writes still go in pieces (an hour here, so that no
    clock decides the outcome; with no grace, at once as one call)."""
    async def scenario() -> None:
        async with Bench(kind, tmp_path, write_bytes=32 * MIB, write_bytes_busy=MIB,
                         dirty_bytes_busy=0, read_grace_s=grace) as b:
            with b.sched.foreground():
                pass
            assert await _write_calls(b, 4 * MIB) == (4 if grace else 1)

    run_within(scenario, backend)
