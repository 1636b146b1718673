"""The conformance suite on the simulated disk (the crash tests' engine), plus its own
O_DIRECT enforcement and crash-state materialisation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import kvstore
from kvstore.io.arena import Arena
from kvstore.io.protocol import IoOp
from kvstore.io.simulated import SimulatedCrash, SimulatedDisk, SimulatedEngine
from tests.conformance import StoreConformance


class TestSimulatedStore(StoreConformance):
    engine = "simulated"

    def engine_option(self) -> Any:
        return SimulatedEngine(SimulatedDisk(seed=1))


pytestmark = pytest.mark.anyio


async def test_misaligned_transfers_fail_like_o_direct(tmp_path: Path) -> None:
    engine = SimulatedEngine(SimulatedDisk())
    (tmp_path / "f").touch()
    fd = engine.open_file(str(tmp_path / "f"))
    arena = Arena(3 * 4096)
    run = arena.try_acquire(4096)
    assert run is not None
    with pytest.raises(kvstore.StoreIOError, match="aligned"):
        await engine.write([IoOp(fd, 100, run)])
    engine.close_file(fd)
    arena.release(run)
    arena.close()


@pytest.mark.parametrize("mode", ["lose", "keep", "torn", "garbage"])
async def test_crash_states_only_touch_unsynced_writes(tmp_path: Path, mode: str) -> None:
    disk = SimulatedDisk(seed=3)
    engine = SimulatedEngine(disk)
    path = str(tmp_path / "f")
    (tmp_path / "f").touch()
    fd = engine.open_file(path)
    os.ftruncate(fd, 4 * 4096)
    arena = Arena(4 * 4096)
    a, b = arena.try_acquire(4096), arena.try_acquire(4096)
    assert a is not None and b is not None
    a.array[:] = 1
    b.array[:] = 2
    await engine.write([IoOp(fd, 0, a)])
    await engine.datasync([fd])
    await engine.write([IoOp(fd, 4096, b)])
    assert disk.crash(mode) == 1
    data = Path(path).read_bytes()
    assert data[:4096] == b"\x01" * 4096  # synced: untouched by any crash mode
    second = data[4096:8192]
    if mode == "lose":
        assert second == bytes(4096)
    elif mode == "keep":
        assert second == b"\x02" * 4096
    elif mode == "torn":
        assert all(second[i:i + 512] in (bytes(512), b"\x02" * 512) for i in range(0, 4096, 512))
    engine.close_file(fd)
    arena.release(a)
    arena.release(b)
    arena.close()


async def test_crash_at_a_chosen_operation(tmp_path: Path) -> None:
    disk = SimulatedDisk(crash_at=2)
    engine = SimulatedEngine(disk)
    (tmp_path / "f").touch()
    fd = engine.open_file(str(tmp_path / "f"))
    arena = Arena(2 * 4096)
    run = arena.try_acquire(4096)
    assert run is not None
    await engine.write([IoOp(fd, 0, run)])
    with pytest.raises(SimulatedCrash):
        await engine.datasync([fd])
    assert disk.unsynced_writes() == 1
    engine.close_file(fd)
    arena.release(run)
    arena.close()
