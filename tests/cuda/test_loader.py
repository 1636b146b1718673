"""The ctypes layer says clearly, and without failing, why CUDA is not used: library not
built, not a library, no driver/device.  The "no device" case is real here: the built
.so loads and cudaGetDeviceCount fails because this machine has no driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvstore
from kvstore import cuda
from kvstore.cuda import _lib
from kvstore.cuda.build import BuildResult
from kvstore.cuda.device import DeviceBuffer, Stream
from kvstore.cuda.page_locked import PageLockedPool
from tests.conformance import SMALL_EXTENT

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.anyio


def _has_device(rt: _lib.Runtime) -> bool:
    return rt.usable


def test_not_built_is_a_clear_reason(tmp_path: Path) -> None:
    rt = _lib.load(tmp_path / "libkvcuda.so")
    assert not rt.usable and rt.lib is None
    assert "not built" in rt.reason and "python -m kvstore cuda build" in rt.reason


def test_a_file_that_is_not_a_library_is_reported(tmp_path: Path) -> None:
    bogus = tmp_path / "libkvcuda.so"
    bogus.write_bytes(b"not an ELF file")
    rt = _lib.load(bogus)
    assert not rt.usable
    assert "does not load" in rt.reason and "rebuild" in rt.reason


def test_built_library_loads_and_reports_no_device(built_runtime: _lib.Runtime) -> None:
    if _has_device(built_runtime):
        pytest.skip("this machine has a CUDA device (tests/gpu covers it)")
    assert built_runtime.lib is not None             # the .so itself loaded
    assert built_runtime.runtime_version >= 12000     # static CUDA runtime inside
    assert not built_runtime.usable
    assert built_runtime.reason.startswith("no usable CUDA device")
    assert "driver" in built_runtime.reason.lower()   # e.g. "no NVIDIA driver found"
    assert "kvcuda abi" in built_runtime.lib.build_info


def test_public_probe_is_false_with_a_reason(use_built_runtime: _lib.Runtime) -> None:
    if _has_device(use_built_runtime):
        pytest.skip("this machine has a CUDA device")
    assert cuda.available() is False
    assert cuda.reason() == use_built_runtime.reason
    s = cuda.stats()
    assert s["path"] == "cpu" and s["library"] is not None and s["page_locked_bytes"] == 0


def test_device_objects_raise_a_clear_error(use_built_runtime: _lib.Runtime) -> None:
    if _has_device(use_built_runtime):
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(cuda.CudaError, match="no usable CUDA device"):
        DeviceBuffer(16)
    with pytest.raises(cuda.CudaError, match="no usable CUDA device"):
        Stream()
    pool = PageLockedPool(limit_bytes=1 << 20)
    with pytest.raises(cuda.CudaError):
        pool.register(4096, 4096, "test")
    assert pool.registered_bytes == 0 and pool.regions == 0


def test_cli_status_names_the_reason(built_lib: BuildResult) -> None:
    env = dict(os.environ, KVSTORE_CUDA_LIB=str(built_lib.path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "kvstore", "cuda", "status"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rt = _lib.load(built_lib.path)
    assert out.strip() == f"{'cuda' if rt.usable else 'cpu'}: {rt.reason}"


async def test_store_falls_back_and_says_why(tmp_path: Path, use_built_runtime: _lib.Runtime
                                             ) -> None:
    if _has_device(use_built_runtime):
        pytest.skip("this machine has a CUDA device")
    async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT, staging_bytes=1 << 20) as store:
        assert store.stats().cuda == f"cuda: unavailable ({use_built_runtime.reason})"
        key = bytes(16)
        await store.put(key, torch.arange(100, dtype=torch.float16))
        got = await store.get(key)
        assert got is not None and torch.equal(got, torch.arange(100, dtype=torch.float16))
    async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT, page_lock_staging=False) as store:
        assert store.stats().cuda == "cuda: not used (page_lock_staging=False)"


async def test_store_requiring_page_locked_staging_refuses_to_open(
        tmp_path: Path, use_built_runtime: _lib.Runtime) -> None:
    if _has_device(use_built_runtime):
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(cuda.CudaError, match="page_lock_staging=True failed: no usable CUDA device"):
        async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT, page_lock_staging=True):
            pass
    # nothing was left behind: the store opens again (lock released, arena unmapped)
    async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT, page_lock_staging=False):
        pass


async def test_store_without_library(tmp_path: Path, no_library: _lib.Runtime) -> None:
    async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT, staging_bytes=1 << 20) as store:
        assert store.stats().cuda.startswith("cuda: unavailable (CUDA library not built")
