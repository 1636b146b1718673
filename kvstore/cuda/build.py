"""Compile ``cuda_ext/*.cu`` into ``libkvcuda.so`` with ``nvcc`` (``python -m kvstore cuda build``).

Why an explicit command and not a setuptools build step: nvcc needs tens of seconds per
GPU architecture, and ``pip install -e .`` runs in every CI job, most of them on
machines without a GPU.  So the library is built on demand, into a cache directory
that the loader (:mod:`kvstore.cuda._lib`) searches:

* ``$KVSTORE_CUDA_LIB`` when set (a path to the .so, for the build and the loader);
* else ``$XDG_CACHE_HOME/kvstore/libkvcuda.so`` (``~/.cache/kvstore/libkvcuda.so``).

Sources are ``cuda_ext/`` of a source checkout (or ``$KVSTORE_CUDA_SRC``).

Architectures: SASS for sm_80 (A100), sm_89 (L4/L40/Ada) and sm_90 (H100/H200), plus
PTX for compute_90 so that newer GPUs JIT-compile it; ``$KVSTORE_CUDA_ARCHS`` (e.g.
``"90"`` or ``"80;90"``) overrides the list.  The CUDA runtime is linked statically:
the library needs only the driver at run time and does not care which CUDA runtime
torch brought.  Warnings are errors (``-Werror all-warnings``, ``-Wall -Wextra
-Werror`` for the host compiler), and tests/cuda/test_build.py keeps it so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_ARCHS", "BuildError", "BuildResult", "build", "default_library_path",
           "find_nvcc", "nvcc_command", "source_dir"]

DEFAULT_ARCHS: tuple[str, ...] = ("80", "89", "90")
SOURCES = ("memory.cu", "gather_scatter.cu", "fp8.cu")
LIB_NAME = "libkvcuda.so"


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message says what to do."""


@dataclass(frozen=True)
class BuildResult:
    path: Path
    seconds: float
    archs: tuple[str, ...]
    command: list[str]
    output: str


def default_library_path() -> Path:
    env = os.environ.get("KVSTORE_CUDA_LIB")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvstore" / LIB_NAME


def source_dir() -> Path:
    env = os.environ.get("KVSTORE_CUDA_SRC")
    src = Path(env) if env else Path(__file__).resolve().parents[2] / "cuda_ext"
    if not all((src / name).is_file() for name in SOURCES):
        raise BuildError(f"CUDA sources not found in {src} (expected {', '.join(SOURCES)}); "
                         "run from a source checkout or set KVSTORE_CUDA_SRC")
    return src


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def _archs() -> tuple[str, ...]:
    env = os.environ.get("KVSTORE_CUDA_ARCHS")
    if not env:
        return DEFAULT_ARCHS
    archs = tuple(a.strip().removeprefix("sm_") for a in env.replace(",", ";").split(";") if a.strip())
    if not archs or not all(a.isdigit() for a in archs):
        raise BuildError(f"KVSTORE_CUDA_ARCHS={env!r}: give compute capabilities like '80;90'")
    return archs


def nvcc_command(nvcc: str, out: Path, archs: tuple[str, ...], src: Path) -> list[str]:
    gencode: list[str] = []
    for a in archs:
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    top = max(archs, key=int)
    gencode += ["-gencode", f"arch=compute_{top},code=compute_{top}"]  # PTX: forward compat
    return [nvcc, "-O3", "-std=c++17", "-shared", "-cudart", "static", "--threads", "0",
            "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror", "-Werror", "all-warnings",
            *gencode, "-I", str(src), *(str(src / s) for s in SOURCES), "-o", str(out)]


def build(out: Path | None = None, archs: tuple[str, ...] | None = None) -> BuildResult:
    """Compile the library to ``out`` (default: :func:`default_library_path`).  The .so is
    written next to ``out`` and renamed into place, so a running process never loads a
    half-written file."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (not on PATH, CUDA_HOME or /usr/local/cuda): install "
                         "the CUDA toolkit to build kvstore's CUDA library; without it "
                         "kvstore uses its CPU paths")
    src = source_dir()
    out = Path(out) if out is not None else default_library_path()
    archs = archs or _archs()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libkvcuda-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = nvcc_command(nvcc, Path(tmp), archs, src)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BuildError(f"nvcc failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return BuildResult(out, time.perf_counter() - t0, archs, cmd, proc.stdout + proc.stderr)
