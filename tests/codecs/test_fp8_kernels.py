"""The compiled FP8 row kernels against torch's own conversions, exhaustively where the
input space allows it, and the codec's two paths (kernels, NumPy/torch) against each
other byte for byte."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore.codecs import fp8 as fp8_codec
from kvstore.codecs import fp8_kernels
from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec, KVLayout
from tests.realdata import kv_dir

needs_kernels = pytest.mark.skipif(not fp8_kernels.available(), reason=fp8_kernels.reason())
FP8 = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}
FP8_MAX = {1: 448.0, 2: 57344.0}
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
DATA = kv_dir()


def test_kernels_are_built_in_this_checkout() -> None:
    # A silently failed build would leave every user on the slow path: CI must notice.
    if os.environ.get("KVSTORE_NATIVE_CODECS") == "0":
        assert not fp8_kernels.available()
        assert "KVSTORE_NATIVE_CODECS=0" in fp8_kernels.reason()
    else:
        assert fp8_kernels.available(), fp8_kernels.reason()


def reference_codes(x: torch.Tensor, k: np.ndarray, fmt: int) -> np.ndarray:
    """The codec's definition: fp8(float32(x) * 2**k) in torch, every NaN -> 0x7F."""
    scale = torch.pow(2.0, torch.from_numpy(k.astype(np.float32)))
    y = x.float() * scale.view(*x.shape[:-1], 1)
    codes = y.to(FP8[fmt]).view(torch.uint8).clone()
    codes[torch.isnan(y)] = 0x7F
    return codes.numpy().reshape(-1)


def kernel_codes(x: torch.Tensor, k: np.ndarray, fmt: int, finite: bool = False) -> np.ndarray:
    codes = np.empty(x.numel(), np.uint8)
    fp8_kernels.encode_rows(x, k, fmt, codes, finite=finite)
    return codes


@needs_kernels
@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_encode_every_16_bit_pattern(dtype: torch.dtype, fmt: int) -> None:
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    k_values = [-15, -8, -3, 0, 1, 5, 8, 15]
    if dtype == torch.bfloat16:
        k_values += [-126, -40, 20, 60, 126]
    for kk in k_values:
        k = np.full(256, kk, np.int8)
        ref = reference_codes(x, k, fmt)
        np.testing.assert_array_equal(kernel_codes(x, k, fmt), ref,
                                      err_msg=f"{dtype} fmt {fmt} k {kk}")
        # The fast kernel, where its promise holds: finite and within the FP8 range.
        y = (x.float() * 2.0 ** kk).reshape(-1)
        ok = (torch.isfinite(y) & (y.abs() <= FP8_MAX[fmt])).numpy()
        np.testing.assert_array_equal(kernel_codes(x, k, fmt, finite=True)[ok], ref[ok],
                                      err_msg=f"finite kernel {dtype} fmt {fmt} k {kk}")


@needs_kernels
@pytest.mark.parametrize("fmt", [1, 2])
def test_encode_float32_random_patterns_and_near_range(fmt: int) -> None:
    g = torch.Generator().manual_seed(fmt)
    rows = 2048
    bits = torch.randint(-2**31, 2**31 - 1, (rows, 128), dtype=torch.int64, generator=g)
    patterns = bits.to(torch.int32).view(torch.float32)
    near = (torch.rand(rows, 128, generator=g) * 2 - 1) * torch.pow(
        2.0, torch.randint(-30, 20, (rows, 1), generator=g).float())
    # Per-row exponents, so the kernel's row indexing is exercised too.
    k = torch.randint(-126, 127, (rows,), generator=g).to(torch.int8).numpy()
    k_small = torch.randint(-12, 13, (rows,), generator=g).to(torch.int8).numpy()
    for x, kk in ((patterns, k), (near, k_small), (near, np.zeros(rows, np.int8))):
        np.testing.assert_array_equal(kernel_codes(x, kk, fmt), reference_codes(x, kk, fmt))


@needs_kernels
@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_every_code_at_every_exponent(dtype: torch.dtype, fmt: int) -> None:
    codes = np.tile(np.arange(256, dtype=np.uint8), 253)
    k = np.arange(-126, 127, dtype=np.int8)
    out = torch.empty(253, 256, dtype=dtype)
    fp8_kernels.decode_rows(codes, k, fmt, out)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8[fmt]).float()
    scale = torch.pow(2.0, -torch.from_numpy(k.astype(np.float32))).view(253, 1)
    ref = (values.view(1, 256) * scale).to(dtype)
    iv = INT_VIEW[dtype]
    nan = torch.isnan(ref)
    assert torch.equal(out.view(iv)[~nan], ref.view(iv)[~nan])
    canonical = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000}
    assert bool((out.view(iv)[nan] == canonical[dtype]).all())
    assert int(nan.sum()) == 253 * (2 if fmt == 1 else 6)
    # The fast kernel on every code that is neither NaN nor Inf.
    special = torch.isnan(values) | torch.isinf(values)
    ordinary = np.nonzero(~special.numpy())[0].astype(np.uint8)
    fast = torch.empty(253, ordinary.size, dtype=dtype)
    fp8_kernels.decode_rows(np.tile(ordinary, 253), k, fmt, fast, finite=True)
    assert torch.equal(fast.view(iv), ref[:, torch.from_numpy(ordinary).long()].view(iv))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_row_amax_ignores_nan_and_inf(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 96, generator=g) * 100).to(dtype)
    amax, special = fp8_kernels.row_amax(x)
    assert not special
    assert torch.equal(amax, x.float().abs().amax(-1))
    x[3, 5], x[7, 0], x[9, 95] = float("nan"), float("inf"), -float("inf")
    x[11] = float("nan")                     # a row with no finite value
    amax, special = fp8_kernels.row_amax(x)
    assert special
    finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=dtype))
    assert torch.equal(amax, finite.float().amax(-1))
    assert float(amax[11]) == 0.0


