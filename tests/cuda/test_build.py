"""The CUDA sources compile warning-free (-Werror) with nvcc; build errors are clear."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from kvstore.cuda import _lib
from kvstore.cuda.build import (
    DEFAULT_ARCHS,
    BuildError,
    BuildResult,
    build,
    find_nvcc,
    nvcc_command,
    source_dir,
)


def test_sources_compile_warning_free(built_lib: BuildResult) -> None:
    # -Werror all-warnings and -Wall,-Wextra,-Werror are in the command: success = no warning.
    cmd = " ".join(built_lib.command)
    assert "-Werror all-warnings" in cmd and "-Wall,-Wextra,-Werror" in cmd
    assert "warning" not in built_lib.output.lower()
    assert built_lib.path.is_file() and built_lib.path.stat().st_size > 0
    assert built_lib.archs == DEFAULT_ARCHS


def test_library_exports_the_whole_abi(built_lib: BuildResult) -> None:
    dll = ctypes.CDLL(str(built_lib.path))
    for name in _lib._SIGNATURES:
        assert hasattr(dll, name), name
    assert dll.kvc_abi_version() == _lib.ABI_VERSION
    header = (source_dir() / "kvcuda.h").read_text()
    assert f"#define KVC_ABI_VERSION {_lib.ABI_VERSION}\n" in header


def test_architectures_cover_ampere_ada_hopper_and_ptx() -> None:
    cmd = " ".join(nvcc_command("nvcc", Path("x.so"), DEFAULT_ARCHS, Path("src")))
    for a in ("80", "89", "90"):
        assert f"arch=compute_{a},code=sm_{a}" in cmd
    assert "arch=compute_90,code=compute_90" in cmd        # PTX, JIT-compiled on newer GPUs
    assert "-cudart static" in cmd


needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")


@needs_nvcc
def test_bad_architecture_list_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTORE_CUDA_ARCHS", "hopper")
    with pytest.raises(BuildError, match="compute capabilities"):
        build(tmp_path / "lib.so")


@needs_nvcc
def test_missing_sources_are_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTORE_CUDA_SRC", str(tmp_path))
    with pytest.raises(BuildError, match="CUDA sources not found"):
        build(tmp_path / "lib.so")
    assert not (tmp_path / "lib.so").exists()
