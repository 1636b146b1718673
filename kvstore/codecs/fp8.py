"""FP8 quantisation with power-of-two scales: the formats, the scale plans and the
encoder (its payload parsed and decoded by :mod:`kvstore.codecs.fp8_payload`).

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
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvstore.codecs import fp8_kernels
from kvstore.codecs.spec import FP8_E4M3, FP8_E5M2, GRANULARITIES, NO_AXIS, U8, CodecSpec, KVLayout

__all__ = ["CANONICAL_NAN", "FLAG_SPECIAL", "FORMATS", "FP8_HEADER",
           "Fp8", "INT_VIEW", "K_RANGE", "NATIVE", "PAYLOAD_VERSION", "Plan",
           "decode_values", "fp8_codes", "fp8_head",
           "fp8_smaller", "norm_axes", "part_plan", "pow2", "row_scale_index",
           "scale_count", "scale_plan"]

# --------------------------------------------------------------------------- FP8 formats


@dataclass(frozen=True)
class Fp8:
    torch_dtype: torch.dtype
    emax: int        # largest finite value is 1.75 * 2**emax
    special: int     # code & special == special marks NaN (E4M3) / Inf-NaN (E5M2)
    off: int         # decode bit trick yields value * 2**-off as float16
    nan_min: int     # (code & 0x7F) > nan_min marks a NaN code
    finite_max: int  # largest code & 0x7F of a finite value (every larger one is special)


FORMATS = {
    FP8_E4M3: Fp8(torch.float8_e4m3fn, 8, 0x7F, 8, 0x7E, 0x7E),
    FP8_E5M2: Fp8(torch.float8_e5m2, 15, 0x7C, 0, 0x7C, 0x7B),
}

# What a NaN code decodes to: the output type's canonical quiet NaN, positive.
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
CANONICAL_NAN = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000}

# The compiled row kernels (kvstore/_native/fp8.c) when they are built: same bits as the
# NumPy/torch path below, which stays as the fallback and the reference for tests.
NATIVE = fp8_kernels.available()

# k range per input dtype (see step 3 of the algorithm), and the lossless threshold.
K_RANGE = {torch.float16: (-15, 15), torch.bfloat16: (-126, 126), torch.float32: (-126, 126)}
_EMAX_DTYPE = {torch.float16: 15, torch.bfloat16: 127, torch.float32: 127}

FP8_HEADER = struct.Struct("<BBBBBBBxI")
PAYLOAD_VERSION = 1
FLAG_SPECIAL = 0x01


@functools.cache
def _encode_lut(src: torch.dtype, base: int) -> U8:
    """65536-entry table: 16-bit float pattern -> FP8 code, from torch's own conversion."""
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(src)
    codes = pats.float().to(FORMATS[base].torch_dtype).view(torch.uint8)
    # torch's own paths disagree on the sign of NaN (its scalar float16 -> float32
    # conversion makes every NaN +NaN, the vectorised one keeps the sign): fix it to 0x7F.
    codes[torch.isnan(pats)] = 0x7F
    return np.ascontiguousarray(codes.numpy())


@functools.cache
def decode_values(base: int) -> torch.Tensor:
    """256-entry table: FP8 code -> float32 value (used only for NaN/Inf codes)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(
        FORMATS[base].torch_dtype).float()


def pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``2.0**k`` for integer tensor ``k`` in [-126, 127], built from float32 bits."""
    bits = (k.to(torch.int32) + 127) << 23
    return bits.view(torch.float32).to(dtype)


# --------------------------------------------------------------------------- layout helpers


