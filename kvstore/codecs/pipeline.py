"""Per-block codecs as pure functions: ``prepare``/``encode`` turn one tensor into
``(codec id, payload bytes)`` and ``decode`` turns them back.

This module is standalone: it turns one tensor into ``(codec id, payload bytes)`` and
back, and knows nothing about slots, extents or the index.  A payload is fully
self-describing given what a slot header already stores (codec id, dtype, shape): the
KV layout and the scales travel inside it, so ``decode`` needs nothing else.

The parts, each with its format: codec ids and the spec (:mod:`kvstore.codecs.spec`),
FP8 with power-of-two scales (:mod:`kvstore.codecs.fp8`, parsed and decoded by
:mod:`kvstore.codecs.fp8_payload`), zstd over FP8 codes or byte planes
(:mod:`kvstore.codecs.planes`).  The names callers use are re-exported here.

Every decoder checks every length, field and range and raises
:class:`~kvstore.errors.CorruptionError` (nothing else) for a payload that does not
parse.  FP8 payloads have one parser, :func:`parse_fp8_payload`, for every decoder
(this module's two paths, the GPU kernel and its CPU twin): they refuse the same
payloads and decode every other one to the same bits
(tests/cuda/test_fp8_decoders_agree.py).
A caller-provided ``out`` that does not fit raises
:class:`~kvstore.errors.OutputMismatchError`.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

from kvstore.codecs.fp8 import (
    FLAG_SPECIAL,
    FP8_HEADER,
    fp8_codes,
    fp8_head,
    fp8_smaller,
    scale_count,
    scale_plan,
)
from kvstore.codecs.fp8_payload import Fp8Payload, decode_fp8, parse_fp8_payload
from kvstore.codecs.planes import decode_planes, encode_planes, zstd_stage
from kvstore.codecs.spec import (
    BASE_MASK,
    CODEC_RAW,
    FLOAT_DTYPES,
    FP8_E4M3,
    FP8_E5M2,
    GRANULARITIES,
    KNOWN_IDS,
    U8,
    ZSTD,
    ZSTD_LEVEL,
    CodecSpec,
    KVLayout,
    Payload,
    as_bytes_u8,
    codec_id,
    finish,
    is_known,
    is_lossless,
    payload_u8,
    prepare_out,
)
from kvstore.errors import CorruptionError

__all__ = ["CODEC_RAW", "FP8_E4M3", "FP8_E5M2", "GRANULARITIES", "ZSTD", "ZSTD_LEVEL",
           "CodecSpec", "Encoded", "Fp8Payload", "KVLayout", "Payload", "codec_id", "decode",
           "encode", "is_known", "is_lossless", "parse_fp8_payload", "planned_nbytes",
           "prepare"]


class Encoded:
    """One block's codec output.  ``codec`` and ``nbytes`` are known as soon as
    :func:`prepare` returns; the payload bytes are produced by :meth:`write_into`, which
    a writer points straight at its I/O staging memory.  For FP8 without zstd the
    expensive step (one pass over the block) happens there, so a store can quantise one
    chunk while the device writes the previous one, with no intermediate copy.

    Holds a reference to the input tensor until then: do not modify it in between.
    """

    __slots__ = ("codec", "nbytes", "_payload", "_head", "_x", "_k_rows")

    def __init__(self, codec: int, payload: U8 | None = None, *,
                 fp8: tuple[U8, torch.Tensor, npt.NDArray[np.int8]] | None = None) -> None:
        self.codec = codec
        self._payload = payload
        if fp8 is not None:
            self._head, self._x, self._k_rows = fp8
            self.nbytes = self._head.size + self._x.numel()
        else:
            assert payload is not None
            self.nbytes = payload.size

    def write_into(self, dst: U8) -> None:
        """Write the ``nbytes`` payload bytes into ``dst`` (contiguous uint8, that long)."""
        if dst.size != self.nbytes or dst.dtype != np.uint8:
            raise ValueError(f"need a {self.nbytes}-byte uint8 buffer, got {dst.dtype} "
                             f"{dst.shape}")
        if self._payload is not None:
            dst[:] = self._payload
            return
        h = self._head.size
        dst[:h] = self._head
        special = bool(self._head[1] & FLAG_SPECIAL)
        fp8_codes(self._x, self.codec & BASE_MASK, self._k_rows, dst[h:], special)

    def payload(self) -> U8:
        """The payload as an array (for a raw codec a zero-copy view of the input)."""
        if self._payload is not None:
            return self._payload
        out = np.empty(self.nbytes, dtype=np.uint8)
        self.write_into(out)
        return out


def planned_nbytes(shape: tuple[int, ...], dtype: torch.dtype, spec: CodecSpec) -> int | None:
    """The FP8 payload size :func:`prepare` gives a block of this shape and dtype, known
    before its values are read, or None where it is not (no FP8, zstd, or a shape FP8
    does not serve).  ``prepare`` can still differ for one input: values too large for
    the scale exponents fall back to the lossless raw payload; a writer that sized a slot
    from this plan compares the two (``kvstore.io.slots.PutItem``).  Lets a store reserve
    FP8 slots before encoding and quantise chunk by chunk, overlapped with the writes.
    Raises what ``prepare`` raises for a layout that does not fit ``shape``."""
    want = codec_id(spec)
    numel = math.prod(shape)
    if want & ZSTD or want & BASE_MASK == CODEC_RAW or dtype not in FLOAT_DTYPES \
            or not shape or numel == 0:
        return None
    n_scales = scale_count(scale_plan(shape, spec)[2])
    if not fp8_smaller(n_scales, numel, dtype.itemsize):
        return None
    return FP8_HEADER.size + n_scales + numel


def prepare(t: torch.Tensor, spec: CodecSpec) -> Encoded:
    """Choose the codec for one block and do everything but the FP8 pass (see
    :class:`Encoded`); zstd stages and lossless fallbacks are computed here in full.

    ``t`` may be on any device (it is copied to the host).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"encode takes a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    want = codec_id(spec)
    if want & BASE_MASK != CODEC_RAW and t.dtype in FLOAT_DTYPES and t.dim() >= 1 \
            and t.numel() > 0:
        base = want & BASE_MASK
        planned = fp8_head(t, base, spec)
        if planned is not None and fp8_smaller(planned[0].size - FP8_HEADER.size, t.numel(),
                                                t.element_size()):
            lazy = Encoded(base, fp8=(planned[0], t, planned[1]))
            if not spec.zstd:
                return lazy
            return Encoded(*zstd_stage(base, lazy.payload(), planned[0].size))
    raw = as_bytes_u8(t)
    if spec.zstd and raw.size > 0:
        planes = encode_planes(raw, t.element_size())
        if planes is not None:
            return Encoded(CODEC_RAW | ZSTD, planes)
    return Encoded(CODEC_RAW, raw)


