"""Tensor <-> bytes, byte-exact, for the dtypes an engine keeps KV in.

The dtype code is stored in every slot header and index entry (FORMAT.md, "Dtype
codes"); codes are never reused.
"""

from __future__ import annotations

import torch

from kvstore.errors import OutputMismatchError, UnsupportedTensorError
from kvstore.format import MAX_NDIM

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.uint8: 6,
    torch.int8: 7,
    torch.float64: 8,
    torch.int16: 9,
    torch.int32: 10,
    torch.int64: 11,
    torch.bool: 12,
}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}


def dtype_code(t: torch.Tensor) -> int:
    try:
        return DTYPE_CODES[t.dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise UnsupportedTensorError(
            f"cannot store dtype {t.dtype}; supported: {names}") from None


def host_bytes(t: object) -> tuple[torch.Tensor, int]:
    """Validate a value for ``put`` and return (flat uint8 CPU view of its bytes, dtype code).

    Non-contiguous tensors are copied once; tensors on an accelerator are copied to
    host memory (the CUDA staging path in ``cuda_ext`` avoids that copy).
    """
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensorError(f"values must be torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedTensorError(f"cannot store a {t.layout} tensor; pass a dense one")
    if t.is_quantized:
        raise UnsupportedTensorError("cannot store a quantized tensor; dequantize it first")
    if t.device.type == "meta":
        raise UnsupportedTensorError("cannot store a meta tensor: it has no data")
    if t.dim() > MAX_NDIM:
        raise UnsupportedTensorError(f"at most {MAX_NDIM} dimensions, got {t.dim()}")
    code = dtype_code(t)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8), code


def check_out(out: object, dtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate a caller-provided output tensor for a stored block (dtype code)."""
    return check_out_tensor(out, CODE_DTYPES[dtype], shape)


def check_out_tensor(out: object, want: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` must be a tensor of dtype ``want`` with as many elements as ``shape``."""
    if not isinstance(out, torch.Tensor):
        raise OutputMismatchError(f"out tensors must be torch.Tensor, got {type(out).__name__}")
    numel = 1
    for d in shape:
        numel *= d
    if out.dtype != want or out.numel() != numel:
        raise OutputMismatchError(
            f"out tensor is {out.dtype} with {out.numel()} elements; the stored block is "
            f"{want} with shape {tuple(shape)}")
    return out
