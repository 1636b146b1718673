"""Fixtures for the CUDA-extension tests: one nvcc build per session, and a way to make
the process use a given probe result (a real load of a real library, not a mock)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvstore.cuda import _lib
from kvstore.cuda.build import BuildResult, build, find_nvcc
from tests.cuda.standin import StandInGpu, StandInLibrary


@pytest.fixture(scope="session")
def built_lib(tmp_path_factory: pytest.TempPathFactory) -> BuildResult:
    """The library, compiled once per session (all default architectures, -Werror)."""
    if find_nvcc() is None:
        pytest.skip("nvcc not installed: the CUDA sources cannot be compiled here")
    t0 = time.perf_counter()
    res = build(tmp_path_factory.mktemp("kvcuda") / "libkvcuda.so")
    print(f"\nnvcc build: {time.perf_counter() - t0:.1f} s")
    return res


@pytest.fixture(scope="session")
def built_runtime(built_lib: BuildResult) -> _lib.Runtime:
    return _lib.load(built_lib.path)


@pytest.fixture
def host_lib(built_runtime: _lib.Runtime) -> _lib.Library:
    """The loaded library (its *_host entry points need no device)."""
    assert built_runtime.lib is not None, built_runtime.reason
    return built_runtime.lib


@pytest.fixture
def use_built_runtime(built_runtime: _lib.Runtime) -> Iterator[_lib.Runtime]:
    """Make kvstore.cuda use the freshly built library for the duration of a test."""
    old = _lib.reset_for_tests(built_runtime)
    try:
        yield built_runtime
    finally:
        _lib.reset_for_tests(old)


@pytest.fixture
def no_library(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_lib.Runtime]:
    """Make kvstore.cuda behave as on a machine where the library was never built."""
    rt = _lib.load(tmp_path_factory.mktemp("nolib") / "libkvcuda.so")
    old = _lib.reset_for_tests(rt)
    try:
        yield rt
    finally:
        _lib.reset_for_tests(old)


@pytest.fixture
def standin() -> Iterator[StandInLibrary]:
    """kvstore.cuda sees two stand-in devices (tests/cuda/standin.py), device 0 current."""
    lib = StandInLibrary()
    old = _lib.reset_for_tests(lib.runtime(devices=2, device=1))
    try:
        yield lib
    finally:
        _lib.reset_for_tests(old)


@pytest.fixture
def standin_kernels(standin: StandInLibrary, host_lib: _lib.Library) -> StandInLibrary:
    """The stand-in, its FP8 "kernels" being the built library's host twins."""
    standin.host = host_lib
    return standin


@pytest.fixture
def gpu() -> Iterator[StandInGpu]:
    """kvstore.cuda sees one stand-in device with deferred streams (StandInGpu)."""
    lib = StandInGpu()
    old = _lib.reset_for_tests(lib.runtime(devices=1, device=0))
    try:
        yield lib
    finally:
        _lib.reset_for_tests(old)
