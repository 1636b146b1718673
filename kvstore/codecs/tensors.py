"""Tensor <-> bytes, byte-exact, for the dtypes an engine keeps KV in.

The dtype code is stored in every slot header and index entry (FORMAT.md, "Dtype
codes"); codes are never reused.
"""

from __future__ import annotations

import torch

from kvstore.disk.format import MAX_NDIM
from kvstore.errors import OutputMismatchError, UnsupportedTensorError

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


class EncodedBlock(torch.Tensor):
    """A block whose payload is already made by kvstore's codec (FP8 quantised on the
    GPU by ``kvstore.cuda.mover``): it stands for a tensor of its ``dtype`` and
    ``shape`` without holding its values (zero strides, no memory), and carries
    ``codec_id`` and ``payload``.  ``put_many`` stores ``payload`` as the block's payload
    when the put's codec has the payload's base codec (the payload describes its own
    scales and layout); any other put of it raises :class:`UnsupportedTensorError`
    before a byte is written.  Made by :func:`encoded_block`."""

    codec_id: int
    payload: object  # a uint8 numpy array


def encoded_block(codec_id: int, payload: object, dtype: torch.dtype,
                  shape: tuple[int, ...]) -> EncodedBlock:
    block = torch.zeros((), dtype=dtype).expand(shape).as_subclass(EncodedBlock)
    assert isinstance(block, EncodedBlock)
    block.codec_id, block.payload = codec_id, payload
    return block


def encoded_payload(data: torch.Tensor) -> tuple[int, object] | None:
    """``(codec id, payload)`` of an :class:`EncodedBlock` (or of ``host_bytes``' view of
    one), else None."""
    if isinstance(data, EncodedBlock):
        return data.codec_id, data.payload
    return None


def check_value(t: object) -> tuple[int, int]:
    """Validate a value for ``put`` without touching its data: (bytes, dtype code).
    Values on a device are not copied here: the put path copies only the blocks it
    writes (deduplicated blocks never leave the device), see
    :meth:`kvstore.io.device_copies.DeviceCopier.to_host`."""
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
    return t.numel() * t.element_size(), dtype_code(t)


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The flat uint8 CPU view of the bytes of a value :func:`check_value` accepted
    (non-contiguous tensors are copied once; an :class:`EncodedBlock` gives a placeholder
    of its size, its payload travels with it).

    A value on a device must have reached the host first
    (:meth:`kvstore.io.device_copies.DeviceCopier.to_host`: stream-ordered copies, awaited,
    never a synchronize): refused here rather than copied by a call that waits for the
    whole device.
    """
    if isinstance(t, EncodedBlock):   # no values to copy: a placeholder of their size
        return encoded_block(t.codec_id, t.payload, torch.uint8,
                             (t.numel() * t.element_size(),))
    if t.device.type != "cpu":
        raise UnsupportedTensorError(
            f"a value on {t.device} reached the host path uncopied; pass it through "
            "the store's DeviceCopier.to_host first")
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


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
    check_writable_out(out)
    return out


def check_writable_out(out: torch.Tensor) -> None:
    """``out`` must be a tensor a block's bytes can be written into, element by element:
    refused (before any I/O) otherwise, rather than a raw torch error midway or a write
    that lands nowhere."""
    if out.device.type == "meta":
        raise OutputMismatchError("out tensor is on the meta device: it has no memory to "
                                  "write the block into")
    if out.layout != torch.strided or out.is_quantized:
        raise OutputMismatchError(f"out tensor must be a dense strided tensor, got "
                                  f"{'a quantized' if out.is_quantized else out.layout} one")
    if _overlaps(out):
        raise OutputMismatchError(
            f"out tensor has elements that share memory (size {tuple(out.shape)}, stride "
            f"{out.stride()}, e.g. from expand()): pass one whose elements are distinct")


def _overlaps(t: torch.Tensor) -> bool:
    """True unless the elements of ``t`` provably occupy distinct memory: dimensions of
    more than one element, by increasing stride, each step past the previous span."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    span = 1  # elements the dimensions before this one cover
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False
