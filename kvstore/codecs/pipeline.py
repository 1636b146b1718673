"""Per-block codecs: FP8 quantisation with power-of-two scales, and zstd, as pure functions.

This module is standalone: it turns one tensor into ``(codec id, payload bytes)`` and
back, and knows nothing about slots, extents or the index.  A payload is fully
self-describing given what a slot header already stores (codec id, dtype, shape): the
KV layout and the scales travel inside it, so ``decode`` needs nothing else.

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

FP8 payload (ids 0x01, 0x02, 0x11, 0x12)
========================================

All integers little-endian.

======  ======  =====  ===========  ==================================================
offset  size    type   field        meaning
======  ======  =====  ===========  ==================================================
0       1       u8     version      1
1       1       u8     flags        bit 0: the codes may contain NaN/Inf codes (the
                                    decoder then runs its special-value pass); set
                                    exactly when the block holds a NaN or an infinity;
                                    clear, a NaN/Inf code makes the payload corrupt
                                    (no encoder writes one); other bits 0
2       1       u8     gran_k       scale granularity of the K part (table below)
3       1       u8     gran_v       granularity of the V part (= gran_k when there is
                                    no kv axis)
4       1       u8     kv_axis      axis indexing K (0) / V (1); 0xFF: none
5       1       u8     token_axis   0xFF: no layout (then head_axis is 0xFF too)
6       1       u8     head_axis    0xFF: no layout
7       1       u8     reserved     0
8       4       u32    n_scales     number of scale bytes that follow
12      n       i8[n]  scales       scale exponents ``k``: K part's groups in C order,
                                    then V part's groups
12+n    rest    u8[]   codes        one FP8 code per element, C order (ids 0x01/0x02);
                                    for ids 0x11/0x12 one zstd frame (level 1) whose
                                    content is exactly those ``numel`` bytes
======  ======  =====  ===========  ==================================================

The last axis is always ``head_dim``.  Granularity codes: 0 ``token_head`` (one scale
per vector along the last axis, i.e. per (token, head) and per value of every other
axis such as a layer axis), 1 ``head`` (also shared along ``token_axis``), 2 ``token``
(also shared along ``head_axis``), 3 ``tensor`` (one scale per part).  Without a layout,
0-2 all mean one scale per vector along the last axis.  For a part, the group shape is
the block shape without the last axis, with 1 at ``kv_axis`` and at the shared axes.

Quantisation (the exact algorithm; GPU kernels must reproduce these bits)
-------------------------------------------------------------------------

Let the FP8 format's largest finite value be ``1.75 * 2**EMAX8`` (EMAX8 = 8 for E4M3:
448, 15 for E5M2: 57344).  For each group:

1. ``amax`` = the largest ``|x|`` over the group's *finite* elements (NaN and ±Inf are
   ignored); ``0`` when there are none.
2. If ``amax == 0``: ``k = 0``.  Otherwise write ``amax = M * 2**E`` with ``M`` in
   [1, 2) (exact, from the bits; subnormal inputs included) and set
   ``k = EMAX8 - E - (1 if M > 1.75 else 0)``, the largest ``k`` with
   ``amax * 2**k <= 1.75 * 2**EMAX8``.
3. Clamp ``k`` to [-15, 15] for float16 inputs, [-126, 126] for bfloat16/float32, so
   that ``2**k`` and ``2**-k`` are representable in every type the codec multiplies in.
   (Only groups with tiny ``amax`` are clamped; they just use less of the FP8 range.)
4. ``y = float32(x) * 2**k`` — exact, because ``2**k`` is a power of two and no finite
   result that matters leaves float32's normal range — then ``code = fp8(y)`` with
   IEEE round-to-nearest-even: this is bit-identical to
   ``(x.float() * 2.0**k).to(torch.float8_e4m3fn)`` (or ``float8_e5m2``) in torch 2.13.
   Special values follow that reference: E4M3FN has no infinity and torch *saturates*
   ±Inf to ±448 (code 0x7E/0xFE); ±Inf stays ±Inf in E5M2 (0x7C/0xFC); every NaN,
   whatever its sign and payload, becomes code 0x7F (a NaN in both formats; torch's
   paths disagree on NaN signs, so the sign is fixed here); ``-0.0`` keeps its sign.  Finite inputs never overflow, since
   ``|y| <= 1.75 * 2**EMAX8`` by construction, so the saturation mode never matters
   for them.

Dequantisation: ``x' = dtype(float32(fp8 value) * 2**-k)``, one round-to-nearest-even
into the output dtype (exact for float32; for float16/bfloat16 it can only round
results that are subnormal in the output type).  NaN codes decode to the output type's
canonical quiet NaN, whatever the code's sign: float32 ``0x7FC00000``, bfloat16 ``0x7FC0``,
float16 ``0x7E00``.

How it is made fast (CPU)
-------------------------

Pure ``tensor.to(float8)`` runs at ~1 GB/s here, slower than the disk.  When the
install could compile them, C row kernels (``kvstore/_native/fp8.c``, bound by
:mod:`kvstore.codecs.fp8_kernels`; AVX2 and baseline builds picked at load time) do the
element-wise work in one pass each -- integer amax, then multiply-and-round, or
table-lookup-multiply-and-round for decode -- and release the GIL.  Python keeps only
the per-group scale logic, on arrays ``head_dim`` times smaller.  Otherwise, or with
``KVSTORE_NATIVE_CODECS=0``, a NumPy/torch path produces the same bits:

* encode: ``y`` is computed in the input dtype (float16/bfloat16).  That is exact for
  a power-of-two scale except where ``y`` lands below the type's normal range: in
  bfloat16 that is far below the smallest FP8 value; in float16 it can happen only for
  E4M3 (E5M2 gets ``k >= 0`` from float16 inputs, so nothing rounds), and a float16
  value below 2**-14 rounds to E4M3 zero whether it was rounded before or not.  The
  code is then a lookup in a 65536-entry table indexed by ``y``'s 16-bit pattern, the
  table being built from torch's own conversion of every pattern.  float32 inputs are
  reduced to a 16-bit key by *rounding to odd*: the top 16 bits of ``y`` (a bfloat16
  pattern with 7 fraction bits) with the lowest bit OR-ed with "any of the low 16 bits
  set"; with at least 2 extra bits, rounding-to-odd followed by RNE equals a single RNE,
  so the bfloat16 table gives the exact result.
* decode: an FP8 code becomes float16 *bits* with two integer operations -- E5M2 is
  float16's top byte (``code << 8``), and for E4M3 ``((int8)code << 7) & 0xBF80`` is a
  float16 whose value is exactly ``value * 2**-8`` (E4M3 subnormals land on float16
  subnormals, the exponents line up) -- followed by one multiply by ``2**(8 - k)`` per
  vector.  NaN codes are patched afterwards, only when ``flags`` bit 0 says there are
  any.

Raw + zstd payload (id 0x10)
============================

Float KV bytes barely compress as they are (~9% for float16), but their sign/exponent
bytes do: the payload stores byte planes (plane ``i`` holds byte ``i``, little-endian,
of every element), each zstd-compressed (level 1) or stored.

======  ======  =====  ===========  ==================================================
offset  size    type   field        meaning
======  ======  =====  ===========  ==================================================
0       1       u8     version      1
1       1       u8     n_planes     element size in bytes (1, 2, 4 or 8)
2       2       u16    reserved     0
4       8*p     ...    plane table  per plane: u8 method (0 stored, 1 zstd frame),
                                    3 reserved zero bytes, u32 length in payload
4+8*p   rest    u8[]   planes       the planes, in order; a stored plane is ``numel``
                                    bytes, a zstd frame decompresses to ``numel`` bytes
======  ======  =====  ===========  ==================================================

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

import functools
import math
import struct
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from kvstore.codecs import fp8_kernels, result_buffers
from kvstore.codecs.tensors import check_out_tensor
from kvstore.errors import CorruptionError

__all__ = [
    "CODEC_RAW",
    "FP8_E4M3",
    "FP8_E5M2",
    "ZSTD",
    "KVLayout",
    "CodecSpec",
    "codec_id",
    "Encoded",
    "prepare",
    "encode",
    "decode",
]

CODEC_RAW = 0
FP8_E4M3 = 1
FP8_E5M2 = 2
ZSTD = 0x10
_BASE_MASK = 0x0F
_KNOWN_IDS = frozenset({CODEC_RAW, FP8_E4M3, FP8_E5M2, CODEC_RAW | ZSTD,
                        FP8_E4M3 | ZSTD, FP8_E5M2 | ZSTD})

ZSTD_LEVEL = 1
"""zstd level of the zstd stage (level 3 gains nothing on KV data, at half the speed)."""

Payload = bytes | bytearray | memoryview | npt.NDArray[np.uint8]
U8 = npt.NDArray[np.uint8]

GRANULARITIES: tuple[str, ...] = ("token_head", "head", "token", "tensor")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NO_AXIS = 0xFF


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
    return codec in _KNOWN_IDS


def is_lossless(codec: int) -> bool:
    """Whether a block written with ``codec`` reads back as the exact bytes put."""
    return codec & _BASE_MASK == CODEC_RAW


def codec_id(spec: CodecSpec) -> int:
    """The codec id ``spec`` asks for (``encode`` may fall back to a simpler one)."""
    base = {None: CODEC_RAW, "e4m3": FP8_E4M3, "e5m2": FP8_E5M2}[spec.fp8]
    return base | (ZSTD if spec.zstd else 0)


# --------------------------------------------------------------------------- FP8 formats


@dataclass(frozen=True)
class _Fp8:
    torch_dtype: torch.dtype
    emax: int        # largest finite value is 1.75 * 2**emax
    special: int     # code & special == special marks NaN (E4M3) / Inf-NaN (E5M2)
    off: int         # decode bit trick yields value * 2**-off as float16
    nan_min: int     # (code & 0x7F) > nan_min marks a NaN code
    finite_max: int  # largest code & 0x7F of a finite value (every larger one is special)


_FORMATS = {
    FP8_E4M3: _Fp8(torch.float8_e4m3fn, 8, 0x7F, 8, 0x7E, 0x7E),
    FP8_E5M2: _Fp8(torch.float8_e5m2, 15, 0x7C, 0, 0x7C, 0x7B),
}

# What a NaN code decodes to: the output type's canonical quiet NaN, positive.
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
_CANONICAL_NAN = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000}

# The compiled row kernels (kvstore/_native/fp8.c) when they are built: same bits as the
# NumPy/torch path below, which stays as the fallback and the reference for tests.
_NATIVE = fp8_kernels.available()

# k range per input dtype (see step 3 of the algorithm), and the lossless threshold.
_K_RANGE = {torch.float16: (-15, 15), torch.bfloat16: (-126, 126), torch.float32: (-126, 126)}
_EMAX_DTYPE = {torch.float16: 15, torch.bfloat16: 127, torch.float32: 127}

_HDR = struct.Struct("<BBBBBBBxI")
_VERSION = 1
_FLAG_SPECIAL = 0x01


@functools.cache
def _encode_lut(src: torch.dtype, base: int) -> U8:
    """65536-entry table: 16-bit float pattern -> FP8 code, from torch's own conversion."""
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(src)
    codes = pats.float().to(_FORMATS[base].torch_dtype).view(torch.uint8)
    # torch's own paths disagree on the sign of NaN (its scalar float16 -> float32
    # conversion makes every NaN +NaN, the vectorised one keeps the sign): fix it to 0x7F.
    codes[torch.isnan(pats)] = 0x7F
    return np.ascontiguousarray(codes.numpy())


