"""Every FP8 decoder is one parser in behaviour: ``kvstore.codecs.pipeline.decode`` (its compiled
kernels and its NumPy/torch path), the CUDA decode kernel's CPU twin
(``fp8.decode_host``) and the GPU path's host side (``fp8.decode_device``, run on the
stand-in runtime whose "kernel" is that twin) refuse the same payloads with
CorruptionError and decode every other one to the same bits, NaN bits included.

Exhaustive where the space allows it (every code under every scale exponent, every
NaN/Inf code under a flag that promises none), and a property over damaged payloads of
every layout, granularity, format, dtype and zstd stage: header fields, scale bytes,
codes, zstd frames, lengths, codec ids and the block shape the slot header gives.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstore.codecs import fp8 as fp8_codec
from kvstore.codecs import fp8_kernels
from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import FP8_E4M3, FP8_E5M2, GRANULARITIES, ZSTD, CodecSpec, KVLayout
from kvstore.cuda import _lib, fp8
from kvstore.errors import CorruptionError
from tests.cuda.standin import StandInLibrary

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
K_RANGE = {torch.float16: (-15, 15), torch.bfloat16: (-126, 126), torch.float32: (-126, 126)}
INTS = {2: torch.int16, 4: torch.int32}
HDR = struct.Struct("<BBBBBBBxI")
# NaN/Inf codes of each format: E4M3FN has only NaN (0x7F, 0xFF), E5M2 +-Inf and NaNs.
SPECIAL = {FP8_E4M3: [0x7F, 0xFF], FP8_E5M2: [0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF]}

Decoder = Callable[[int, bytes, torch.dtype, tuple[int, ...]], torch.Tensor]


@contextlib.contextmanager
def _codec_path(native: bool) -> Iterator[None]:
    """Run ``codecs.decode`` on its compiled kernels or on its NumPy/torch path (both
    are real code paths of the codec; ``KVSTORE_NATIVE_CODECS=0`` picks the second for
    a whole process)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_codec, "NATIVE", native)
        yield


