"""kvstore/cuda/pinned.py: registering the arena leaves the thread's current device as it
was, and the pool knows which host ranges the device can reach.

cudaHostRegister cannot run here (no driver), so the stand-in at the ctypes boundary
(tests/cuda/standin.py) plays the runtime: it records the current device at each call.
The pool's bookkeeping is the real one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.cuda import CudaError
from kvstore.cuda.pinned import PinnedPool
from kvstore.io.arena import Arena
from tests.cuda.standin import ILLEGAL_ADDRESS, StandInLibrary


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(1 << 20)
    yield a
    a.close()


def test_register_happens_on_kvstores_device_and_restores_the_callers(
        standin: StandInLibrary, arena: Arena) -> None:
    # kvstore's device is 1 (KVSTORE_CUDA_DEVICE), the engine's thread is on device 0.
    pool = PinnedPool(limit_bytes=arena.size)
    pool.register(arena.address, arena.size, "test arena")
    try:
        assert standin.devices_of("kvc_host_register") == [1]
        assert standin.current == 0  # the engine's device, as before the call
    finally:
        pool.unregister(arena.address)
    assert standin.registered == {}


def test_failed_register_restores_the_device_and_records_nothing(
        standin: StandInLibrary, arena: Arena) -> None:
    standin.fail["kvc_host_register"] = ILLEGAL_ADDRESS
    pool = PinnedPool(limit_bytes=arena.size)
    with pytest.raises(CudaError, match="kvc_host_register"):
        pool.register(arena.address, arena.size, "test arena")
    assert standin.current == 0
    assert pool.regions == 0 and pool.registered_bytes == 0


def test_covers_only_ranges_inside_one_registration(standin: StandInLibrary,
                                                    arena: Arena) -> None:
    pool = PinnedPool(limit_bytes=arena.size)
    a, n = arena.address, arena.size
    assert not pool.covers(a, 1)
    pool.register(a, n, "test arena")
    try:
        assert pool.covers(a, n) and pool.covers(a + 4096, 4096)
        assert not pool.covers(a - 1, 2)        # starts before
        assert not pool.covers(a + n - 1, 2)    # runs past the end
    finally:
        pool.unregister(a)
    assert not pool.covers(a, n)
