"""kvstore.codecs.pipeline: bit-exact FP8 against torch's conversion, lossless round trips,
corruption handling, and attention-output accuracy on real SmolLM2 activations."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore.codecs import fp8 as fp8_codec
from kvstore.codecs import fp8_kernels
from kvstore.codecs.pipeline import (
    CODEC_RAW,
    FP8_E4M3,
    FP8_E5M2,
    GRANULARITIES,
    ZSTD,
    CodecSpec,
    KVLayout,
    codec_id,
    decode,
    encode,
    planned_nbytes,
    prepare,
)
from kvstore.errors import CorruptionError, OutputMismatchError
from tests.realdata import require_kv_dir

FP8 = {"e4m3": (FP8_E4M3, torch.float8_e4m3fn, 8), "e5m2": (FP8_E5M2, torch.float8_e5m2, 15)}
K_RANGE = {torch.float16: (-15, 15), torch.bfloat16: (-126, 126), torch.float32: (-126, 126)}
EMAX_DTYPE = {torch.float16: 15, torch.bfloat16: 127, torch.float32: 127}
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HDR = 12


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN equals any NaN (payload bits are not specified)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    if not torch.equal(nan_a, nan_b):
        return False
    ia = a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1)
    ib = b.reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    keep = ~nan_a.reshape(-1)
    return torch.equal(ia[keep], ib[keep])


def all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)


def payload_parts(p: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    (n,) = struct.unpack_from("<I", p.data, 8)
    k = torch.from_numpy(p[HDR:HDR + n].view(np.int8).astype(np.int32))
    return k, p[HDR + n:]


def reference_k(amax: np.ndarray, emax8: int, dtype: torch.dtype) -> torch.Tensor:
    """Steps 1-3 of the module docstring's algorithm, in numpy float64 (amax: finite)."""
    m, e = np.frexp(amax.astype(np.float64))     # amax = m * 2**e, m in [0.5, 1)
    E, M = e - 1, 2 * m                          # amax = M * 2**E, M in [1, 2)
    k = emax8 - E - (M > 1.75)
    k = np.where(amax == 0, 0, k)
    lo, hi = K_RANGE[dtype]
    return torch.from_numpy(np.clip(k, lo, hi).astype(np.int32))


# --------------------------------------------------------------------------- codec ids


def test_codec_id_bit_layout() -> None:
    assert (CODEC_RAW, FP8_E4M3, FP8_E5M2, ZSTD) == (0, 1, 2, 0x10)
    assert codec_id(CodecSpec()) == 0
    assert codec_id(CodecSpec(zstd=True)) == 0x10
    assert codec_id(CodecSpec(fp8="e4m3")) == 0x01
    assert codec_id(CodecSpec(fp8="e5m2", zstd=True)) == 0x12
    for spec in (CodecSpec(fp8=f, zstd=z) for f in (None, "e4m3", "e5m2") for z in (0, 1)):
        cid = codec_id(spec)
        assert 0 <= cid < 0x20 and cid & 0x0F in (0, 1, 2) and bool(cid & 0x10) == spec.zstd
    with pytest.raises(ValueError):
        CodecSpec(fp8="e3m4")
    with pytest.raises(ValueError):
        CodecSpec(k_granularity="layer")


# --------------------------------------------------------------------------- bit exactness


