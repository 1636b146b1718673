"""The CPU paths give what the kernels give.

* gather/scatter: the torch reference against an independent byte-level model of the
  kernel (its address arithmetic, from the same geometry the kernel is given), for
  every vLLM layout and several block-id patterns;
* FP8: the kernels' element code compiled for the host (``*_host``) against
  kvstore.codecs on the real SmolLM2 KV data and on special values, payload bytes and
  decoded bits; and the public fallback (no device) equals the codec.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec, KVLayout
from kvstore.cuda import _lib, fp8, paged
from tests.realdata import kv_dir, require_kv_dir

# (name, layout, per-layer shape builder (num_blocks) -> shape)
LAYOUTS: list[tuple[str, paged.Layout, Callable[[int], tuple[int, ...]]]] = [
    ("flash_attn NHD [2,N,bs,h,d]", "kv_first", lambda n: (2, n, 16, 4, 32)),
    ("flash_attn HND [2,N,h,bs,d]", "kv_first", lambda n: (2, n, 4, 16, 32)),
    ("flashinfer [N,2,bs,h,d]", "blocks_first", lambda n: (n, 2, 16, 4, 32)),
    ("mla [N,bs,d]", "blocks_first", lambda n: (n, 16, 72)),
    ("cross-layer [N,L,2,bs,h,d]", "blocks_first", lambda n: (n, 3, 2, 8, 2, 16)),
]
IDS = {
    "sequential": [0, 1, 2, 3],
    "reversed": [9, 7, 5, 3, 1],
    "scattered": [11, 0, 6, 2],
    "single": [4],
    "empty": [],
}


def _layers(shape: tuple[int, ...], n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def _kernel_model(layers: list[torch.Tensor], ids: list[int], layout: str) -> np.ndarray:
    """What cuda_ext/gather_scatter.cu writes, byte by byte: for id i, layer l, outer o,
    ``inner`` bytes from base_l + o*outer_stride + id*block_stride."""
    axis = 1 if layout == "kv_first" else 0
    outer, ostride, bstride, inner = paged._geometry(layers[0], axis)
    out = np.zeros(len(ids) * len(layers) * outer * inner, dtype=np.uint8)
    pos = 0
    for b in ids:
        for t in layers:
            storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
            base = t.storage_offset() * t.element_size()
            for o in range(outer):
                start = base + o * ostride + b * bstride
                out[pos:pos + inner] = storage[start:start + inner]
                pos += inner
    return out


@pytest.mark.parametrize("name,layout,shape_of", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("pattern", list(IDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_reference_matches_the_kernel_model(
        name: str, layout: paged.Layout, shape_of: Callable[[int], tuple[int, ...]],
        pattern: str, dtype: torch.dtype) -> None:
    layers = _layers(shape_of(12), 3, dtype, seed=len(name))
    ids = IDS[pattern]
    staged = paged.gather(layers, ids, layout)       # CPU: the torch path
    assert staged.shape == paged.staging_shape(layers[0].shape, 3, len(ids), layout)
    assert staged.is_contiguous()
    got = staged.reshape(-1).view(torch.uint8).numpy()
    assert np.array_equal(got, _kernel_model(layers, ids, layout))


@pytest.mark.parametrize("name,layout,shape_of", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_scatter_is_the_inverse_and_touches_nothing_else(
        name: str, layout: paged.Layout, shape_of: Callable[[int], tuple[int, ...]]) -> None:
    src = _layers(shape_of(12), 2, torch.float16, seed=1)
    ids = [10, 3, 7]
    staged = paged.gather(src, ids, layout)
    dst = [torch.zeros_like(t) for t in src]
    paged.scatter(staged, dst, ids, layout)
    axis = 1 if layout == "kv_first" else 0
    for s, d in zip(src, dst):
        for b in range(12):
            want = s.select(axis, b) if b in ids else torch.zeros_like(s.select(axis, b))
            assert torch.equal(d.select(axis, b), want)


def test_strided_cache_view_is_handled() -> None:
    # A slice along the block axis (a cache shared with other data): the per-block part
    # stays contiguous, block_stride is the parent's.
    full = _layers((2, 20, 16, 4, 32), 1, torch.float16, seed=3)[0]
    view = full[:, 5:17]
    staged = paged.gather([view], [0, 11, 4], "kv_first")
    assert np.array_equal(staged.reshape(-1).view(torch.uint8).numpy(),
                          _kernel_model([view], [0, 11, 4], "kv_first"))


def test_gather_allows_repeats_scatter_refuses_them() -> None:
    layers = _layers((4, 8, 16), 1, torch.float32, seed=2)
    staged = paged.gather(layers, [1, 1, 2], "blocks_first")
    assert torch.equal(staged[0], staged[1])
    with pytest.raises(ValueError, match="distinct"):
        paged.scatter(staged, layers, [1, 1, 2], "blocks_first")


@pytest.mark.parametrize("bad,err,match", [
    ([12], IndexError, r"block ids must be in \[0, 12\)"),
    ([-1], IndexError, "block ids"),
])
def test_bad_block_ids_are_refused(bad: list[int], err: type[Exception], match: str) -> None:
    layers = _layers((2, 12, 4, 8), 1, torch.float16, seed=0)
    with pytest.raises(err, match=match):
        paged.gather(layers, bad, "kv_first")


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_first cache is \\[2, num_blocks"):
        paged.gather([torch.zeros(3, 4, 8)], [0], "kv_first")
    with pytest.raises(ValueError, match="layout must be one of"):
        paged.gather([torch.zeros(3, 4, 8)], [0], "nhd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every layer must match"):
        paged.gather([torch.zeros(3, 4, 8), torch.zeros(3, 4, 9)], [0], "blocks_first")
    with pytest.raises(ValueError, match="contiguous"):
        paged._geometry(torch.zeros(4, 8, 6).transpose(1, 2), 0)


# --------------------------------------------------------------------------- FP8


def _real(name: str) -> torch.Tensor:
    arr = np.load(kv_dir() / name)
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if "bf16bits" in name else t


@pytest.fixture(scope="module")
def kv_real() -> dict[torch.dtype, torch.Tensor]:
    require_kv_dir()
    k16, v16 = _real("smollm2_sample_K_fp16.npy"), _real("smollm2_sample_V_fp16.npy")
    kb, vb = _real("smollm2_sample_K_bf16bits.npy"), _real("smollm2_sample_V_bf16bits.npy")
    # [2, layers, tokens, heads, head_dim]; a 64-token slice keeps the test quick
    return {torch.float16: torch.stack([k16, v16])[:, :, :64].contiguous(),
            torch.bfloat16: torch.stack([kb, vb])[:, :, :64].contiguous(),
            torch.float32: torch.stack([k16, v16])[:, :, 64:128].float().contiguous()}


def _same_decode(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaNs included (NaN codes decode to the canonical quiet NaN)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _check(x: torch.Tensor, spec: CodecSpec, lib: _lib.Library) -> None:
    want_id, want = codecs.encode(x, spec)
    got_id, got = fp8.encode_host(x, spec, lib)
    assert got_id == want_id
    assert np.array_equal(got, want), f"payload differs for {x.dtype} {spec}"
    ref = codecs.decode(want_id, want, x.dtype, tuple(x.shape))
    out = fp8.decode_host(got_id, got, x.dtype, tuple(x.shape), lib)
    assert _same_decode(out, ref), f"decode differs for {x.dtype} {spec}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_kernel_twin_matches_codec_on_real_kv(kv_real: dict[torch.dtype, torch.Tensor],
                                              dtype: torch.dtype, fmt: str,
                                              host_lib: _lib.Library) -> None:
    x = kv_real[dtype]
    layout = KVLayout(kv_axis=0, token_axis=2, head_axis=3)
    for gk, gv in itertools.product(codecs.GRANULARITIES, repeat=2):
        # two layers, 16 tokens: every granularity pair, kept quick
        _check(x[:, :2, :16].contiguous(), CodecSpec(fp8=fmt, layout=layout, k_granularity=gk,
                                                     v_granularity=gv), host_lib)
    _check(x, CodecSpec(fp8=fmt, zstd=True, layout=layout), host_lib)
    _check(x[0], CodecSpec(fp8=fmt), host_lib)                        # no layout
    _check(x[1], CodecSpec(fp8=fmt, k_granularity="tensor"), host_lib)
    _check(x[0, 0], CodecSpec(fp8=fmt, layout=KVLayout(None, 0, 1), k_granularity="head"),
           host_lib)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_kernel_twin_matches_codec_on_special_values(dtype: torch.dtype, fmt: str,
                                                     host_lib: _lib.Library) -> None:
    g = torch.Generator().manual_seed(7)
    # magnitudes from the subnormal range of the dtype up to near its top, per row
    lo = {torch.float16: -7.0, torch.bfloat16: -40.0, torch.float32: -44.0}[dtype]
    scale = torch.logspace(lo, 4.0, 96).view(96, 1, 1)
    x = (torch.randn(96, 4, 32, generator=g) * scale).to(dtype)
    flat = x.view(-1)
    flat[::97] = float("nan")
    flat[5::101] = float("inf")
    flat[7::103] = -float("inf")
    flat[9::89] = -0.0
    flat[11::211] = 0.0
    x[3] = 0.0                                    # an all-zero group
    x[4] = float("nan")                           # a group with no finite element
    x[5, 0, :4] = torch.tensor([1.75, -1.7578125, 1.875, 448.0]).to(dtype)  # M>1.75 edges
    _check(x, CodecSpec(fp8=fmt), host_lib)
    _check(x, CodecSpec(fp8=fmt, zstd=True, k_granularity="tensor"), host_lib)


@pytest.mark.parametrize("dtype,big", [(torch.float16, 40000.0), (torch.float32, 2.0 ** 127)])
def test_kernel_twin_stores_huge_blocks_losslessly_like_the_codec(
        dtype: torch.dtype, big: float, host_lib: _lib.Library) -> None:
    x = torch.ones(4, 16, dtype=dtype)
    x[2, 3] = big
    codec, payload = fp8.encode_host(x, CodecSpec(fp8="e4m3"), host_lib)
    assert codec == codecs.CODEC_RAW
    assert np.array_equal(payload, codecs.encode(x, CodecSpec(fp8="e4m3"))[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_twin_stores_tiny_vectors_like_the_codec(dtype: torch.dtype,
                                                        host_lib: _lib.Library) -> None:
    # head_dim 1: an FP8 payload would not be smaller than 16-bit raw bytes.
    x = torch.randn(8, 1).to(dtype)
    for spec in (CodecSpec(fp8="e4m3"), CodecSpec(fp8="e5m2", zstd=True)):
        _check(x, spec, host_lib)


@given(seed=st.integers(0, 2 ** 32 - 1), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       fmt=st.sampled_from(["e4m3", "e5m2"]), gran=st.sampled_from(codecs.GRANULARITIES))
def test_kernel_twin_matches_codec_on_random_bit_patterns(
        seed: int, dtype: torch.dtype, fmt: str, gran: str, host_lib: _lib.Library) -> None:
    # every 16-bit pattern is a possible input: NaN payloads, subnormals, huge values
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-32768, 32768, (2, 3, 4, 16), generator=g, dtype=torch.int16)
    x = bits.view(dtype)
    _check(x, CodecSpec(fp8=fmt, layout=KVLayout(0, 1, 2), k_granularity=gran), host_lib)


def test_scale_groups_agree_with_the_codec_header() -> None:
    shape = (2, 3, 8, 4, 16)
    for gk, gv in itertools.product(codecs.GRANULARITIES, repeat=2):
        spec = CodecSpec(fp8="e4m3", layout=KVLayout(0, 2, 3), k_granularity=gk,
                         v_granularity=gv)
        _, payload = codecs.encode(torch.randn(shape), spec)
        sg = fp8.scale_groups(shape, spec)
        assert int(payload[8:12].view(np.uint32)[0]) == sg.n
        assert sg.row_group.size == 2 * 3 * 8 * 4
        assert set(np.unique(sg.row_group)) == set(range(sg.n))


def test_public_fp8_falls_back_to_the_codec_without_a_device(
        kv_real: dict[torch.dtype, torch.Tensor]) -> None:
    x = kv_real[torch.bfloat16][:, :1]
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(0, 2, 3))
    codec, payload = fp8.encode(x, spec)
    want = codecs.encode(x, spec)
    assert codec == want[0] and np.array_equal(payload, want[1])
    out = fp8.decode(codec, payload, x.dtype, tuple(x.shape))
    assert torch.equal(out, codecs.decode(codec, payload, x.dtype, tuple(x.shape)))


@given(pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7),
       cut=st.integers(min_value=0, max_value=4), zstd=st.booleans())
@example(pos=41273724, bit=5, cut=0, zstd=False)  # code 0xDF -> 0xFF (NaN), flags say none
def test_kernel_twin_refuses_exactly_what_the_codec_refuses(
        host_lib: _lib.Library, pos: int, bit: int, cut: int, zstd: bool) -> None:
    """One payload parser: a damaged or truncated FP8 payload is a CorruptionError for
    the GPU path's host side exactly when it is one for the codec, and decodes alike."""
    x = torch.randn(2, 2, 16, 4, 32, generator=torch.Generator().manual_seed(3))
    spec = CodecSpec(fp8="e4m3", zstd=zstd, layout=KVLayout(0, 2, 3), k_granularity="head")
    codec, payload = codecs.encode(x, spec)
    damaged = np.array(payload, dtype=np.uint8).copy()
    damaged[pos % min(damaged.size, 96)] ^= 1 << bit   # header, scales or first codes
    damaged = damaged[:damaged.size - cut]
    outcomes = []
    for decode in (codecs.decode, lambda *a: fp8.decode_host(*a, lib=host_lib)):
        try:
            outcomes.append(decode(codec, damaged, x.dtype, tuple(x.shape)))
        except codecs.CorruptionError as e:
            outcomes.append(type(e))
    ref, twin = outcomes
    if isinstance(ref, torch.Tensor) and isinstance(twin, torch.Tensor):
        assert _same_decode(twin, ref)
    else:
        assert ref is twin is codecs.CorruptionError, (ref, twin)
