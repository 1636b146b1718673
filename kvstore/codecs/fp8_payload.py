"""The FP8 payload's one parser (:func:`parse_fp8_payload`) and its CPU decoder.

The format is in :mod:`kvstore.codecs.fp8`.  Every decoder (this module's two paths,
the GPU kernel and its CPU twin) parses with :func:`parse_fp8_payload`: they refuse
the same payloads, raising :class:`~kvstore.errors.CorruptionError` and nothing else,
and decode every other one to the same bits (tests/cuda/test_fp8_decoders_agree.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvstore.codecs import fp8, fp8_kernels
from kvstore.codecs.fp8 import (
    CANONICAL_NAN,
    FLAG_SPECIAL,
    FORMATS,
    FP8_HEADER,
    INT_VIEW,
    K_RANGE,
    PAYLOAD_VERSION,
    Fp8,
    Plan,
    decode_values,
    norm_axes,
    part_plan,
    pow2,
    row_scale_index,
    scale_count,
)
from kvstore.codecs.planes import decompress
from kvstore.codecs.spec import (
    BASE_MASK,
    FLOAT_DTYPES,
    FP8_E4M3,
    KNOWN_IDS,
    NO_AXIS,
    U8,
    ZSTD,
    KVLayout,
    Payload,
    finish,
    payload_u8,
    prepare_out,
    u8_tensor,
)
from kvstore.errors import CorruptionError

__all__ = ["Fp8Payload", "decode_fp8", "parse_fp8_payload"]


@dataclass(frozen=True)
class Fp8Payload:
    """An FP8 payload whose header, scales and codes passed every check: what
    :func:`parse_fp8_payload` returns to the CPU decoder and to the GPU kernels' host side
    (``kvstore.cuda.fp8``), so both refuse exactly the same payloads."""

    flags: int
    granularities: tuple[int, int]
    axes: tuple[int, int, int]          # kv, token, head (NO_AXIS where absent)
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
    if codec not in KNOWN_IDS or codec & BASE_MASK not in FORMATS:
        raise CorruptionError(f"codec id {codec:#x} is not an fp8 codec")
    if dtype not in FLOAT_DTYPES:
        raise CorruptionError(f"an fp8 block cannot decode to {dtype}")
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) == 0 or numel <= 0 or min(shape) < 0:
        raise CorruptionError(f"an fp8 block cannot have shape {tuple(shape)}")
    data = payload_u8(payload)
    if data.size < FP8_HEADER.size:
        raise CorruptionError(f"fp8 payload truncated: {data.size} bytes")
    version, flags, gk, gv, kv, tok, head, n = FP8_HEADER.unpack_from(data.data, 0)
    if version != PAYLOAD_VERSION or flags & ~FLAG_SPECIAL or gk > 3 or gv > 3:
        raise CorruptionError(f"bad fp8 payload header (version {version}, flags {flags:#x}, "
                              f"granularities {gk}/{gv})")
    plan, want_n = _payload_geometry(tuple(shape), gk, gv, kv, tok, head)
    if n != want_n or data.size < FP8_HEADER.size + n:
        raise CorruptionError(f"fp8 payload has {n} scales, the shape needs {want_n}")
    k_all = data[FP8_HEADER.size:FP8_HEADER.size + n].view(np.int8)
    lo, hi = K_RANGE[dtype]
    if n and (int(k_all.min()) < lo or int(k_all.max()) > hi):
        raise CorruptionError(f"fp8 scale exponent out of range [{lo}, {hi}]")
    rest = data[FP8_HEADER.size + n:]
    if codec & ZSTD:
        codes_np = decompress(rest, numel)
    elif rest.size != numel:
        raise CorruptionError(f"fp8 payload has {rest.size} code bytes, the block needs {numel}")
    else:
        codes_np = rest
    if not flags & FLAG_SPECIAL and _has_special_code(codes_np, FORMATS[codec & BASE_MASK]):
        raise CorruptionError("fp8 payload holds a NaN/Inf code but its flags say it has none")
    return Fp8Payload(flags, (gk, gv), (kv, tok, head), plan, k_all, codes_np)


def _has_special_code(codes: U8, fmt: Fp8) -> bool:
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
    ``part_plan`` and scale count: functions of the header and shape alone, so cached
    (they were a third of a small block's decode time).  Raises CorruptionError (not
    cached) for a header that does not fit the shape."""
    layout: KVLayout | None = None
    if tok != NO_AXIS or head != NO_AXIS:
        layout = KVLayout(None if kv == NO_AXIS else kv, tok, head)
    elif kv != NO_AXIS:
        raise CorruptionError("fp8 payload has a kv axis but no token/head axes")
    if layout is not None:
        try:
            if max(a for a in (kv, tok, head) if a != NO_AXIS) >= len(shape) - 1:
                raise ValueError("axis out of range")
            norm_axes(layout, shape)
        except ValueError as e:
            raise CorruptionError(f"fp8 payload layout does not fit shape {shape}: {e}") from None
    if kv == NO_AXIS and gv != gk:
        raise CorruptionError("fp8 payload without kv axis has two granularities")
    plan = part_plan(shape, (gk, gv), kv, tok, head)
    return plan, scale_count(plan)


def decode_fp8(data: U8, codec: int, dtype: torch.dtype, shape: tuple[int, ...],
                out: torch.Tensor | None) -> torch.Tensor:
    base = codec & BASE_MASK
    fmt = FORMATS[base]
    parsed = parse_fp8_payload(codec, data, dtype, shape)
    flags, kv = parsed.flags, parsed.axes[0]
    k_all, codes_np = parsed.scales, parsed.codes
    k_np = np.asarray(k_all[row_scale_index(tuple(shape[:-1]), kv, parsed.plan)])

    ret, work = prepare_out(out, dtype, shape)
    if fp8.NATIVE:
        fp8_kernels.decode_rows(np.ascontiguousarray(codes_np), k_np.reshape(-1), base, work,
                                finite=not flags & FLAG_SPECIAL)
        return finish(ret, work)
    k_rows = torch.from_numpy(k_np.astype(np.int32))
    codes = u8_tensor(codes_np).view(shape)
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
        torch.mul(v16, pow2(fmt.off - k_rows, sdtype), out=work)
    else:
        tmp = v16.float() * float(2 ** fmt.off)
        torch.mul(tmp, pow2(-k_rows, torch.float32), out=work)
    if flags & FLAG_SPECIAL:
        flat_codes = codes.reshape(-1)
        mask = (flat_codes & fmt.special) == fmt.special
        if bool(mask.any()):
            vals = decode_values(base)[flat_codes[mask].to(torch.int64)]
            flat = work.view(-1)
            flat[mask] = vals.to(dtype)
            # NaN codes decode to the canonical quiet NaN (bits fixed, see docstring).
            nan = mask & ((flat_codes & 0x7F) > fmt.nan_min)
            flat.view(INT_VIEW[dtype])[nan] = CANONICAL_NAN[dtype]
    return finish(ret, work)