def anchored_rows(dtype: torch.dtype, emax8: int, ks: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Rows [anchor, x]: the anchor fixes the row's scale exponent k; x runs over every
    16-bit pattern (float16/bfloat16) whose magnitude does not exceed the anchor."""
    pats = all_patterns(dtype)
    mag = pats.float().abs()
    rows, kk = [], []
    for k in ks:
        anchor = 1.875 * 2.0 ** (emax8 - k - 1)      # M = 1.875 > 1.75 -> exactly k
        if anchor >= 2.0 ** EMAX_DTYPE[dtype] or anchor < 2.0 ** -14:
            continue
        xs = pats[(mag <= anchor) | ~torch.isfinite(mag)]
        a = torch.full_like(xs, anchor)
        rows.append(torch.stack([a, xs], dim=1))
        kk += [k] * xs.numel()
    return torch.cat(rows), kk


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_bit_exact_all_16bit_patterns(fmt: str, dtype: torch.dtype) -> None:
    base, f8, emax8 = FP8[fmt]
    lo, hi = K_RANGE[dtype]
    ks = list(range(lo, hi + 1)) if dtype == torch.float16 else \
        sorted(set(range(lo, hi + 1, 15)) | {-119, -112, -1, 0, 1, 7, 8, 15, 126})
    x, want_k = anchored_rows(dtype, emax8, ks)
    # plus every pattern in natural order, 64 per row, so the rows' own amax picks k
    x2 = all_patterns(dtype).reshape(-1, 64)
    for block, expect in ((x, want_k), (x2, None)):
        block = block.contiguous()
        cid, p = encode(block, CodecSpec(fp8=fmt))
        if expect is None and cid == CODEC_RAW:
            # rows holding |x| >= 2**EMAX(dtype) force the lossless fallback: check it, then
            # drop those rows and try again
            big = block.float().abs()
            big = torch.where(torch.isfinite(big), big, 0).amax(1) >= 2.0 ** EMAX_DTYPE[dtype]
            assert bool(big.any())
            block = block[~big].contiguous()
            cid, p = encode(block, CodecSpec(fp8=fmt))
        assert cid == base
        k, codes = payload_parts(p)
        fin = torch.where(torch.isfinite(block.float()), block.float().abs(), 0)
        ref_k = reference_k(fin.amax(1).numpy(), emax8, dtype)
        assert torch.equal(k, ref_k)
        if expect is not None:
            assert torch.equal(k, torch.tensor(expect, dtype=torch.int32))
        scale = torch.pow(2.0, k.double()).float().unsqueeze(1)
        ref = (block.float() * scale).to(f8)
        got = torch.from_numpy(codes.copy()).view(f8).reshape(block.shape)
        assert bits_equal(got, ref)                   # NaN: any NaN code in the reference
        assert bool((got.view(torch.uint8)[torch.isnan(block)] == 0x7F).all())
        # decode: dtype(float32(fp8) * 2**-k), one rounding
        dec_ref = (ref.float() * torch.pow(2.0, -k.double()).float().unsqueeze(1)).to(dtype)
        for payload in (p, bytes(p)):
            dec = decode(cid, payload, dtype, tuple(block.shape))
            assert bits_equal(dec, dec_ref)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_decode_bit_exact_all_codes_all_k(fmt: str, dtype: torch.dtype) -> None:
    """Every FP8 code under every scale exponent k the payload format allows for dtype
    (hand-built payloads: the encoder never writes some of these k)."""
    base, f8, _ = FP8[fmt]
    lo, hi = K_RANGE[dtype]
    ks = np.arange(lo, hi + 1, dtype=np.int8)
    codes = np.tile(np.arange(256, dtype=np.uint8), ks.size)
    flags = 1
    payload = struct.pack("<BBBBBBBxI", 1, flags, 0, 0, 255, 255, 255, ks.size) \
        + ks.tobytes() + codes.tobytes()
    dec = decode(base, payload, dtype, (ks.size, 256))
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f8).float()
    ref = (vals.unsqueeze(0) * torch.pow(2.0, -torch.from_numpy(ks).double()).float()
           .unsqueeze(1)).to(dtype)
    assert bits_equal(dec, ref)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("zstd", [False, True])
def test_a_nan_or_inf_code_where_the_flags_promise_none_is_corruption(
        native: bool, zstd: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags bit 0 clear promises finite codes (no encoder writes a NaN/Inf code then):
    a payload that breaks it is refused by both of the codec's paths -- the compiled fast
    loop would read such a code as a number -- and decodes once the flag is set."""
    if native and not fp8_kernels.available():
        pytest.skip(fp8_kernels.reason())
    monkeypatch.setattr(fp8_codec, "NATIVE", native)
    import zstandard
    for base, specials in ((FP8_E4M3, [0x7F, 0xFF]), (FP8_E5M2, range(0x7C, 0x80))):
        for code in [c | sign for c in specials for sign in (0, 0x80)]:
            codes = np.full(32, 0x30, np.uint8)
            codes[17] = code
            body = zstandard.ZstdCompressor(level=1).compress(codes.tobytes()) if zstd \
                else codes.tobytes()
            cid = base | (ZSTD if zstd else 0)
            for flags in (0, 1):
                p = struct.pack("<BBBBBBBxI", 1, flags, 0, 0, 255, 255, 255, 2) \
                    + bytes([2, 0xFE]) + body
                if not flags:
                    with pytest.raises(CorruptionError, match="NaN/Inf code"):
                        decode(cid, p, torch.bfloat16, (2, 16))
                    continue
                y = decode(cid, p, torch.bfloat16, (2, 16)).reshape(-1)
                value = float(torch.tensor([code], dtype=torch.uint8)
                              .view(FP8[{1: "e4m3", 2: "e5m2"}[base]][1]).float())
                assert y[17].isnan() if value != value else float(y[17]) == value
                assert bool(torch.isfinite(torch.cat([y[:17], y[18:]])).all())


def test_fp8_float32_input_bit_exact() -> None:
    """float32 inputs go through a round-to-odd 16-bit key; check it on random patterns
    and on exact ties +- one ulp, against torch's direct float32 -> fp8 conversion."""
    g = torch.Generator().manual_seed(1)
    rnd = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64)
    rnd = rnd.to(torch.int32).view(torch.float32)
    # ties of both formats at every binade, nudged by -1/0/+1 ulp, and small magnitudes
    b16 = all_patterns(torch.bfloat16).float()
    tie = (b16.view(torch.int32) | 0x8000).view(torch.float32)   # half-way below 16 bits
    near = torch.cat([(tie.view(torch.int32) + d).view(torch.float32) for d in (-1, 0, 1)])
    x = torch.cat([rnd, b16, near])
    x = x[torch.isfinite(x) | torch.isnan(x)]
    x = x[: x.numel() // 32 * 32].reshape(-1, 32)
    for fmt in ("e4m3", "e5m2"):
        base, f8, emax8 = FP8[fmt]
        mag = torch.where(torch.isfinite(x), x.abs(), 0).amax(1)
        block = x[mag < 2.0 ** 127].contiguous()
        cid, p = encode(block, CodecSpec(fp8=fmt))
        assert cid == base
        k, codes = payload_parts(p)
        ref = (block * torch.pow(2.0, k.double()).float().unsqueeze(1)).to(f8)
        got = torch.from_numpy(codes.copy()).view(f8).reshape(block.shape)
        assert bits_equal(got, ref)
        assert bool((got.view(torch.uint8)[torch.isnan(block)] == 0x7F).all())
        dec = decode(cid, p, torch.float32, tuple(block.shape))
        assert bits_equal(dec, ref.float() * torch.pow(2.0, -k.double()).float().unsqueeze(1))


@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_special_values(dtype: torch.dtype) -> None:
    inf, nan = float("inf"), float("nan")
    vals = [0.0, -0.0, 1.0, -1.0, inf, -inf, nan, 1e-7, -1e-7, 3.0, 2.0 ** -24]
    vals += [0.5] * 21                  # long enough that FP8 is smaller than raw
    x = torch.tensor(vals, dtype=torch.float32).to(dtype).reshape(1, -1)
    for fmt in ("e4m3", "e5m2"):
        base, f8, _ = FP8[fmt]
        cid, p = encode(x, CodecSpec(fp8=fmt))
        assert cid == base
        k, codes = payload_parts(p)
        assert p[1] == 1                             # flags: special codes present
        if fmt == "e4m3":
            # torch saturates +-Inf to +-448 in E4M3FN (it has no infinity); NaN -> 0x7F
            assert codes[4] == 0x7E and codes[5] == 0xFE and codes[6] == 0x7F
        else:
            assert codes[4] == 0x7C and codes[5] == 0xFC and codes[6] == 0x7F
        assert codes[0] == 0x00 and codes[1] == 0x80  # signed zeros kept
        y = decode(cid, p, dtype, tuple(x.shape))
        assert torch.isnan(y[0, 6]) and y[0, 1].item() == 0 and torch.signbit(y[0, 1])
        assert y[0, 2].item() == 1.0 and y[0, 3].item() == -1.0 and y[0, 9].item() == 3.0
        if fmt == "e5m2":
            assert y[0, 4].item() == inf and y[0, 5].item() == -inf
        else:
            assert y[0, 4].item() == 448 * 2.0 ** -int(k[0])


@pytest.mark.parametrize("dtype", FLOATS)
def test_huge_values_fall_back_to_lossless(dtype: torch.dtype) -> None:
    x = torch.randn(4, 64).to(dtype)
    x[2, 5] = 2.0 ** EMAX_DTYPE[dtype] * 1.5
    for z in (False, True):
        cid, p = encode(x, CodecSpec(fp8="e4m3", zstd=z))
        assert cid & 0x0F == CODEC_RAW
        assert torch.equal(decode(cid, p, dtype, tuple(x.shape)), x)
    x[2, 5] = 2.0 ** EMAX_DTYPE[dtype] * 0.99      # just below: quantised
    assert encode(x, CodecSpec(fp8="e4m3"))[0] == FP8_E4M3


@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_that_would_not_be_smaller_is_stored_losslessly(dtype: torch.dtype) -> None:
    # head_dim 1: 12 header bytes + one scale + one code per element >= 2 raw bytes each.
    x = torch.randn(8, 1).to(dtype)
    cid, p = encode(x, CodecSpec(fp8="e4m3"))
    assert cid == (FP8_E4M3 if dtype == torch.float32 else CODEC_RAW)
    assert p.size < x.numel() * x.element_size() or cid == CODEC_RAW
    assert cid != CODEC_RAW or torch.equal(decode(cid, p, dtype, tuple(x.shape)), x)
    # head_dim 64: FP8 halves it, as usual.
    assert encode(torch.randn(8, 64).to(dtype), CodecSpec(fp8="e4m3"))[0] == FP8_E4M3


# --------------------------------------------------------------------------- round trips

SHAPES_LAYOUTS = [
    ((2, 3, 16, 4, 32), KVLayout(0, 2, 3)),        # [kv, layers, tokens, heads, hd]
    ((3, 2, 5, 8), KVLayout(1, 2, 0)),             # [heads, kv, tokens, hd]
    ((16, 4, 32), KVLayout(None, 0, 1)),           # K only
    ((16, 4, 32), KVLayout(None, -3, -2)),         # negative axes
    ((7, 33), None),
    ((100,), None),
]


@pytest.mark.parametrize("shape,layout", SHAPES_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [None, "e4m3", "e5m2"])
@pytest.mark.parametrize("zstd", [False, True])
def test_round_trip(shape: tuple[int, ...], layout: KVLayout | None, dtype: torch.dtype,
                    fp8: str | None, zstd: bool) -> None:
    g = torch.Generator().manual_seed(hash((shape, str(dtype))) & 0xFFFF)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    for kg, vg in (("token_head", "head"), ("tensor", "token"), ("head", "token_head")):
        spec = CodecSpec(fp8=fp8, zstd=zstd, layout=layout, k_granularity=kg, v_granularity=vg)
        cid, p = encode(x, spec)
        want = codec_id(spec)
        assert cid in (want, want & ~ZSTD)
        y = decode(cid, p, dtype, shape)
        assert y.dtype == dtype and y.shape == shape
        if fp8 is None:
            assert bits_equal(y, x)
        else:
            err = float((y.float() - x.float()).norm() / x.float().norm())
            assert err < (0.04 if fp8 == "e4m3" else 0.08)
            if zstd:   # the zstd stage is lossless on top of fp8
                cid2, p2 = encode(x, CodecSpec(fp8=fp8, layout=layout,
                                               k_granularity=kg, v_granularity=vg))
                assert torch.equal(decode(cid2, p2, dtype, shape), y)


@given(st.sampled_from(SHAPES_LAYOUTS + [((1, 8), None), ((4, 1), None), ((3, 0, 2), None)]),
       st.sampled_from([*FLOATS, torch.int32]), st.sampled_from([None, "e4m3", "e5m2"]),
       st.booleans(), st.sampled_from(GRANULARITIES), st.sampled_from(GRANULARITIES),
       st.booleans())
def test_a_planned_size_is_what_encoding_gives_unless_values_overflow(
        shape_layout: tuple[tuple[int, ...], KVLayout | None], dtype: torch.dtype,
        fp8: str | None, zstd: bool, kg: str, vg: str, overflow: bool) -> None:
    """A store reserves FP8 slots from ``planned_nbytes`` before encoding: it must be the
    exact payload size ``prepare`` gives, for every shape, layout and granularity; None
    where the size depends on the values (zstd) or FP8 does not apply; and values past
    the scales' reach (the one data-dependent fallback) must make ``prepare`` differ."""
    shape, layout = shape_layout
    spec = CodecSpec(fp8=fp8, zstd=zstd, layout=layout, k_granularity=kg, v_granularity=vg)
    x = (torch.randn(shape) * 3).to(dtype)
    if overflow and x.numel() and dtype.is_floating_point:
        x.view(-1)[0] = 2.0 ** EMAX_DTYPE[dtype] * 1.5
    planned = planned_nbytes(shape, dtype, spec)
    got = prepare(x, spec)
    if planned is None:
        assert fp8 is None or zstd or got.codec == CODEC_RAW
    elif overflow:
        assert got.codec == CODEC_RAW and got.nbytes != planned
    else:
        assert (got.codec, got.nbytes) == (codec_id(spec), planned)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64,
                                   torch.bool, torch.float64, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize("zstd", [False, True])
def test_non_quantisable_dtypes_stay_lossless(dtype: torch.dtype, zstd: bool) -> None:
    x = (torch.arange(4096) % 7).to(torch.float32).reshape(64, 64).to(dtype)
    cid, p = encode(x, CodecSpec(fp8="e4m3", zstd=zstd))
    assert cid == (CODEC_RAW | ZSTD if zstd else CODEC_RAW)   # this data does compress
    y = decode(cid, bytes(p), dtype, (64, 64))
    assert y.dtype == dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_lossless_bit_exact_with_nan_payloads_and_fallbacks() -> None:
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2**15, 2**15 - 1, (4096,), generator=g, dtype=torch.int32)
    for dtype in (torch.float16, torch.bfloat16):
        x = bits.to(torch.int16).view(dtype)       # includes NaNs with payloads, infs
        cid, p = encode(x, CodecSpec(zstd=True))
        y = decode(cid, p, dtype, (4096,))
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    noise = torch.randint(0, 256, (8192,), generator=g, dtype=torch.uint8)
    cid, p = encode(noise, CodecSpec(zstd=True))
    assert cid == CODEC_RAW                        # zstd did not shrink it: dropped
    for x in (torch.empty(0, 8, dtype=torch.float16), torch.tensor(1.5, dtype=torch.bfloat16)):
        cid, p = encode(x, CodecSpec(fp8="e4m3", zstd=True))
        assert cid & 0x0F == CODEC_RAW
        assert torch.equal(decode(cid, p, x.dtype, tuple(x.shape)), x)


