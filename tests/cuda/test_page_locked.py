"""kvstore/cuda/page_locked.py: registering the arena leaves the thread's current device as it
was, the pool knows which host ranges the device can reach, and its limit and figures
go by their page-locked names (the old "pinned" ones kept, deprecated, for one release).

cudaHostRegister cannot run here (no driver), so the stand-in at the ctypes boundary
(tests/cuda/standin.py) plays the runtime: it records the current device at each call.
The pool's bookkeeping is the real one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from kvstore import cuda
from kvstore.cuda import CudaError, page_locked
from kvstore.cuda.page_locked import PageLockedPool
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
    pool = PageLockedPool(limit_bytes=arena.size)
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
    pool = PageLockedPool(limit_bytes=arena.size)
    with pytest.raises(CudaError, match="kvc_host_register"):
        pool.register(arena.address, arena.size, "test arena")
    assert standin.current == 0
    assert pool.regions == 0 and pool.registered_bytes == 0


def test_covers_only_ranges_inside_one_registration(standin: StandInLibrary,
                                                    arena: Arena) -> None:
    pool = PageLockedPool(limit_bytes=arena.size)
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


def test_the_limit_comes_from_the_page_locked_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(page_locked.LIMIT_ENV, str(3 << 20))
    monkeypatch.setenv("KVSTORE_CUDA_PINNED_LIMIT", str(5 << 20))  # the new name wins
    assert page_locked.LIMIT_ENV == "KVSTORE_CUDA_PAGE_LOCKED_LIMIT"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning: the new name is set
        assert PageLockedPool().limit_bytes == 3 << 20


def test_the_old_limit_variable_is_still_honoured_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(page_locked.LIMIT_ENV, raising=False)
    monkeypatch.setenv("KVSTORE_CUDA_PINNED_LIMIT", str(5 << 20))
    with pytest.warns(DeprecationWarning, match="KVSTORE_CUDA_PAGE_LOCKED_LIMIT"):
        pool = PageLockedPool()
    assert pool.limit_bytes == 5 << 20


def test_stats_name_the_page_locked_figures_and_keep_the_old_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_locked, "_pool", PageLockedPool(limit_bytes=7 << 20))
    s = cuda.stats()
    assert (s["page_locked_bytes"], s["page_locked_regions"],
            s["page_locked_limit_bytes"]) == (0, 0, 7 << 20)
    # deprecated for one release: the same figures under the old names
    assert (s["pinned_bytes"], s["pinned_regions"], s["pinned_limit_bytes"]) == (0, 0, 7 << 20)