def norm_axes(layout: KVLayout | None, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Validate ``layout`` against ``shape``; return (kv, token, head) with 0xFF = none."""
    if layout is None:
        return NO_AXIS, NO_AXIS, NO_AXIS
    nd = len(shape)
    axes = []
    for name, ax in (("kv_axis", layout.kv_axis), ("token_axis", layout.token_axis),
                     ("head_axis", layout.head_axis)):
        if ax is None and name == "kv_axis":
            axes.append(NO_AXIS)
            continue
        if not isinstance(ax, int) or not -nd <= ax < nd:
            raise ValueError(f"layout {name}={ax!r} is out of range for shape {shape}")
        ax %= nd
        if ax == nd - 1:
            raise ValueError(f"layout {name} may not be the last axis (head_dim)")
        axes.append(ax)
    kv, tok, head = axes
    used = [a for a in axes if a != NO_AXIS]
    if len(set(used)) != len(used):
        raise ValueError(f"layout axes must be distinct, got {layout}")
    if kv != NO_AXIS and shape[kv] != 2:
        raise ValueError(f"the kv axis must have size 2 (K, V), shape is {shape}")
    return kv, tok, head


def _reduced_dims(gran: int, nd: int, kv: int, tok: int, head: int) -> tuple[int, ...]:
    """Dims (of the block shape without its last axis) that share one scale."""
    if gran == 3:
        return tuple(d for d in range(nd) if d != kv)
    if gran == 1 and tok != NO_AXIS:
        return (tok,)
    if gran == 2 and head != NO_AXIS:
        return (head,)
    return ()


def _parts(rows: tuple[int, ...], kv: int) -> list[tuple[int, tuple[int, ...]]]:
    """(part index, part shape) for the K part (and V part) of the per-row shape."""
    if kv == NO_AXIS:
        return [(0, rows)]
    part = rows[:kv] + (1,) + rows[kv + 1:]
    return [(0, part), (1, part)]


def _group_shape(part: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d in dims else n for d, n in enumerate(part))


def _exponents(amax: npt.NDArray[np.float32], fmt: Fp8, dtype: torch.dtype) -> npt.NDArray[np.int8]:
    """Step 2-3 of the algorithm: per-group scale exponents ``k`` from float32 amax.

    NumPy rather than torch on these small per-group arrays: a torch op costs ~10 us of
    dispatch, which was most of a small block's encode time."""
    m, e = np.frexp(amax)             # amax = m * 2**e, m in [0.5, 1): E = e - 1, M = 2m
    k = np.where(amax == 0, 0, (fmt.emax + 1) - e.astype(np.int32) - (m > 0.875))
    lo, hi = K_RANGE[dtype]
    # minimum/maximum, not np.clip: its Python-level dispatch cost more than the work
    return np.minimum(np.maximum(k, lo), hi).astype(np.int8)


def fp8_head(x: torch.Tensor, base: int,
              spec: CodecSpec) -> tuple[U8, npt.NDArray[np.int8]] | None:
    """Steps 1-3 for a contiguous float16/bfloat16/float32 tensor with ndim >= 1 and
    numel > 0: the payload's header and scales, and every vector's exponent (shape
    ``x.shape[:-1]``); or None when the block must be stored losslessly instead."""
    fmt = FORMATS[base]
    (kv, tok, head), grans, plan = scale_plan(tuple(x.shape), spec)

    if NATIVE:
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
        a = amax_np if kv == NO_AXIS else amax_np[(slice(None),) * kv + (slice(p, p + 1),)]
        group_amax.append((a.max(axis=dims, keepdims=True) if dims else a).reshape(-1))
    scales = _exponents(group_amax[0] if len(group_amax) == 1 else
                        np.concatenate(group_amax), fmt, x.dtype)
    # asarray: a 1-d block's index is 0-d, and indexing with it gives a NumPy scalar
    k_rows = np.asarray(scales[row_scale_index(tuple(x.shape[:-1]), kv, plan)])

    n = scales.size
    out = np.empty(FP8_HEADER.size + n, dtype=np.uint8)
    FP8_HEADER.pack_into(out.data, 0, PAYLOAD_VERSION, FLAG_SPECIAL if special else 0, grans[0], grans[1],
                   kv, tok, head, n)
    out[FP8_HEADER.size:] = scales.view(np.uint8)
    return out, k_rows


def fp8_codes(x: torch.Tensor, base: int, k_rows: npt.NDArray[np.int8], codes: U8,
               special: bool) -> None:
    """Step 4: ``codes[:] = fp8(float32(x) * 2**k)``, one exponent per vector."""
    if NATIVE:
        fp8_kernels.encode_rows(x, k_rows.reshape(-1), base, codes, finite=not special)
        return
    k = torch.from_numpy(k_rows.astype(np.int32)).unsqueeze(-1)
    y = x * pow2(k, x.dtype)                      # exact where it matters (module docstring)
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


def fp8_smaller(n_scales: int, numel: int, itemsize: int) -> bool:
    """Whether an FP8 payload (header, scales, one code per element) is smaller than the
    raw bytes.  Tiny vectors (head_dim 1-2 in 16-bit) make it larger: then FP8 buys
    nothing and the block is stored losslessly."""
    return FP8_HEADER.size + n_scales + numel < numel * itemsize


# Per part of a block (K, and V where the layout has a kv axis): its index, its shape
# among the vectors, and the dims whose vectors share one scale (``part_plan``).
Plan = tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


@functools.lru_cache(maxsize=256)
def row_scale_index(rows: tuple[int, ...], kv: int, plan: Plan) -> npt.NDArray[np.intp]:
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
    index: npt.NDArray[np.intp] = (expanded[0].copy() if kv == NO_AXIS  # C order
                                   else np.concatenate(expanded, axis=kv)).reshape(rows)
    index.setflags(write=False)  # shared by every caller of the cache
    return index


@functools.lru_cache(maxsize=256)
def scale_plan(shape: tuple[int, ...], spec: CodecSpec
                ) -> tuple[tuple[int, int, int], tuple[int, int], Plan]:
    """Steps 1-3's structure for a block of ``shape``, from the shape alone: its (kv,
    token, head) axes, the (K, V) granularities the header records, and its
    ``part_plan``.  Cached: a planned put asks for it when it sizes a slot and again
    when it encodes the block."""
    kv, tok, head = norm_axes(spec.layout, shape)
    grans = (GRANULARITIES.index(spec.k_granularity), GRANULARITIES.index(spec.v_granularity))
    if kv == NO_AXIS:
        grans = (grans[0], grans[0])
    return (kv, tok, head), grans, part_plan(shape, grans, kv, tok, head)


def part_plan(shape: tuple[int, ...], grans: tuple[int, int], kv: int, tok: int,
               head: int) -> Plan:
    """Per part (K, and V where the layout has a kv axis): its index, its shape among
    the vectors, and the dims whose vectors share one scale.  What the encoder derives
    from a spec and the decoder from a payload header."""
    nd = len(shape) - 1
    return tuple((p, part, _reduced_dims(grans[p], nd, kv, tok, head))
                 for p, part in _parts(tuple(shape[:-1]), kv))


def scale_count(plan: Plan) -> int:
    return sum(math.prod(_group_shape(part, dims)) for _, part, dims in plan)