def test_noncontiguous_input_and_bad_layout() -> None:
    x = torch.randn(8, 2, 4, 16).to(torch.float16).transpose(0, 1)   # [kv, tokens, heads, hd]
    assert not x.is_contiguous()
    lay = KVLayout(0, 1, 2)
    cid, p = encode(x, CodecSpec(fp8="e4m3", layout=lay))
    y = decode(cid, p, torch.float16, tuple(x.shape))
    assert float((y.float() - x.float()).norm() / x.float().norm()) < 0.04
    for bad in (KVLayout(0, 1, 3), KVLayout(1, 1, 2), KVLayout(1, 0, 2), KVLayout(0, 1, 9)):
        with pytest.raises(ValueError):
            encode(x, CodecSpec(fp8="e4m3", layout=bad))


def test_decode_into_out() -> None:
    x = torch.randn(2, 4, 8, 64).to(torch.bfloat16)
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(0, 1, 2))
    cid, p = encode(x, spec)
    ref = decode(cid, p, torch.bfloat16, tuple(x.shape))
    out = torch.empty(x.numel(), dtype=torch.bfloat16)             # flat, same numel
    assert decode(cid, p, torch.bfloat16, tuple(x.shape), out=out) is out
    assert torch.equal(out.view(x.shape), ref)
    big = torch.zeros(2, 4, 8, 128, dtype=torch.bfloat16)
    view = big[..., ::2]                                             # non-contiguous
    assert decode(cid, p, torch.bfloat16, tuple(x.shape), out=view) is view
    assert torch.equal(view, ref) and torch.equal(big[..., 1::2], torch.zeros_like(view))
    cid0, p0 = encode(x, CodecSpec(zstd=True))
    out2 = torch.empty_like(x)
    decode(cid0, p0, torch.bfloat16, tuple(x.shape), out=out2)
    assert torch.equal(out2, x)
    for bad in (torch.empty(x.shape, dtype=torch.float16), torch.empty(3, dtype=torch.bfloat16)):
        with pytest.raises(OutputMismatchError):
            decode(cid, p, torch.bfloat16, tuple(x.shape), out=bad)


