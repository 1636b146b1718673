"""ctypes binding for the compiled FP8 row kernels (``kvstore/_native/fp8.c``).

The kernels are an optional speed-up of :mod:`kvstore.codecs.pipeline`: the install builds them
when a C compiler is present, and the codec falls back to its NumPy/torch path (same
bits, several times slower) when they are missing.  ``KVSTORE_NATIVE_CODECS=0`` in the
environment turns them off, e.g. to rule them out while debugging.

ctypes rather than a CPython extension: the library takes raw pointers and sizes and
nothing else, so it needs no Python headers, no reference counting and no ABI coupling,
and ctypes releases the GIL during every call -- codec work in a thread pool runs in
parallel with the event loop and with other blocks' codec work.

Callers pass contiguous CPU tensors / NumPy arrays; this module checks what it can
cheaply (dtype, contiguity, sizes) so that a wrong call raises instead of reading out of
bounds.
"""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
import torch

from kvstore._native import lib as native_lib

__all__ = ["available", "reason", "row_amax", "encode_rows", "decode_rows"]

_ABI_VERSION = 2
_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

_lib: ctypes.CDLL | None = None
_reason = "not loaded yet"


def _load() -> None:
    global _lib, _reason
    lib, _reason = native_lib.load(
        "_fp8", "KVSTORE_NATIVE_CODECS", "kvs_abi_version", _ABI_VERSION,
        "compiled FP8 kernels not built (no C compiler at install time?); reinstall with "
        "a C compiler for ~10x faster FP8 encode/decode")
    if lib is None:
        return
    i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvs_row_amax.argtypes = [vp, c_int, i64, i64, vp]
    lib.kvs_row_amax.restype = c_int
    lib.kvs_encode.argtypes = [vp, c_int, c_int, i64, i64, vp, vp, c_int]
    lib.kvs_encode.restype = c_int
    lib.kvs_decode.argtypes = [vp, c_int, i64, i64, vp, vp, c_int, c_int]
    lib.kvs_decode.restype = c_int
    _lib = lib
    _reason = f"compiled kernels ({_reason})"


_load()


def available() -> bool:
    """Whether the compiled kernels are loaded (else the codec uses NumPy/torch)."""
    return _lib is not None


def reason() -> str:
    """Which FP8 path the codec uses, and why (for ``stats()`` and bug reports)."""
    return _reason


def _check(t: torch.Tensor) -> tuple[int, int, int]:
    """(dtype code, rows, dim) of a contiguous CPU float tensor with ndim >= 1."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 1 or t.dtype not in _DTYPES:
        raise ValueError(f"need a contiguous CPU float16/bfloat16/float32 tensor, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    dim = int(t.shape[-1])
    return _DTYPES[t.dtype], t.numel() // dim if dim else 0, dim


def _k_ptr(k: npt.NDArray[np.int8], rows: int) -> int:
    if k.dtype != np.int8 or k.size != rows or not k.flags.c_contiguous:
        raise ValueError(f"need {rows} contiguous int8 scale exponents, got {k.dtype} {k.shape}")
    return int(k.ctypes.data)


def row_amax(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Largest finite ``|x|`` of every vector along the last axis (float32, shape
    ``x.shape[:-1]``), and whether ``x`` holds any NaN or infinity."""
    assert _lib is not None
    code, rows, dim = _check(x)
    amax = torch.empty(x.shape[:-1], dtype=torch.float32)
    rc = _lib.kvs_row_amax(x.data_ptr(), code, rows, dim, amax.data_ptr())
    if rc < 0:
        raise ValueError(f"kvs_row_amax rejected {x.dtype} {tuple(x.shape)}")
    return amax, rc == 1


def encode_rows(x: torch.Tensor, k: npt.NDArray[np.int8], fmt: int,
                codes: npt.NDArray[np.uint8], *, finite: bool = False) -> None:
    """``codes[...] = fp8(float32(x) * 2**k)``, one exponent per vector along the last
    axis; ``fmt`` is the codec's base id (1 E4M3, 2 E5M2).  ``finite=True`` promises no
    NaN/Inf in ``x`` and no ``|x * 2**k|`` beyond the format's range (true when ``k``
    comes from :func:`row_amax` that reported no special values) and takes a kernel
    about twice as fast."""
    assert _lib is not None
    code, rows, dim = _check(x)
    if codes.dtype != np.uint8 or codes.size != x.numel() or not codes.flags.c_contiguous:
        raise ValueError(f"codes must be {x.numel()} contiguous uint8, got {codes.shape}")
    if _lib.kvs_encode(x.data_ptr(), code, fmt, rows, dim, _k_ptr(k, rows),
                       codes.ctypes.data, int(finite)) != 0:
        raise ValueError("kvs_encode rejected its arguments (scale exponent out of range?)")


def decode_rows(codes: npt.NDArray[np.uint8], k: npt.NDArray[np.int8], fmt: int,
                out: torch.Tensor, *, finite: bool = False) -> None:
    """``out[...] = dtype(value(codes) * 2**-k)``, ``out`` contiguous and shaped like the
    block (its last axis is the vector along which ``k`` is constant).  ``finite=True``
    promises no NaN/Inf codes (the payload's flag) and takes a faster kernel; a broken
    promise gives wrong numbers, never an out-of-bounds access, which is why
    :func:`kvstore.codecs.pipeline.parse_fp8_payload` refuses a payload whose flag breaks it."""
    assert _lib is not None
    code, rows, dim = _check(out)
    if codes.dtype != np.uint8 or codes.size != out.numel() or not codes.flags.c_contiguous:
        raise ValueError(f"codes must be {out.numel()} contiguous uint8, got {codes.shape}")
    if _lib.kvs_decode(codes.ctypes.data, fmt, rows, dim, _k_ptr(k, rows), out.data_ptr(),
                       code, int(finite)) != 0:
        raise ValueError("kvs_decode rejected its arguments (scale exponent out of range?)")
