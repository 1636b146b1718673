"""G5 after a failed fdatasync: no put whose bytes were written before the failure is
acknowledged, whoever's sync it was and wherever in the group it failed.

On Linux a failed fsync reports its error once and may drop the dirty pages it could
not write; a later fsync that succeeds proves nothing about them (PostgreSQL's
"fsyncgate").  Several callers put blocks into one extent at once, so their writes and
fdatasyncs interleave and share; the engine fails the k-th fdatasync, for every k, once
every caller's writes have returned (so some of them returned while it ran, which is
the case the store used to get wrong: those callers waited for the next sync, which
succeeded, and were acknowledged).

The engines are real (io_uring, the thread pool) or the simulated disk, wrapped to log
each write's and sync's completion and to fail the chosen sync.  The check: for every
acknowledged put, each of its writes was followed by a successful fdatasync of its file
before the failure.  On the simulated disk the writes the failed sync left unsynced are
then lost (a crash that keeps none of them), and every acknowledged block must still
read back bit-exact after reopening (G1).
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.errors import KVStoreError, ReadOnlyError, StoreIOError
from kvstore.io.protocol import EngineWrapper, IOEngine, IoOp
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine
from kvstore.testing import parts
from tests.concurrency import ENGINES, real_engine, run_within

CALLERS = 4
BLOCK = 64 << 10
OPEN = dict(extent_bytes=4 << 20, staging_bytes=8 << 20)


class FailingSync(EngineWrapper):
    """Logs completed writes and syncs in one sequence; the ``fail_at``-th datasync call
    waits until ``writes_before_fail`` writes have returned, then fails with EIO without
    syncing; later syncs succeed, as on Linux, where the error is reported once and the
    pages it could not write may be gone (on the simulated disk they are)."""

    def __init__(self, inner: IOEngine, fail_at: int, writes_before_fail: int) -> None:
        super().__init__(inner)
        self.fail_at, self.writes_before_fail = fail_at, writes_before_fail
        self.log: list[tuple[str, int, int]] = []  # (event, fd, offset)
        self.syncs = 0
        self.writes = 0
        self.armed = False  # counts and fails only once the test arms it
        self._wrote: anyio.Event | None = None

    async def write(self, ops: Sequence[IoOp]) -> None:
        await self.inner.write(ops)
        if not self.armed:
            return
        for op in ops:
            self.log.append(("write", op.fd, op.offset))
        self.writes += len(ops)
        wrote, self._wrote = self._wrote, None
        if wrote is not None:
            wrote.set()

    async def until_written(self, n: int) -> None:
        """Until ``n`` writes returned since the engine was armed."""
        while self.writes < n:
            if self._wrote is None:  # one event for every waiter, replaced once set
                self._wrote = anyio.Event()
            await self._wrote.wait()

    async def datasync(self, fds: Sequence[int]) -> None:
        if not self.armed:
            await self.inner.datasync(fds)
            return
        self.syncs += 1
        if self.syncs == self.fail_at:
            # Hold the failing sync until every caller's writes returned: they then
            # returned while it ran (their bytes are among what it lost).
            await self.until_written(self.writes_before_fail)
        if self.syncs == self.fail_at:
            for fd in fds:
                self.log.append(("sync-failed", fd, 0))
            if isinstance(self.inner, SimulatedEngine):
                # What Linux may do: the dirty pages the failed sync could not write are
                # dropped (the file reads back its old bytes there)...
                self.inner.disk.crash("lose")
            raise StoreIOError(errno.EIO, "fdatasync failed: Input/output error (injected)")
        # ...and a later sync succeeds, proving nothing about them.
        await self.inner.datasync(fds)
        for fd in fds:
            self.log.append(("sync", fd, 0))


def _key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def _block(i: int) -> torch.Tensor:
    return torch.full((BLOCK // 4,), float(i + 1), dtype=torch.float32)


def _covered(log: list[tuple[str, int, int]], fd: int, start: int, end: int) -> bool:
    """Every write to [start, end) of ``fd`` was followed by a successful sync of ``fd``
    before the first failed sync."""
    failed = next((i for i, (kind, _, _) in enumerate(log) if kind == "sync-failed"), len(log))
    writes = [i for i, (kind, f, off) in enumerate(log)
              if kind == "write" and f == fd and start <= off < end]
    assert writes, "no write of an acknowledged block was logged"
    return any(kind == "sync" and f == fd and max(writes) < i < failed
               for i, (kind, f, _) in enumerate(log))


async def _race(path: Path, engine: FailingSync) -> tuple[dict[bytes, torch.Tensor],
                                                          list[bytes]]:
    """``CALLERS`` tasks put one block each at once; returns the acknowledged blocks and
    the keys that failed."""
    acked: dict[bytes, torch.Tensor] = {}
    failed: list[bytes] = []
    async with kvstore.open(path, engine=engine, **OPEN) as store:
        await store.put(_key("warm-extent"), _block(99))  # the extent exists: one file, one fd
        engine.armed = True

        async def put(i: int) -> None:
            # Staggered: caller i starts once i writes returned, so the callers' syncs
            # spread over several positions of the group (one sync each, or shared).
            await engine.until_written(i)
            key, value = _key(f"caller-{i}"), _block(i)
            try:
                await store.put(key, value)
            except KVStoreError:
                failed.append(key)
            else:
                acked[key] = value

        async with anyio.create_task_group() as tg:
            for i in range(CALLERS):
                tg.start_soon(put, i)
        if engine.syncs < engine.fail_at:  # every put was synced before that position
            assert not failed and not store.read_only
            return acked, failed
        assert failed, "the injected failure failed no put"
        assert store.read_only, "a failed fdatasync must turn the store read-only"
        with pytest.raises(ReadOnlyError):
            await store.put(_key("after"), _block(7))
        fds = dict(parts(store).fds)
        entries = dict(zip(acked, parts(store).index.get_entries(list(acked)), strict=True))
        for key, entry in entries.items():
            assert entry is not None
            assert _covered(engine.log, fds[entry.extent], entry.offset,
                            entry.offset + entry.slot_len), \
                f"{key!r} was acknowledged, but a write of it was not synced before the " \
                f"failure (log: {engine.log})"
    return acked, failed


@pytest.mark.parametrize("fail_at", range(1, CALLERS + 1))
@pytest.mark.parametrize("kind", ENGINES)
def test_no_put_is_acknowledged_with_bytes_a_failed_sync_covered(
        tmp_path: Path, kind: str, fail_at: int) -> None:
    async def scenario() -> None:
        engine = FailingSync(real_engine(kind, tmp_path / "store"), fail_at, CALLERS)
        acked, failed = await _race(tmp_path / "store", engine)
        assert len(acked) + len(failed) == CALLERS

    run_within(scenario, "asyncio")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fail_at", range(1, CALLERS + 1))
def test_simulated_disk_loses_what_the_failed_sync_covered_and_no_ack_is_lost(
        tmp_path: Path, fail_at: int, seed: int) -> None:
    async def scenario() -> None:
        disk = SimulatedDisk(seed=seed)
        engine = FailingSync(SimulatedEngine(disk), fail_at, CALLERS)
        acked, failed = await _race(tmp_path / "store", engine)
        disk.crash("lose")  # and whatever else was not synced
        async with kvstore.open(tmp_path / "store", **OPEN) as store:
            got = await store.get_many(list(acked))
            for (key, value), block in zip(acked.items(), got, strict=True):
                assert block is not None and torch.equal(block, value), \
                    f"acknowledged {key!r} did not survive the failed sync"

    run_within(scenario, "asyncio")
