"""The flushes the I/O scheduler issues itself while reads are served
(kvstore/io/scheduler.py): every ``dirty_bytes_busy`` written, before the next write
goes, so that no flush a get waits behind carries more than that; none without reads;
a cancelled writer still finishes the flush it started; a failed
flush fails the write and every later sync (a lost writeback is reported only once).

On the simulated disk (kvstore/io/simulated.py): it records which writes are not yet
flushed and takes injected fdatasync errors, which a real file system here cannot.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvstore.errors import StoreIOError
from kvstore.io.protocol import IoOp
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine
from tests.concurrency import BACKENDS, GatedEngine, SchedulerBench, run_within

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

MIB = 1 << 20


class UnflushedPeak(GatedEngine):
    """Records, at every write, how many writes the disk holds unflushed."""

    def __init__(self, disk: SimulatedDisk) -> None:
        super().__init__(SimulatedEngine(disk))
        self.disk = disk
        self.peak = 0

    async def write(self, ops: Sequence[IoOp]) -> None:
        await super().write(ops)
        self.peak = max(self.peak, self.disk.unsynced_writes())


class Bench(SchedulerBench):
    """A scheduler over the simulated disk: 1 MiB write pieces, a flush every 2 MiB."""

    def __init__(self, path: Path, disk: SimulatedDisk | None = None, **limits: Any) -> None:
        self.disk = disk or SimulatedDisk(seed=1)
        self.engine = UnflushedPeak(self.disk)
        super().__init__(self.engine, path, **{"write_bytes_busy": MIB,
                                               "dirty_bytes_busy": 2 * MIB, **limits})

    async def write(self, nbytes: int, offset: int = 0) -> None:
        ops = self.ops(nbytes, offset)
        try:
            await self.sched.write(ops)
        finally:
            self.arena.release(ops[0].run)


def test_while_a_get_is_in_progress_no_flush_carries_more_than_the_dirty_bound(
        tmp_path: Path, backend: str) -> None:
    async def scenario() -> None:
        async with Bench(tmp_path) as b:
            with b.sched.foreground():
                await b.write(8 * MIB)  # 8 pieces of 1 MiB: a flush after the 2nd, 4th, 6th
            assert b.sched.flushes == 3
            assert b.engine.peak == 2 and b.disk.unsynced_writes() == 2
            await b.sched.datasync([b.fd])  # the put's own flush finds only the rest
            assert b.disk.unsynced_writes() == 0

    run_within(scenario, backend)


def test_without_reads_the_scheduler_never_flushes(tmp_path: Path, backend: str) -> None:
    async def scenario() -> None:
        async with Bench(tmp_path) as b:
            await b.write(8 * MIB)
            assert b.sched.flushes == 0 and b.disk.unsynced_writes() == 8

    run_within(scenario, backend)


def test_a_cancelled_writer_finishes_the_flush_it_started_and_writes_nothing(
        tmp_path: Path, backend: str) -> None:
    """The flush is shielded (writers that come while it runs count on it); the
    cancellation takes effect after it, before the writer's own piece is admitted.
    Writes keep going meanwhile: the flush covers what was written before it."""
    async def scenario() -> None:
        async with Bench(tmp_path) as b:
            with b.sched.foreground():
                await b.write(2 * MIB)  # 2 MiB dirty: the next write flushes first
                gate = b.engine.gate("datasync")
                scope = anyio.CancelScope()
                finished: list[str] = []

                async def writer() -> None:
                    with scope:
                        await b.write(MIB, 2 * MIB)
                        finished.append("cancelled writer")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(writer)
                    await gate.entered.wait()  # its flush is held on the device
                    await b.write(MIB, 3 * MIB)  # another writer is not held up by it
                    finished.append("other writer")
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()
                    assert b.disk.unsynced_writes() == 3  # the flush has not run yet
                    gate.open()
                assert finished == ["other writer"] and scope.cancelled_caught
                assert b.sched.flushes == 1
                assert b.sched.admitted["write"] == 3  # 2 + 1 pieces; none of the cancelled
            assert b.disk.unsynced_writes() == 0

    run_within(scenario, backend)


def test_a_failed_flush_fails_the_write_and_every_later_sync(tmp_path: Path,
                                                             backend: str) -> None:
    async def scenario() -> None:
        disk = SimulatedDisk(seed=2, faults=[("datasync", errno.EIO)])
        async with Bench(tmp_path, disk) as b:
            with b.sched.foreground():
                with pytest.raises(StoreIOError, match="fdatasync failed"):
                    await b.write(4 * MIB)
            assert not disk.faults  # the injected error was spent on the scheduler's flush
            with pytest.raises(StoreIOError, match="fdatasync failed"):
                await b.sched.datasync([b.fd])  # yet the put's own sync still fails
            with pytest.raises(StoreIOError, match="fdatasync failed"):
                await b.write(MIB)  # and so does any later write

    run_within(scenario, backend)