def _decoders(lib: _lib.Library, standin: StandInLibrary | None) -> dict[str, Decoder]:
    def on_path(native: bool) -> Decoder:
        def run(codec: int, payload: bytes, dtype: torch.dtype,
                shape: tuple[int, ...]) -> torch.Tensor:
            with _codec_path(native):
                return codecs.decode(codec, payload, dtype, shape)
        return run

    def device(codec: int, payload: bytes, dtype: torch.dtype,
               shape: tuple[int, ...]) -> torch.Tensor:
        # "device" memory is host memory on the stand-in; out is big enough for any
        # shape the parser accepts (a positive product of non-negative dims)
        out = torch.empty(max(abs(math.prod(shape)), 1), dtype=dtype)
        fp8.decode_device(codec, payload, dtype, shape, out.data_ptr(), stream=0, device=1)
        return out[:math.prod(shape)].view(shape)

    def twin(codec: int, payload: bytes, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor:
        return fp8.decode_host(codec, payload, dtype, shape, lib)

    found: dict[str, Decoder] = {"codec numpy": on_path(False), "twin": twin}
    if fp8_kernels.available():
        found["codec native"] = on_path(True)
    if standin is not None:
        found["device"] = device
    return found


def _outcome(decode: Decoder, codec: int, payload: bytes, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor | type[CorruptionError]:
    try:
        return decode(codec, payload, dtype, shape)
    except CorruptionError:
        return CorruptionError


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INTS[t.element_size()]) if t.element_size() in INTS \
        else t.contiguous()


def _assert_agree(decoders: dict[str, Decoder], codec: int, payload: bytes,
                  dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """All decoders refuse, or all decode to the same bits; returns which."""
    got = {name: _outcome(d, codec, payload, dtype, shape) for name, d in decoders.items()
           if name != "device" or fp8._is_fp8(codec, dtype)}  # device: FP8 ids only
    refused = {name for name, o in got.items() if o is CorruptionError}
    assert not refused or refused == set(got), f"only {sorted(refused)} refused"
    if refused:
        return "refused"
    ref_name, ref = next(iter(got.items()))
    assert isinstance(ref, torch.Tensor)
    for name, o in got.items():
        assert isinstance(o, torch.Tensor)
        assert o.dtype == ref.dtype and o.shape == ref.shape
        assert torch.equal(_bits(o), _bits(ref)), f"{name} decodes differently from {ref_name}"
    return "decoded"


def _table_payload(base: int, flags: int, ks: np.ndarray, codes: np.ndarray,
                   zstd: bool = False) -> bytes:
    """A hand-built FP8 payload without a layout: one scale per row of ``codes``."""
    body = codes.tobytes()
    if zstd:
        import zstandard
        body = zstandard.ZstdCompressor(level=1).compress(body)
    return HDR.pack(1, flags, 0, 0, 0xFF, 0xFF, 0xFF, ks.size) + ks.tobytes() + body


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("base", [FP8_E4M3, FP8_E5M2])
def test_every_code_under_every_exponent_decodes_alike(
        base: int, dtype: torch.dtype, host_lib: _lib.Library,
        standin_kernels: StandInLibrary) -> None:
    """Every scale exponent the format allows for ``dtype`` (outputs that are subnormal,
    that overflow to infinity, negative exponents: values no encoder writes) times every
    code; with the special-value flag set, and with it clear over the finite codes."""
    decoders = _decoders(host_lib, standin_kernels)
    lo, hi = K_RANGE[dtype]
    ks = np.arange(lo, hi + 1, dtype=np.int8)
    every = np.arange(256, dtype=np.uint8)
    finite = np.setdiff1d(every, SPECIAL[base]).astype(np.uint8)
    for flags, codes in ((1, every), (0, finite)):
        payload = _table_payload(base, flags, ks, np.tile(codes, ks.size))
        assert _assert_agree(decoders, base, payload, dtype, (ks.size, codes.size)) == "decoded"


@pytest.mark.parametrize("zstd", [False, True])
@pytest.mark.parametrize("base", [FP8_E4M3, FP8_E5M2])
def test_a_special_code_under_a_flag_that_promises_none_is_refused_by_all(
        base: int, zstd: bool, host_lib: _lib.Library,
        standin_kernels: StandInLibrary) -> None:
    """The flag says the codes hold no NaN/Inf: one such code anywhere makes the payload
    corrupt for every decoder (the codec's fast loop would read it as a number, the
    kernel as NaN or Inf); the same payload with the flag set decodes alike."""
    decoders = _decoders(host_lib, standin_kernels)
    ks = np.array([3, -2, 0, 7], dtype=np.int8)
    for dtype in FLOATS:
        for i, special in enumerate(SPECIAL[base]):
            codes = np.full((4, 16), 0x38, dtype=np.uint8)
            codes.reshape(-1)[(i * 7) % codes.size] = special
            shape = codes.shape
            codec = base | (ZSTD if zstd else 0)
            clear = _table_payload(base, 0, ks, codes, zstd)
            assert _assert_agree(decoders, codec, clear, dtype, shape) == "refused"
            with pytest.raises(CorruptionError, match="flags say it has none"):
                codecs.decode(codec, clear, dtype, shape)
            flagged = _table_payload(base, 1, ks, codes, zstd)
            assert _assert_agree(decoders, codec, flagged, dtype, shape) == "decoded"


# (shape, layout): a kv axis first or inside, layer axes, V-only blocks, no layout
BLOCKS = [
    ((2, 2, 8, 4, 16), KVLayout(0, 2, 3)),
    ((2, 8, 4, 16), KVLayout(0, 1, 2)),
    ((3, 2, 4, 8), KVLayout(1, 0, 2)),
    ((8, 4, 16), KVLayout(None, 0, 1)),
    ((4, 3, 8), KVLayout(None, 1, 0)),
    ((6, 32), None),
    ((40,), None),
]
CODEC_IDS = [0x00, 0x01, 0x02, 0x10, 0x11, 0x12, 0x03, 0x21, 0x31, 0x41, 0x81, 0xF1]


@st.composite
def damaged_payloads(draw: st.DrawFn) -> tuple[int, bytes, torch.dtype, tuple[int, ...]]:
    """A payload the codec wrote for a random block and spec, then damaged: bytes of the
    header, the scales, the codes (or zstd frame) rewritten, its special-value flag
    flipped, its end cut or extended, its codec id or the block's shape replaced."""
    shape, layout = draw(st.sampled_from(BLOCKS))
    dtype = draw(st.sampled_from(FLOATS))
    spec = CodecSpec(fp8=draw(st.sampled_from(["e4m3", "e5m2"])), zstd=draw(st.booleans()),
                     layout=layout, k_granularity=draw(st.sampled_from(GRANULARITIES)),
                     v_granularity=draw(st.sampled_from(GRANULARITIES)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 32 - 1)))
    # magnitudes from far below FP8's range (clamped exponents, subnormal codes) up
    x = torch.randn(shape, generator=g) * 2.0 ** draw(st.integers(-140, 12))
    for value in draw(st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf")]),
                               max_size=3)):
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = value
    codec, encoded = codecs.encode(x.to(dtype), spec)
    buf = bytearray(encoded.tobytes())
    head = HDR.size + (HDR.unpack_from(buf)[-1] if codec & 0x0F and len(buf) >= 12 else 0)
    for _ in range(draw(st.integers(0, 3))):
        lo, hi = draw(st.sampled_from([(0, HDR.size), (HDR.size, head), (head, len(buf)),
                                       (0, len(buf))]))
        if hi > lo:
            pos = draw(st.integers(lo, hi - 1))
            flipped = [buf[pos] ^ 1 << b for b in range(8)]
            buf[pos] = draw(st.one_of(st.integers(0, 255), st.sampled_from(flipped),
                                      st.sampled_from(SPECIAL[FP8_E5M2])))  # E4M3's too
    if codec & 0x0F and draw(st.booleans()):
        buf[1] ^= 1
    cut = draw(st.integers(-3, 3))
    buf = buf[:len(buf) + cut] if cut < 0 else buf + bytes(draw(st.binary(min_size=cut,
                                                                         max_size=cut)))
    codec = draw(st.sampled_from([codec] * 4 + CODEC_IDS))
    n = math.prod(shape)
    shape = draw(st.sampled_from([shape] * 4 + [(n // shape[-1], shape[-1]), (n,),
                                                (*(-d for d in shape[:2]), *shape[2:]),
                                                (*shape[:-1], shape[-1] * 2), (0, *shape)]))
    return codec, bytes(buf), dtype, shape


@settings(max_examples=max(300, settings().max_examples))
@given(case=damaged_payloads())
@example(case=(FP8_E4M3, _table_payload(FP8_E4M3, 0, np.zeros(1, np.int8),
                                        np.array([[0x38, 0xFF]], np.uint8)),
               torch.bfloat16, (1, 2)))
def test_damaged_payloads_are_refused_or_decoded_alike_by_every_decoder(
        case: tuple[int, bytes, torch.dtype, tuple[int, ...]], host_lib: _lib.Library,
        standin_kernels: StandInLibrary) -> None:
    _assert_agree(_decoders(host_lib, standin_kernels), *case)
