"""Codec ids and the codec spec: what a put asks for (``CodecSpec``, ``KVLayout``)
and the one byte a slot header stores (the table below), and the buffer helpers every
codec module shares.  The codecs themselves: :mod:`kvstore.codecs.pipeline`.

Codec ids
=========

The codec id is one byte (the slot header's ``codec`` field).  Bits 0-3 name the base
codec, bit 4 says that a zstd stage was applied on top; bits 5-7 are zero.

=====  ===============  =========================================================
 id    name             payload
=====  ===============  =========================================================
 0x00  raw              the tensor's bytes, C order, little-endian (FORMAT.md)
 0x01  fp8_e4m3         FP8 payload (below), codes in OCP E4M3FN
 0x02  fp8_e5m2         FP8 payload (below), codes in OCP E5M2
 0x10  raw + zstd       byte-plane payload (below)
 0x11  fp8_e4m3 + zstd  FP8 payload whose code array is one zstd frame
 0x12  fp8_e5m2 + zstd  same, E5M2
=====  ===============  =========================================================

``encode`` returns the id it actually used, which can differ from ``codec_id(spec)``:

* tensors that are not float16/bfloat16/float32 (fp8, integer, bool, float64) are never
  quantised: they are stored raw (or raw + zstd when the spec asks for zstd), byte-exact;
* empty and 0-d tensors are stored raw;
* a float block with a finite magnitude ``>= 2**EMAX(dtype)`` (32768 for float16,
  2**127 for bfloat16/float32) is stored losslessly, because the FP8 value nearest to
  it, times its scale, could exceed the dtype's range and decode to infinity;
* an FP8 payload that would not be smaller than the raw bytes (vectors of one or two
  16-bit elements: the header and scales outweigh the saving) is stored losslessly;
* the zstd stage is dropped when it does not make the payload smaller.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvstore.codecs import result_buffers
from kvstore.codecs.tensors import check_out_tensor

__all__ = ["BASE_MASK", "CODEC_RAW", "CodecSpec", "FLOAT_DTYPES", "FP8_E4M3", "FP8_E5M2",
           "GRANULARITIES", "KNOWN_IDS", "KVLayout", "NO_AXIS", "Payload", "U8", "ZSTD",
           "ZSTD_LEVEL", "as_bytes_u8", "codec_id", "finish", "is_known", "is_lossless",
           "payload_u8", "prepare_out", "u8_tensor"]

CODEC_RAW = 0
FP8_E4M3 = 1
FP8_E5M2 = 2
ZSTD = 0x10
BASE_MASK = 0x0F
KNOWN_IDS = frozenset({CODEC_RAW, FP8_E4M3, FP8_E5M2, CODEC_RAW | ZSTD,
                        FP8_E4M3 | ZSTD, FP8_E5M2 | ZSTD})

ZSTD_LEVEL = 1
"""zstd level of the zstd stage (level 3 gains nothing on KV data, at half the speed)."""

Payload = bytes | bytearray | memoryview | npt.NDArray[np.uint8]
U8 = npt.NDArray[np.uint8]

GRANULARITIES: tuple[str, ...] = ("token_head", "head", "token", "tensor")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NO_AXIS = 0xFF


@dataclass(frozen=True)
class KVLayout:
    """Where the K/V, token and head axes are in a block; the last axis is ``head_dim``.

    ``kv_axis`` indexes K (0) and V (1) when a block holds both (its size must be 2);
    ``None`` means the block is one tensor, quantised entirely with the spec's
    ``k_granularity`` (pass a spec with ``k_granularity="head"`` for a V-only block).
    Axes that are none of these (e.g. a layer axis) always get scales of their own.
    Axes are non-negative or negative Python indices; none may be the last axis.
    """

    kv_axis: int | None
    token_axis: int
    head_axis: int


@dataclass(frozen=True)
class CodecSpec:
    """What the writer asks for.  ``fp8``: ``"e4m3"``, ``"e5m2"`` or ``None`` (lossless);
    ``zstd``: add the zstd stage; ``layout``: the block's axes (``None``: one scale per
    vector along the last axis, or per tensor with granularity ``"tensor"``);
    ``k_granularity`` / ``v_granularity``: one of ``GRANULARITIES``.

    The defaults (K per token and head, V per head) are the conservative choice for K's
    per-token outliers.  Measured on real SmolLM2 activations
    (benchmarks/results/codecs.md), granularity barely matters *with power-of-two
    scales*: the relative rounding error of FP8 does not depend on the scale, so a
    coarser scale only hurts the few values it pushes into the FP8 subnormal range
    (attention-output error 0.0538 for every granularity; per-tensor saves ~2% bytes).
    """

    fp8: str | None = None
    zstd: bool = False
    layout: KVLayout | None = None
    k_granularity: str = "token_head"
    v_granularity: str = "head"

    def __post_init__(self) -> None:
        if self.fp8 not in (None, "e4m3", "e5m2"):
            raise ValueError(f"fp8 must be 'e4m3', 'e5m2' or None, got {self.fp8!r}")
        for name in (self.k_granularity, self.v_granularity):
            if name not in GRANULARITIES:
                raise ValueError(f"granularity must be one of {GRANULARITIES}, got {name!r}")


def is_known(codec: int) -> bool:
    """Whether this build can decode payloads of ``codec`` (an id from a slot header)."""
    return codec in KNOWN_IDS


def is_lossless(codec: int) -> bool:
    """Whether a block written with ``codec`` reads back as the exact bytes put."""
    return codec & BASE_MASK == CODEC_RAW


def codec_id(spec: CodecSpec) -> int:
    """The codec id ``spec`` asks for (``encode`` may fall back to a simpler one)."""
    base = {None: CODEC_RAW, "e4m3": FP8_E4M3, "e5m2": FP8_E5M2}[spec.fp8]
    return base | (ZSTD if spec.zstd else 0)


def as_bytes_u8(t: torch.Tensor) -> U8:
    """Zero-copy flat uint8 numpy view of a contiguous CPU tensor's bytes."""
    return t.reshape(-1).view(torch.uint8).numpy()


def payload_u8(payload: Payload) -> U8:
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 1:
            payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        return payload
    return np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)


def u8_tensor(a: U8) -> torch.Tensor:
    # Payloads are often read-only (bytes); torch warns about that but we never write.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def prepare_out(out: torch.Tensor | None, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor to return, contiguous tensor of ``shape`` to write into)."""
    if out is None:
        t = result_buffers.empty(tuple(shape), dtype)
        return t, t
    out = check_out_tensor(out, dtype, tuple(shape))
    if out.device.type == "cpu" and out.is_contiguous():
        return out, out.view(shape)
    return out, torch.empty(shape, dtype=dtype)


def finish(ret: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    if ret is not work and ret.data_ptr() != work.data_ptr():
        ret.copy_(work.view(ret.shape))
    return ret
