"""Group sync (kvstore/io/group_sync.py): callers that arrive while an fdatasync runs share
the next one, never the running one; a failed sync fails everyone who needed it; a
cancelled leader still finishes the sync its followers wait for.  Real engines and files,
the syncs held at a gate (``tests/concurrency.py``), on asyncio and trio."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from kvstore.errors import StoreIOError
from kvstore.io.group_sync import GroupSync
from kvstore.io.protocol import IOEngine
from tests.concurrency import BACKENDS, ENGINES, GatedEngine, real_engine, run_within, until

pytestmark = [pytest.mark.parametrize("backend", BACKENDS),
              pytest.mark.parametrize("kind", ENGINES)]

DEADLINE_IN = 45.0


class CountingEngine(GatedEngine):
    """Counts the fdatasyncs that reach the real engine."""

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner)
        self.synced: list[list[int]] = []

    async def datasync(self, fds: Sequence[int]) -> None:
        await super().datasync(fds)
        self.synced.append(list(fds))


def open_files(engine: IOEngine, path: Path, n: int) -> list[int]:
    for i in range(n):
        (path / f"f{i}").touch()
    return [engine.open_file(str(path / f"f{i}")) for i in range(n)]


def test_callers_arriving_during_a_sync_share_the_next_one(tmp_path: Path, kind: str,
                                                           backend: str) -> None:
    async def scenario() -> None:
        engine = CountingEngine(real_engine(kind, tmp_path))
        await engine.start()
        (fd,) = open_files(engine, tmp_path, 1)
        group = GroupSync(engine)
        done: list[str] = []

        async def caller(name: str) -> None:
            await group.datasync([fd])
            done.append(name)

        first = engine.gate("datasync")
        with anyio.fail_after(DEADLINE_IN):
            async with anyio.create_task_group() as tg:
                tg.start_soon(caller, "leader")
                await first.entered.wait()  # sync 1 runs (held)
                for name in ("b", "c", "d"):
                    tg.start_soon(caller, name)
                await until(lambda: group.requests == 4)
                second = engine.gate("datasync")
                first.open()
                await second.entered.wait()  # sync 2 started, after b, c, d arrived
                # sync 1 started before they called: it must not have released them
                assert done == ["leader"]
                second.open()
        assert sorted(done) == ["b", "c", "d", "leader"]
        assert len(engine.synced) == 2 and group.syncs == 2  # not 4
        engine.close_file(fd)
        await engine.aclose()

    run_within(scenario, backend)


def test_one_caller_of_several_files_syncs_them_in_one_call(tmp_path: Path, kind: str,
                                                            backend: str) -> None:
    async def scenario() -> None:
        engine = CountingEngine(real_engine(kind, tmp_path))
        await engine.start()
        fds = open_files(engine, tmp_path, 3)
        group = GroupSync(engine)
        await group.datasync(fds)
        await group.datasync(fds[:1])  # a later call needs a later sync
        assert engine.synced == [fds, fds[:1]]
        for fd in fds:
            engine.close_file(fd)
        await engine.aclose()

    run_within(scenario, backend)


def test_a_failed_sync_fails_every_caller_that_needed_it(tmp_path: Path, kind: str,
                                                         backend: str) -> None:
    async def scenario() -> None:
        engine = CountingEngine(real_engine(kind, tmp_path))
        await engine.start()
        read_end, write_end = os.pipe()  # fdatasync on a pipe fails (EINVAL)
        group = GroupSync(engine)
        errors: list[BaseException] = []

        async def caller() -> None:
            try:
                await group.datasync([write_end])
            except StoreIOError as e:
                errors.append(e)

        gate = engine.gate("datasync")
        try:
            with anyio.fail_after(DEADLINE_IN):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(caller)
                    await gate.entered.wait()
                    tg.start_soon(caller)  # waits for sync 1, then needs sync 2
                    await until(lambda: group.requests == 2)
                    gate.open()
        finally:
            os.close(read_end)
            os.close(write_end)
        assert len(errors) == 2 and all(isinstance(e, StoreIOError) for e in errors)
        await engine.aclose()

    run_within(scenario, backend)


def test_a_cancelled_leader_still_finishes_the_sync_its_followers_share(
        tmp_path: Path, kind: str, backend: str) -> None:
    """b and c both arrive while sync 1 runs and both need sync 2; whichever leads it is
    cancelled while sync 2 is on the device: the other still gets sync 2 (not the
    leader's cancellation, not a sync of its own)."""
    async def scenario() -> None:
        engine = CountingEngine(real_engine(kind, tmp_path))
        await engine.start()
        (fd,) = open_files(engine, tmp_path, 1)
        group = GroupSync(engine)
        scopes: dict[str, anyio.CancelScope] = {}
        outcome: dict[str, str] = {}
        leaders: list[str] = []

        async def caller(name: str) -> None:
            with anyio.CancelScope() as scope:
                scopes[name] = scope
                await group.datasync([fd])
                outcome[name] = "synced"
            outcome.setdefault(name, "cancelled")

        async def note_leader() -> None:  # runs in the leading task, at the gate
            leaders.append(anyio.get_current_task().name)

        first = engine.gate("datasync")
        with anyio.fail_after(DEADLINE_IN):
            async with anyio.create_task_group() as tg:
                tg.start_soon(caller, "a", name="a")
                await first.entered.wait()
                tg.start_soon(caller, "b", name="b")
                tg.start_soon(caller, "c", name="c")
                await until(lambda: group.requests == 3)
                second = engine.gate("datasync")
                second.on_enter = note_leader
                first.open()
                await second.entered.wait()
                (leader,) = leaders
                (follower,) = {"b", "c"} - {leader}
                scopes[leader].cancel()  # shielded: sync 2 runs to its end
                second.open()
        assert outcome["a"] == "synced" and outcome[follower] == "synced"
        assert len(engine.synced) == 2  # the follower shared sync 2
        engine.close_file(fd)
        await engine.aclose()

    run_within(scenario, backend)