@needs_kernels
def test_bad_arguments_raise_instead_of_reading_out_of_bounds() -> None:
    x = torch.zeros(4, 8, dtype=torch.float16)
    codes = np.empty(32, np.uint8)
    with pytest.raises(ValueError, match="contiguous CPU"):
        fp8_kernels.row_amax(x.t())
    with pytest.raises(ValueError, match="contiguous CPU"):
        fp8_kernels.row_amax(torch.zeros(4, 8, dtype=torch.int16))
    with pytest.raises(ValueError, match="4 contiguous int8"):
        fp8_kernels.encode_rows(x, np.zeros(3, np.int8), 1, codes)
    with pytest.raises(ValueError, match="32 contiguous uint8"):
        fp8_kernels.encode_rows(x, np.zeros(4, np.int8), 1, codes[:31])
    with pytest.raises(ValueError, match="out of range"):
        fp8_kernels.encode_rows(x, np.full(4, 127, np.int8), 1, codes)
    with pytest.raises(ValueError, match="rejected"):
        fp8_kernels.decode_rows(codes, np.zeros(4, np.int8), 3, torch.empty(4, 8))


# --------------------------------------------------------------------------- codec level


def _blocks() -> list[tuple[str, torch.Tensor, CodecSpec]]:
    g = torch.Generator().manual_seed(11)
    layout = KVLayout(kv_axis=0, token_axis=1, head_axis=2)
    out = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(2, 16, 4, 64, generator=g).to(dtype) * 3
        for fp8 in ("e4m3", "e5m2"):
            for gk, gv in (("token_head", "head"), ("tensor", "token"), ("head", "tensor")):
                out.append((f"{dtype}-{fp8}-{gk}-{gv}", x,
                            CodecSpec(fp8=fp8, layout=layout, k_granularity=gk, v_granularity=gv)))
        special = x.clone()
        special[0, 1, 2, 3], special[1, 4, 0, 0], special[0, 0, 0, :] = (
            float("nan"), -float("inf"), float("inf"))
        out.append((f"{dtype}-special", special, CodecSpec(fp8="e4m3", layout=layout)))
        out.append((f"{dtype}-special-e5m2", special, CodecSpec(fp8="e5m2")))
        tiny = x * 2.0 ** -20
        out.append((f"{dtype}-tiny", tiny, CodecSpec(fp8="e4m3", zstd=True)))
        # one vector: its row index is 0-d (the NumPy path once got a scalar from it)
        out.append((f"{dtype}-1d", x[0, 0, 0].contiguous(), CodecSpec(fp8="e5m2")))
    meta = DATA / "smollm2_sample_meta.json"
    if meta.exists():
        k = torch.from_numpy(np.load(DATA / "smollm2_sample_K_bf16bits.npy")).view(torch.bfloat16)
        v = torch.from_numpy(np.load(DATA / "smollm2_sample_V_bf16bits.npy")).view(torch.bfloat16)
        kv = torch.stack([k[:, :128], v[:, :128]])          # [2, layers, tokens, heads, dim]
        real = KVLayout(kv_axis=0, token_axis=2, head_axis=3)
        out.append(("real-bf16-e4m3", kv, CodecSpec(fp8="e4m3", layout=real)))
        out.append(("real-f16-e4m3", kv.half(), CodecSpec(fp8="e4m3", layout=real)))
        out.append(("real-bf16-e5m2-zstd", kv, CodecSpec(fp8="e5m2", zstd=True, layout=real)))
    return out


@needs_kernels
@pytest.mark.parametrize("name,x,spec", _blocks(), ids=[b[0] for b in _blocks()])
def test_codec_paths_are_bit_identical(name: str, x: torch.Tensor, spec: CodecSpec,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cid, fast = codecs.encode(x, spec)
    monkeypatch.setattr(fp8_codec, "NATIVE", False)
    cid_ref, ref = codecs.encode(x, spec)
    assert cid == cid_ref
    np.testing.assert_array_equal(fast, ref)
    slow_out = codecs.decode(cid, ref, x.dtype, tuple(x.shape))
    monkeypatch.setattr(fp8_codec, "NATIVE", True)
    fast_out = codecs.decode(cid, fast, x.dtype, tuple(x.shape))
    iv = INT_VIEW[x.dtype]
    assert torch.equal(fast_out.view(iv), slow_out.view(iv))
    assert cid & 0x0F, f"{name} was meant to be quantised"
    assert torch.equal(torch.isnan(fast_out), torch.isnan(x))