# --------------------------------------------------------------------------- corruption


def _valid_payloads() -> list[tuple[int, bytes, torch.dtype, tuple[int, ...]]]:
    x = torch.randn(2, 4, 8, 32).to(torch.float16)
    res = []
    for spec in (CodecSpec(), CodecSpec(zstd=True), CodecSpec(fp8="e4m3"),
                 CodecSpec(fp8="e5m2", zstd=True, layout=KVLayout(0, 1, 2)),
                 CodecSpec(fp8="e4m3", zstd=True, layout=KVLayout(0, 1, 2))):
        cid, p = encode(x, spec)
        assert cid == codec_id(spec)
        res.append((cid, bytes(p), torch.float16, tuple(x.shape)))
    return res


VALID = _valid_payloads()


def _decode_or_corrupt(cid: int, payload: bytes, dtype: torch.dtype,
                       shape: tuple[int, ...]) -> None:
    try:
        y = decode(cid, payload, dtype, shape)
    except CorruptionError:
        return
    assert y.dtype == dtype and tuple(y.shape) == shape


def test_truncated_and_extended_payloads_raise_corruption() -> None:
    for cid, p, dtype, shape in VALID:
        for cut in sorted({0, 1, 4, 11, 12, 13, len(p) // 2, len(p) - 1}):
            with pytest.raises(CorruptionError):
                decode(cid, p[:cut], dtype, shape)
        with pytest.raises(CorruptionError):
            decode(cid, p + b"\0", dtype, shape)
        same_numel = [(2, 4, 8, 32, 1)] if cid & 0x0F else []   # raw has no shape to check
        for wrong in [(2, 4, 8, 16), (4, 4, 8, 32), *same_numel]:
            with pytest.raises(CorruptionError):
                decode(cid, p, dtype, wrong)
    with pytest.raises(CorruptionError):
        decode(0x03, b"", torch.float16, (0,))
    with pytest.raises(CorruptionError):
        decode(0x21, VALID[2][1], torch.float16, VALID[2][3])
    with pytest.raises(CorruptionError):
        decode(FP8_E4M3, VALID[2][1], torch.int32, VALID[2][3])


@given(st.sampled_from([0, 1, 2, 0x10, 0x11, 0x12, 0x13, 0x20, 0xFF]), st.binary(max_size=600),
       st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
       st.sampled_from([(4, 8), (2, 3, 4, 4), (37,), (2, 2, 2, 2, 2, 2, 2, 2)]))
def test_random_payloads_only_raise_corruption(cid: int, payload: bytes, dtype: torch.dtype,
                                               shape: tuple[int, ...]) -> None:
    _decode_or_corrupt(cid, payload, dtype, shape)


@given(st.integers(0, len(VALID) - 1), st.data())
def test_mutated_payloads_only_raise_corruption(which: int, data: st.DataObject) -> None:
    cid, p, dtype, shape = VALID[which]
    buf = bytearray(p)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, min(len(buf) - 1, 64 + data.draw(st.integers(0, 1))
                                           * (len(buf) - 65))))
        buf[pos] = data.draw(st.integers(0, 255))
    _decode_or_corrupt(cid, bytes(buf), dtype, shape)