def encode(t: torch.Tensor, spec: CodecSpec) -> tuple[int, U8]:
    """Encode one block.  Returns (codec id actually used, payload).

    The payload is a flat uint8 numpy array; for codec 0 it is a zero-copy view of
    ``t``'s bytes (when ``t`` is a contiguous CPU tensor), so write it out before
    modifying ``t``.  ``t`` may be on any device (it is copied to the host).
    """
    e = prepare(t, spec)
    return e.codec, e.payload()


def _decode_raw(data: U8, dtype: torch.dtype, shape: tuple[int, ...],
                out: torch.Tensor | None) -> torch.Tensor:
    ret, work = prepare_out(out, dtype, shape)
    nbytes = work.numel() * work.element_size()
    if data.size != nbytes:
        raise CorruptionError(f"raw payload is {data.size} bytes, the block needs {nbytes}")
    if nbytes:
        as_bytes_u8(work)[:] = data
    return finish(ret, work)


def decode(codec: int, payload: Payload, dtype: torch.dtype, shape: tuple[int, ...],
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a payload written by :func:`encode` (inputs: what a slot header stores).

    Returns a CPU tensor of ``dtype`` and ``shape``; with ``out``, writes into it and
    returns it (same dtype and number of elements required, else
    :class:`~kvstore.errors.OutputMismatchError`).  A payload that does not parse
    raises :class:`~kvstore.errors.CorruptionError`.
    """
    shape = tuple(int(d) for d in shape)
    if codec not in KNOWN_IDS:
        raise CorruptionError(f"unknown codec id {codec:#x}")
    if any(d < 0 for d in shape):
        raise CorruptionError(f"negative dimension in shape {shape}")
    data = payload_u8(payload)
    base = codec & BASE_MASK
    if base == CODEC_RAW:
        if codec & ZSTD:
            return decode_planes(data, dtype, shape, out)
        return _decode_raw(data, dtype, shape, out)
    return decode_fp8(data, codec, dtype, shape, out)
