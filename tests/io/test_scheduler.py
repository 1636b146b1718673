"""Read-first I/O scheduling (kvstore/io/scheduler.py) over a real engine whose calls are
held at gates: reads go before queued writes and prefetches, writes shrink to their busy
bound while a read is in flight, prefetches wait for reads, a cancelled waiter leaves the
queue, one oversized call still goes alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from kvstore.io.arena import Arena
from kvstore.io.protocol import IoOp
from kvstore.io.scheduler import PREFETCH, READ, WRITE, IoScheduler, as_class
from tests.concurrency import BACKENDS, ENGINES, GatedEngine, real_engine, run_within, until

pytestmark = [pytest.mark.parametrize("backend", BACKENDS),
              pytest.mark.parametrize("kind", ENGINES)]

MIB = 1 << 20


class Bench:
    """A scheduler over a gated real engine, one file, and an arena for buffers."""

    def __init__(self, kind: str, path: Path, **limits: int) -> None:
        self.gated = GatedEngine(real_engine(kind, path))
        self.sched = IoScheduler(self.gated, **limits)
        self.arena = Arena(64 * MIB)
        self.path = path

    async def __aenter__(self) -> Bench:
        await self.sched.start()
        self.fd = self.sched.open_file(str(self.path / "data"), create=True)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.sched.close_file(self.fd)
        await self.sched.aclose()
        self.arena.close()

    def ops(self, nbytes: int, offset: int = 0) -> list[IoOp]:
        run = self.arena.try_acquire(nbytes)
        assert run is not None
        return [IoOp(self.fd, offset, run)]


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


def test_a_call_larger_than_its_bound_still_goes_alone(tmp_path: Path, kind: str,
                                                       backend: str) -> None:
    async def scenario() -> None:
        async with Bench(kind, tmp_path, write_bytes=MIB, prefetch_bytes=MIB) as b:
            await b.sched.write(b.ops(8 * MIB))
            with as_class(PREFETCH):
                res = await b.sched.read(b.ops(8 * MIB))
            assert res == [8 * MIB]
            assert b.sched.admitted == {READ: 0, WRITE: 1, PREFETCH: 1}

    run_within(scenario, backend)