# --------------------------------------------------------------------------- real data


def _load_kv() -> dict[str, torch.Tensor]:
    d = require_kv_dir()
    out = {n: torch.from_numpy(np.load(d / f"smollm2_sample_{n}_fp16.npy")) for n in "QKV"}
    for n in "KV":
        out[n + "bf16"] = torch.from_numpy(
            np.load(d / f"smollm2_sample_{n}_bf16bits.npy").view(np.int16)).view(torch.bfloat16)
    out["meta"] = torch.tensor(json.loads((d / "smollm2_sample_meta.json").read_text())["q_heads"])
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(QK^T/sqrt(d))V, causal, GQA; inputs [layers, tokens, heads, hd] -> float32."""
    q, k, v = (t.float().permute(0, 2, 1, 3) for t in (q, k, v))     # [L, H, T, D]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5
    t = s.shape[-1]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


_REF: dict[torch.dtype, torch.Tensor] = {}


def attn_error(data: dict[str, torch.Tensor], spec: CodecSpec, dtype: torch.dtype) -> float:
    """Relative Frobenius error of the attention output over all layers, heads, tokens."""
    k, v = (data["K"], data["V"]) if dtype == torch.float16 else (data["Kbf16"], data["Vbf16"])
    block = torch.stack([k, v])                                        # [2, L, T, H, D]
    cid, p = encode(block, spec)
    rt = decode(cid, p, dtype, tuple(block.shape))
    if dtype not in _REF:
        _REF[dtype] = attention(data["Q"], k, v)
    o = _REF[dtype]
    o2 = attention(data["Q"], rt[0], rt[1])
    return float((o2 - o).norm() / o.norm())


@pytest.fixture(scope="module")
def kvdata() -> dict[str, torch.Tensor]:
    return _load_kv()


def test_real_data_attention_error(kvdata: dict[str, torch.Tensor]) -> None:
    assert kvdata["Q"].shape[2] == 9 and kvdata["K"].shape[2] == 3
    lay = KVLayout(0, 2, 3)
    errs = {}
    for dtype in (torch.float16, torch.bfloat16):
        for fp8 in ("e4m3", "e5m2"):
            errs[dtype, fp8] = attn_error(kvdata, CodecSpec(fp8=fp8, layout=lay), dtype)
        errs[dtype, "e4m3-tensor"] = attn_error(
            kvdata, CodecSpec(fp8="e4m3", layout=lay, k_granularity="tensor",
                              v_granularity="tensor"), dtype)
        errs[dtype, "e4m3+zstd"] = attn_error(kvdata, CodecSpec(fp8="e4m3", zstd=True,
                                                                 layout=lay), dtype)
        assert errs[dtype, "e4m3"] < 0.065                  # 0.053 on tests/data (0.054 on all 512 tokens)
        assert errs[dtype, "e5m2"] > 1.5 * errs[dtype, "e4m3"]
        assert errs[dtype, "e5m2"] < 0.12                   # 0.098 (0.100)
        # With power-of-two scales the relative rounding error does not depend on the
        # scale, so granularity only matters for values pushed into the FP8 subnormal
        # range: on this data one scale per part is as good (within 10%).
        assert errs[dtype, "e4m3-tensor"] < 1.1 * errs[dtype, "e4m3"]
        assert errs[dtype, "e4m3+zstd"] == errs[dtype, "e4m3"]
        assert attn_error(kvdata, CodecSpec(zstd=True, layout=lay), dtype) == 0.0


def test_real_data_lossless_and_ratios(kvdata: dict[str, torch.Tensor]) -> None:
    for dtype, (k, v) in ((torch.float16, (kvdata["K"], kvdata["V"])),
                          (torch.bfloat16, (kvdata["Kbf16"], kvdata["Vbf16"]))):
        block = torch.stack([k, v])
        raw = block.numel() * 2
        cid, p = encode(block, CodecSpec(zstd=True))
        assert cid == CODEC_RAW | ZSTD and torch.equal(decode(cid, p, dtype, tuple(block.shape))
                                                       .view(torch.int16),
                                                       block.view(torch.int16))
        if dtype == torch.bfloat16:
            assert raw / p.size > 1.3                       # 1.43 (1.54)
        cid, p = encode(block, CodecSpec(fp8="e4m3", zstd=True, layout=KVLayout(0, 2, 3)))
        assert cid == FP8_E4M3 | ZSTD and raw / p.size > 2.1   # 2.37 (2.48)