@functools.cache
def _decode_values(base: int) -> torch.Tensor:
    """256-entry table: FP8 code -> float32 value (used only for NaN/Inf codes)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(
        _FORMATS[base].torch_dtype).float()


def _pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``2.0**k`` for integer tensor ``k`` in [-126, 127], built from float32 bits."""
    bits = (k.to(torch.int32) + 127) << 23
    return bits.view(torch.float32).to(dtype)


# --------------------------------------------------------------------------- layout helpers


def _norm_axes(layout: KVLayout | None, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Validate ``layout`` against ``shape``; return (kv, token, head) with 0xFF = none."""
    if layout is None:
        return _NO_AXIS, _NO_AXIS, _NO_AXIS
    nd = len(shape)
    axes = []
    for name, ax in (("kv_axis", layout.kv_axis), ("token_axis", layout.token_axis),
                     ("head_axis", layout.head_axis)):
        if ax is None and name == "kv_axis":
            axes.append(_NO_AXIS)
            continue
        if not isinstance(ax, int) or not -nd <= ax < nd:
            raise ValueError(f"layout {name}={ax!r} is out of range for shape {shape}")
        ax %= nd
        if ax == nd - 1:
            raise ValueError(f"layout {name} may not be the last axis (head_dim)")
        axes.append(ax)
    kv, tok, head = axes
    used = [a for a in axes if a != _NO_AXIS]
    if len(set(used)) != len(used):
        raise ValueError(f"layout axes must be distinct, got {layout}")
    if kv != _NO_AXIS and shape[kv] != 2:
        raise ValueError(f"the kv axis must have size 2 (K, V), shape is {shape}")
    return kv, tok, head


def _reduced_dims(gran: int, nd: int, kv: int, tok: int, head: int) -> tuple[int, ...]:
    """Dims (of the block shape without its last axis) that share one scale."""
    if gran == 3:
        return tuple(d for d in range(nd) if d != kv)
    if gran == 1 and tok != _NO_AXIS:
        return (tok,)
    if gran == 2 and head != _NO_AXIS:
        return (head,)
    return ()


def _parts(rows: tuple[int, ...], kv: int) -> list[tuple[int, tuple[int, ...]]]:
    """(part index, part shape) for the K part (and V part) of the per-row shape."""
    if kv == _NO_AXIS:
        return [(0, rows)]
    part = rows[:kv] + (1,) + rows[kv + 1:]
    return [(0, part), (1, part)]


def _group_shape(part: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d in dims else n for d, n in enumerate(part))


# --------------------------------------------------------------------------- encode


def _as_bytes_u8(t: torch.Tensor) -> U8:
    """Zero-copy flat uint8 numpy view of a contiguous CPU tensor's bytes."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _exponents(amax: npt.NDArray[np.float32], fmt: _Fp8, dtype: torch.dtype) -> npt.NDArray[np.int8]:
    """Step 2-3 of the algorithm: per-group scale exponents ``k`` from float32 amax.

    NumPy rather than torch on these small per-group arrays: a torch op costs ~10 us of
    dispatch, which was most of a small block's encode time."""
    m, e = np.frexp(amax)             # amax = m * 2**e, m in [0.5, 1): E = e - 1, M = 2m
    k = np.where(amax == 0, 0, (fmt.emax + 1) - e.astype(np.int32) - (m > 0.875))
    lo, hi = _K_RANGE[dtype]
    # minimum/maximum, not np.clip: its Python-level dispatch cost more than the work
    return np.minimum(np.maximum(k, lo), hi).astype(np.int8)


def _fp8_head(x: torch.Tensor, base: int,
              spec: CodecSpec) -> tuple[U8, npt.NDArray[np.int8]] | None:
    """Steps 1-3 for a contiguous float16/bfloat16/float32 tensor with ndim >= 1 and
    numel > 0: the payload's header and scales, and every vector's exponent (shape
    ``x.shape[:-1]``); or None when the block must be stored losslessly instead."""
    fmt = _FORMATS[base]
    (kv, tok, head), grans, plan = _scale_plan(tuple(x.shape), spec)

    if _NATIVE:
        amax, special = fp8_kernels.row_amax(x)
    else:
        # Per-vector amax.  The plain abs().amax() is the fast path; NaN/Inf poison it,
        # and then (rarely) the finite-only amax is recomputed with a mask.
        amax = x.abs().amax(dim=-1)
        special = not bool(torch.isfinite(amax).all())
        if special:
            amax = torch.where(torch.isfinite(x), x.abs(),
                               torch.zeros((), dtype=x.dtype)).amax(-1)
        amax = amax.float()
    amax_np = amax.numpy()
    if float(amax_np.max()) >= 2.0 ** _EMAX_DTYPE[x.dtype]:
        return None

    group_amax = []
    for p, _part, dims in plan:
        a = amax_np if kv == _NO_AXIS else amax_np[(slice(None),) * kv + (slice(p, p + 1),)]
        group_amax.append((a.max(axis=dims, keepdims=True) if dims else a).reshape(-1))
    scales = _exponents(group_amax[0] if len(group_amax) == 1 else
                        np.concatenate(group_amax), fmt, x.dtype)
    # asarray: a 1-d block's index is 0-d, and indexing with it gives a NumPy scalar
    k_rows = np.asarray(scales[_row_scale_index(tuple(x.shape[:-1]), kv, plan)])

    n = scales.size
    out = np.empty(_HDR.size + n, dtype=np.uint8)
    _HDR.pack_into(out.data, 0, _VERSION, _FLAG_SPECIAL if special else 0, grans[0], grans[1],
                   kv, tok, head, n)
    out[_HDR.size:] = scales.view(np.uint8)
    return out, k_rows


def _fp8_codes(x: torch.Tensor, base: int, k_rows: npt.NDArray[np.int8], codes: U8,
               special: bool) -> None:
    """Step 4: ``codes[:] = fp8(float32(x) * 2**k)``, one exponent per vector."""
    if _NATIVE:
        fp8_kernels.encode_rows(x, k_rows.reshape(-1), base, codes, finite=not special)
        return
    k = torch.from_numpy(k_rows.astype(np.int32)).unsqueeze(-1)
    y = x * _pow2(k, x.dtype)                      # exact where it matters (module docstring)
    if x.dtype == torch.float32:
        # Round to odd into a bfloat16 pattern: top 16 bits, sticky bit from the low 16.
        bits = y.view(torch.int32)
        key = (bits >> 16) & 0xFFFF
        key |= (bits & 0xFFFF) != 0
        np.take(_encode_lut(torch.bfloat16, base), key.reshape(-1).numpy(), out=codes,
                mode="clip")
    else:
        idx = y.view(torch.int16).reshape(-1).numpy().view(np.uint16)
        # mode="clip": indices are < 65536 by type; "raise" would buffer `out`.
        np.take(_encode_lut(x.dtype, base), idx, out=codes, mode="clip")


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
        special = bool(self._head[1] & _FLAG_SPECIAL)
        _fp8_codes(self._x, self.codec & _BASE_MASK, self._k_rows, dst[h:], special)

    def payload(self) -> U8:
        """The payload as an array (for a raw codec a zero-copy view of the input)."""
        if self._payload is not None:
            return self._payload
        out = np.empty(self.nbytes, dtype=np.uint8)
        self.write_into(out)
        return out


def _encode_planes(raw: U8, itemsize: int) -> U8 | None:
    """Byte-plane + zstd payload, or None when it is not smaller than ``raw``."""
    numel = raw.size // itemsize
    planes: list[tuple[int, bytes | U8]] = []
    cctx = _cctx()
    if itemsize == 1:
        views: list[U8] = [raw]
    else:
        cols = raw.reshape(numel, itemsize)
        views = [np.ascontiguousarray(cols[:, i]) for i in range(itemsize)]
    for v in views:
        c = cctx.compress(v.data)
        planes.append((1, c) if len(c) < numel else (0, v))
    table = 4 + 8 * itemsize
    total = table + sum(len(d) for _, d in planes)
    if total >= raw.size:
        return None
    out = np.empty(total, dtype=np.uint8)
    struct.pack_into("<BBH", out.data, 0, _VERSION, itemsize, 0)
    pos = table
    for i, (method, data) in enumerate(planes):
        struct.pack_into("<BxxxI", out.data, 4 + 8 * i, method, len(data))
        out[pos:pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
        pos += len(data)
    return out


_tls = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    # Compressor objects are not thread-safe; one per thread, reused (creation is not free).
    c = getattr(_tls, "cctx", None)
    if c is None:
        c = _tls.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def _fp8_smaller(n_scales: int, numel: int, itemsize: int) -> bool:
    """Whether an FP8 payload (header, scales, one code per element) is smaller than the
    raw bytes.  Tiny vectors (head_dim 1-2 in 16-bit) make it larger: then FP8 buys
    nothing and the block is stored losslessly."""
    return _HDR.size + n_scales + numel < numel * itemsize


def _zstd_stage(base: int, payload: U8, head: int) -> tuple[int, U8]:
    """An FP8 payload (its first ``head`` bytes are header and scales) with its codes
    zstd-compressed, or as it is when that does not make it smaller."""
    frame = _cctx().compress(payload[head:].data)
    if head + len(frame) < payload.size:
        return base | ZSTD, np.concatenate([payload[:head], np.frombuffer(frame, np.uint8)])
    return base, payload


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
    if want & ZSTD or want & _BASE_MASK == CODEC_RAW or dtype not in _FLOAT_DTYPES \
            or not shape or numel == 0:
        return None
    n_scales = _scale_count(_scale_plan(shape, spec)[2])
    if not _fp8_smaller(n_scales, numel, dtype.itemsize):
        return None
    return _HDR.size + n_scales + numel


# Per part of a block (K, and V where the layout has a kv axis): its index, its shape
# among the vectors, and the dims whose vectors share one scale (``_part_plan``).
Plan = tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


@functools.lru_cache(maxsize=256)
def _row_scale_index(rows: tuple[int, ...], kv: int, plan: Plan) -> npt.NDArray[np.intp]:
    """For every vector of a block (C order), the index of its scale in the payload's
    scale array (each part's group indices broadcast over the part, the parts joined
    along the kv axis): ``k_rows = scales[index]``; the CUDA kernels' row -> group map
    too (``kvstore.cuda.fp8``).  A function of the shape alone, so cached: expanding the
    scales per block was a third of a small block's encode and decode time."""
    ids, start = [], 0
    for _p, part, dims in plan:
        g = _group_shape(part, dims)
        n = int(np.prod(g))
        ids.append(np.arange(start, start + n, dtype=np.intp).reshape(g))
        start += n
    expanded = [np.broadcast_to(i, part) for i, (_p, part, _dims) in zip(ids, plan)]
    index: npt.NDArray[np.intp] = (expanded[0].copy() if kv == _NO_AXIS  # C order
                                   else np.concatenate(expanded, axis=kv)).reshape(rows)
    index.setflags(write=False)  # shared by every caller of the cache
    return index


@functools.lru_cache(maxsize=256)
def _scale_plan(shape: tuple[int, ...], spec: CodecSpec
                ) -> tuple[tuple[int, int, int], tuple[int, int], Plan]:
    """Steps 1-3's structure for a block of ``shape``, from the shape alone: its (kv,
    token, head) axes, the (K, V) granularities the header records, and its
    ``_part_plan``.  Cached: a planned put asks for it when it sizes a slot and again
    when it encodes the block."""
    kv, tok, head = _norm_axes(spec.layout, shape)
    grans = (GRANULARITIES.index(spec.k_granularity), GRANULARITIES.index(spec.v_granularity))
    if kv == _NO_AXIS:
        grans = (grans[0], grans[0])
    return (kv, tok, head), grans, _part_plan(shape, grans, kv, tok, head)


def _part_plan(shape: tuple[int, ...], grans: tuple[int, int], kv: int, tok: int,
               head: int) -> Plan:
    """Per part (K, and V where the layout has a kv axis): its index, its shape among
    the vectors, and the dims whose vectors share one scale.  What the encoder derives
    from a spec and the decoder from a payload header."""
    nd = len(shape) - 1
    return tuple((p, part, _reduced_dims(grans[p], nd, kv, tok, head))
                 for p, part in _parts(tuple(shape[:-1]), kv))


def _scale_count(plan: Plan) -> int:
    return sum(math.prod(_group_shape(part, dims)) for _, part, dims in plan)


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
    if want & _BASE_MASK != CODEC_RAW and t.dtype in _FLOAT_DTYPES and t.dim() >= 1 \
            and t.numel() > 0:
        base = want & _BASE_MASK
        planned = _fp8_head(t, base, spec)
        if planned is not None and _fp8_smaller(planned[0].size - _HDR.size, t.numel(),
                                                t.element_size()):
            lazy = Encoded(base, fp8=(planned[0], t, planned[1]))
            if not spec.zstd:
                return lazy
            return Encoded(*_zstd_stage(base, lazy.payload(), planned[0].size))
    raw = _as_bytes_u8(t)
    if spec.zstd and raw.size > 0:
        planes = _encode_planes(raw, t.element_size())
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


# --------------------------------------------------------------------------- decode


def _payload_u8(payload: Payload) -> U8:
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 1:
            payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        return payload
    return np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)


def _u8_tensor(a: U8) -> torch.Tensor:
    # Payloads are often read-only (bytes); torch warns about that but we never write.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _decompress(frame: U8, size: int) -> U8:
    """Exactly one zstd frame that declares and holds ``size`` bytes, nothing after it."""
    try:
        # The encoder always writes the content size; checking it first bounds the
        # output (libzstd enforces the declared size while decoding).
        declared = zstandard.frame_content_size(frame.data)
        if declared != size:
            raise CorruptionError(f"zstd frame declares {declared} bytes, expected {size}")
        obj = _dctx().decompressobj()
        data = obj.decompress(frame.data)
        complete, trailing = obj.eof, len(obj.unused_data)
    except zstandard.ZstdError as e:
        raise CorruptionError(f"zstd frame does not decode: {e}") from None
    if len(data) != size or not complete or trailing:
        raise CorruptionError(f"bad zstd frame: {len(data)} of {size} bytes, "
                              f"complete={complete}, {trailing} trailing bytes")
    return np.frombuffer(data, dtype=np.uint8)


def _prepare_out(out: torch.Tensor | None, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor to return, contiguous tensor of ``shape`` to write into)."""
    if out is None:
        t = result_buffers.empty(tuple(shape), dtype)
        return t, t
    out = check_out_tensor(out, dtype, tuple(shape))
    if out.device.type == "cpu" and out.is_contiguous():
        return out, out.view(shape)
    return out, torch.empty(shape, dtype=dtype)


def _finish(ret: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    if ret is not work and ret.data_ptr() != work.data_ptr():
        ret.copy_(work.view(ret.shape))
    return ret


def _decode_raw(data: U8, dtype: torch.dtype, shape: tuple[int, ...],
                out: torch.Tensor | None) -> torch.Tensor:
    ret, work = _prepare_out(out, dtype, shape)
    nbytes = work.numel() * work.element_size()
    if data.size != nbytes:
        raise CorruptionError(f"raw payload is {data.size} bytes, the block needs {nbytes}")
    if nbytes:
        _as_bytes_u8(work)[:] = data
    return _finish(ret, work)


def _decode_planes(data: U8, dtype: torch.dtype, shape: tuple[int, ...],
                   out: torch.Tensor | None) -> torch.Tensor:
    ret, work = _prepare_out(out, dtype, shape)
    isz = work.element_size()
    numel = work.numel()
    if data.size < 4:
        raise CorruptionError("zstd payload truncated")
    version, nplanes, reserved = struct.unpack_from("<BBH", data.data, 0)
    if version != _VERSION or reserved or nplanes != isz or numel == 0:
        raise CorruptionError(
            f"bad zstd payload header (version {version}, {nplanes} planes for "
            f"{isz}-byte elements, numel {numel})")
    table = 4 + 8 * nplanes
    if data.size < table:
        raise CorruptionError("zstd payload plane table truncated")
    pos = table
    dst = _as_bytes_u8(work).reshape(numel, isz)
    for i in range(nplanes):
        method, pad0, pad1, pad2, length = struct.unpack_from("<BBBBI", data.data, 4 + 8 * i)
        if method > 1 or pad0 or pad1 or pad2 or length > data.size - pos:
            raise CorruptionError(f"bad zstd payload plane {i} (method {method}, {length} bytes)")
        chunk = data[pos:pos + length]
        pos += length
        if method == 0:
            if length != numel:
                raise CorruptionError(f"stored plane {i} is {length} bytes, expected {numel}")
            plane = chunk
        else:
            plane = _decompress(chunk, numel)
        dst[:, i] = plane
    if pos != data.size:
        raise CorruptionError(f"zstd payload has {data.size - pos} trailing bytes")
    return _finish(ret, work)


@dataclass(frozen=True)
class Fp8Payload:
    """An FP8 payload whose header, scales and codes passed every check: what
    :func:`parse_fp8_payload` returns to the CPU decoder and to the GPU kernels' host side
    (``kvstore.cuda.fp8``), so both refuse exactly the same payloads."""

    flags: int
    granularities: tuple[int, int]
    axes: tuple[int, int, int]          # kv, token, head (_NO_AXIS where absent)
    plan: Plan                          # per part: index, shape, dims sharing a scale
    scales: npt.NDArray[np.int8]
    codes: U8


def parse_fp8_payload(codec: int, payload: Payload, dtype: torch.dtype,
                      shape: tuple[int, ...]) -> Fp8Payload:
    """Check an FP8 payload of codec id ``codec`` against the block's dtype and shape
    (module docstring, "FP8 payload"); any inconsistency is a CorruptionError.

    The one parser of the format: the CPU decoder and the GPU kernels' host side (and so
    their CPU twin) decode only what it returns, so they refuse the same payloads, and
    what they decode holds no code their element loops could read differently (a NaN/Inf
    code where ``flags`` promises none: the CPU's fast loop would read it as a number).
    """
    if codec not in _KNOWN_IDS or codec & _BASE_MASK not in _FORMATS:
        raise CorruptionError(f"codec id {codec:#x} is not an fp8 codec")
    if dtype not in _FLOAT_DTYPES:
        raise CorruptionError(f"an fp8 block cannot decode to {dtype}")
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) == 0 or numel <= 0 or min(shape) < 0:
        raise CorruptionError(f"an fp8 block cannot have shape {tuple(shape)}")
    data = _payload_u8(payload)
    if data.size < _HDR.size:
        raise CorruptionError(f"fp8 payload truncated: {data.size} bytes")
    version, flags, gk, gv, kv, tok, head, n = _HDR.unpack_from(data.data, 0)
    if version != _VERSION or flags & ~_FLAG_SPECIAL or gk > 3 or gv > 3:
        raise CorruptionError(f"bad fp8 payload header (version {version}, flags {flags:#x}, "
                              f"granularities {gk}/{gv})")
    plan, want_n = _payload_geometry(tuple(shape), gk, gv, kv, tok, head)
    if n != want_n or data.size < _HDR.size + n:
        raise CorruptionError(f"fp8 payload has {n} scales, the shape needs {want_n}")
    k_all = data[_HDR.size:_HDR.size + n].view(np.int8)
    lo, hi = _K_RANGE[dtype]
    if n and (int(k_all.min()) < lo or int(k_all.max()) > hi):
        raise CorruptionError(f"fp8 scale exponent out of range [{lo}, {hi}]")
    rest = data[_HDR.size + n:]
    if codec & ZSTD:
        codes_np = _decompress(rest, numel)
    elif rest.size != numel:
        raise CorruptionError(f"fp8 payload has {rest.size} code bytes, the block needs {numel}")
    else:
        codes_np = rest
    if not flags & _FLAG_SPECIAL and _has_special_code(codes_np, _FORMATS[codec & _BASE_MASK]):
        raise CorruptionError("fp8 payload holds a NaN/Inf code but its flags say it has none")
    return Fp8Payload(flags, (gk, gv), (kv, tok, head), plan, k_all, codes_np)


def _has_special_code(codes: U8, fmt: _Fp8) -> bool:
    """Whether any code is NaN/Inf: a positive code above ``finite_max`` or a negative one
    above ``0x80 | finite_max``.  Two max reductions, no temporaries: 2.5 us for 32 Ki
    codes, 9 us for 512 Ki here, 12% and 5% of the compiled decode of those blocks.  A
    mask and ``any()`` cost 3-4 times as much, a C pass over the codes (ctypes) as much,
    and an OR folded into the compiled fast decode loop slowed that loop by 5-23%."""
    return int(codes.view(np.int8).max()) > fmt.finite_max or \
        int(codes.max()) > 0x80 | fmt.finite_max


@functools.lru_cache(maxsize=256)
def _payload_geometry(shape: tuple[int, ...], gk: int, gv: int, kv: int, tok: int, head: int
                      ) -> tuple[Plan, int]:
    """The checks of an FP8 payload's header fields against the block's shape, and its
    ``_part_plan`` and scale count: functions of the header and shape alone, so cached
    (they were a third of a small block's decode time).  Raises CorruptionError (not
    cached) for a header that does not fit the shape."""
    layout: KVLayout | None = None
    if tok != _NO_AXIS or head != _NO_AXIS:
        layout = KVLayout(None if kv == _NO_AXIS else kv, tok, head)
    elif kv != _NO_AXIS:
        raise CorruptionError("fp8 payload has a kv axis but no token/head axes")
    if layout is not None:
        try:
            if max(a for a in (kv, tok, head) if a != _NO_AXIS) >= len(shape) - 1:
                raise ValueError("axis out of range")
            _norm_axes(layout, shape)
        except ValueError as e:
            raise CorruptionError(f"fp8 payload layout does not fit shape {shape}: {e}") from None
    if kv == _NO_AXIS and gv != gk:
        raise CorruptionError("fp8 payload without kv axis has two granularities")
    plan = _part_plan(shape, (gk, gv), kv, tok, head)
    return plan, _scale_count(plan)


def _decode_fp8(data: U8, codec: int, dtype: torch.dtype, shape: tuple[int, ...],
                out: torch.Tensor | None) -> torch.Tensor:
    base = codec & _BASE_MASK
    fmt = _FORMATS[base]
    parsed = parse_fp8_payload(codec, data, dtype, shape)
    flags, kv = parsed.flags, parsed.axes[0]
    k_all, codes_np = parsed.scales, parsed.codes
    k_np = np.asarray(k_all[_row_scale_index(tuple(shape[:-1]), kv, parsed.plan)])

    ret, work = _prepare_out(out, dtype, shape)
    if _NATIVE:
        fp8_kernels.decode_rows(np.ascontiguousarray(codes_np), k_np.reshape(-1), base, work,
                                finite=not flags & _FLAG_SPECIAL)
        return _finish(ret, work)
    k_rows = torch.from_numpy(k_np.astype(np.int32))
    codes = _u8_tensor(codes_np).view(shape)
    # FP8 code -> float16 bits holding value * 2**-off (module docstring, "decode").
    bits = codes.view(torch.int8).to(torch.int16)
    if base == FP8_E4M3:
        bits <<= 7
        bits &= -0x4080                       # 0xBF80 as int16: sign + 7 exponent/fraction bits
    else:
        bits <<= 8
    v16 = bits.view(torch.float16)
    # One multiply by 2**(off - k) when that is a normal number of the multiply's type,
    # else two (2**off, then 2**-k), both exact up to the final rounding.
    sdtype = torch.float16 if dtype == torch.float16 else torch.float32
    smax = 15 if sdtype == torch.float16 else 127
    smin = -24 if sdtype == torch.float16 else -126   # float16 subnormals convert exactly
    kmin, kmax = (int(k_rows.min()), int(k_rows.max()))
    k_rows = k_rows.unsqueeze(-1)
    if fmt.off - kmin <= smax and fmt.off - kmax >= smin:
        torch.mul(v16, _pow2(fmt.off - k_rows, sdtype), out=work)
    else:
        tmp = v16.float() * float(2 ** fmt.off)
        torch.mul(tmp, _pow2(-k_rows, torch.float32), out=work)
    if flags & _FLAG_SPECIAL:
        flat_codes = codes.reshape(-1)
        mask = (flat_codes & fmt.special) == fmt.special
        if bool(mask.any()):
            vals = _decode_values(base)[flat_codes[mask].to(torch.int64)]
            flat = work.view(-1)
            flat[mask] = vals.to(dtype)
            # NaN codes decode to the canonical quiet NaN (bits fixed, see docstring).
            nan = mask & ((flat_codes & 0x7F) > fmt.nan_min)
            flat.view(_INT_VIEW[dtype])[nan] = _CANONICAL_NAN[dtype]
    return _finish(ret, work)


def decode(codec: int, payload: Payload, dtype: torch.dtype, shape: tuple[int, ...],
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a payload written by :func:`encode` (inputs: what a slot header stores).

    Returns a CPU tensor of ``dtype`` and ``shape``; with ``out``, writes into it and
    returns it (same dtype and number of elements required, else
    :class:`~kvstore.errors.OutputMismatchError`).  A payload that does not parse
    raises :class:`~kvstore.errors.CorruptionError`.
    """
    shape = tuple(int(d) for d in shape)
    if codec not in _KNOWN_IDS:
        raise CorruptionError(f"unknown codec id {codec:#x}")
    if any(d < 0 for d in shape):
        raise CorruptionError(f"negative dimension in shape {shape}")
    data = _payload_u8(payload)
    base = codec & _BASE_MASK
    if base == CODEC_RAW:
        if codec & ZSTD:
            return _decode_planes(data, dtype, shape, out)
        return _decode_raw(data, dtype, shape, out)
    return _decode_fp8(data, codec, dtype, shape, out)
