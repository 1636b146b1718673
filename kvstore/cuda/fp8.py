"""FP8 encode/decode on the GPU, producing exactly :func:`kvstore.codecs.pipeline.encode`'s payloads.

The payload format and the quantisation algorithm are kvstore/codecs/pipeline.py's (its module
docstring); this module maps them onto the kernels in ``cuda_ext/fp8.cu``:

* the scale groups of a block become one int32 per *row* (a vector along the last axis):
  ``row_group[r]`` = index of row r's scale in the payload's scale array (K part's
  groups in C order, then V part's) -- :func:`scale_groups`;
* the kernels compute per-group finite amax, the exponents ``k`` and the codes; the
  header is packed here;
* the zstd stage (ids 0x11/0x12) runs on the CPU afterwards, as in the codec.

Three paths give the same bytes: the kernels (a CUDA tensor or a device pointer and a
usable device), their CPU twin ``*_host`` (the kernels' element code compiled for the
host: testable without a GPU, needs only the built library), and the codec itself
(the fallback when CUDA is unavailable).  ``encode``/``decode`` pick the fastest one
available.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt
import torch

from kvstore import codecs
from kvstore.codecs import FP8_E4M3, FP8_E5M2, CodecSpec
from kvstore.cuda._lib import Library, runtime
from kvstore.cuda.paged import cuda_index

__all__ = ["ScaleGroups", "decode", "decode_device", "decode_host", "encode",
           "encode_device", "encode_host", "scale_groups"]

U8 = npt.NDArray[np.uint8]
# The codec's own payload header, axis marker, granularity names and exponent ranges, so
# the GPU path cannot drift from the format it must reproduce.
_HDR, _NO_AXIS, _GRANS = codecs.FP8_HEADER, codecs.NO_AXIS, codecs.GRANULARITIES
_DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


class ScaleGroups:
    """Scale groups of one block shape + spec: ``row_group`` (int32 per row), ``n``
    groups, and the header's (gran_k, gran_v, kv_axis, token_axis, head_axis)."""

    def __init__(self, row_group: npt.NDArray[np.int32], n: int,
                 fields: tuple[int, int, int, int, int], rows: int, head_dim: int) -> None:
        self.row_group, self.n, self.fields = row_group, n, fields
        self.rows, self.head_dim = rows, head_dim


@functools.lru_cache(maxsize=256)
def _groups(shape: tuple[int, ...], gk: int, gv: int, kv: int, tok: int,
            head: int) -> ScaleGroups:
    # The codec's own rules and row -> scale map (not a copy of them), so the two paths
    # cannot drift.
    plan = codecs.part_plan(shape, (gk, gv), kv, tok, head)
    row_group = np.ascontiguousarray(codecs.row_scale_index(shape[:-1], kv, plan),
                                     dtype=np.int32).reshape(-1)
    return ScaleGroups(row_group, codecs.scale_count(plan), (gk, gv, kv, tok, head),
                       int(row_group.size), shape[-1])


def scale_groups(shape: tuple[int, ...], spec: CodecSpec) -> ScaleGroups:
    """Row -> scale-group map of a block (the codec's "granularity" rules)."""
    shape = tuple(int(d) for d in shape)
    kv, tok, head = codecs.norm_axes(spec.layout, shape)
    gk, gv = _GRANS.index(spec.k_granularity), _GRANS.index(spec.v_granularity)
    if kv == _NO_AXIS:
        gv = gk
    return _groups(shape, gk, gv, kv, tok, head)


def _fp8_applies(dtype: torch.dtype, shape: tuple[int, ...], spec: CodecSpec) -> bool:
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if spec.fp8 is None or dtype not in _DTYPE_CODE or len(shape) < 1 or numel == 0:
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    return codecs.fp8_smaller(scale_groups(shape, spec).n, numel, itemsize)


def _base(spec: CodecSpec) -> int:
    return FP8_E4M3 if spec.fp8 == "e4m3" else FP8_E5M2


def _assemble(base: int, spec: CodecSpec, sg: ScaleGroups, status: int,
              scales: npt.NDArray[np.int8], codes: U8) -> tuple[int, U8]:
    """Header + scales + codes, then the optional zstd stage, as codecs.encode does."""
    head = _HDR.size + sg.n
    out = np.empty(head + codes.size, dtype=np.uint8)
    gk, gv, kv, tok, head_ax = sg.fields
    _HDR.pack_into(out.data, 0, 1, status & 1, gk, gv, kv, tok, head_ax, sg.n)
    out[_HDR.size:head] = scales.view(np.uint8)
    out[head:] = codes
    return codecs.zstd_stage(base, out, head) if spec.zstd else (base, out)


# ------------------------------------------------------------------------ encode


def encode_host(t: torch.Tensor, spec: CodecSpec, lib: Library | None = None) -> tuple[int, U8]:
    """The kernels' CPU twin (needs the built library, not a device)."""
    lib = lib or runtime().lib
    if lib is None:
        raise RuntimeError(runtime().reason)
    x = t.detach().cpu().contiguous()
    shape = tuple(x.shape)
    if not _fp8_applies(x.dtype, shape, spec):
        return codecs.encode(x, spec)
    sg = scale_groups(shape, spec)
    scratch = np.empty(sg.n + 1, dtype=np.uint32)
    scales = np.empty(sg.n, dtype=np.int8)
    codes = np.empty(x.numel(), dtype=np.uint8)
    base = _base(spec)
    lib.call("kvc_fp8_encode_host", x.data_ptr(), _DTYPE_CODE[x.dtype], sg.rows, sg.head_dim,
             sg.row_group.ctypes.data, sg.n, base, scratch.ctypes.data, scales.ctypes.data,
             codes.ctypes.data)
    if scratch[sg.n] & 2:
        return codecs.encode(x, spec)  # the codec stores this block losslessly
    return _assemble(base, spec, sg, int(scratch[sg.n]), scales, codes)


def encode_device(ptr: int, dtype: torch.dtype, shape: tuple[int, ...], spec: CodecSpec,
                  stream: int = 0, device: int | None = None) -> tuple[int, U8]:
    """Encode a C-contiguous block at device address ``ptr`` on ``stream`` (returns when
    done).  Uses the library's own allocations: no torch CUDA needed.  ``device``: the
    GPU that holds ``ptr`` and ``stream``; the scratch memory is allocated and the kernel
    launched there (the thread's current device is restored after), ``None`` = the
    current device."""
    from kvstore.cuda.device import on_device, require_lib

    lib = require_lib()
    shape = tuple(int(d) for d in shape)
    if not _fp8_applies(dtype, shape, spec):
        raise ValueError(f"no FP8 encoding for dtype {dtype}, shape {shape}, spec {spec}")
    with on_device(device, lib):
        return _encode_on_current_device(lib, ptr, dtype, shape, spec, stream)


def _encode_on_current_device(lib: Library, ptr: int, dtype: torch.dtype,
                              shape: tuple[int, ...], spec: CodecSpec,
                              stream: int) -> tuple[int, U8]:
    from kvstore.cuda.device import DeviceBuffer

    sg = scale_groups(shape, spec)
    numel = sg.rows * sg.head_dim
    base = _base(spec)
    n4 = (sg.n + 1) * 4
    rg = sg.row_group.nbytes
    # One allocation: row_group | scratch | scales | codes
    with DeviceBuffer(rg + n4 + sg.n + numel, lib) as buf:
        buf.upload(sg.row_group, stream)
        p_scratch, p_scales = buf.ptr + rg, buf.ptr + rg + n4
        p_codes = p_scales + sg.n
        lib.call("kvc_fp8_encode", ptr, _DTYPE_CODE[dtype], sg.rows, sg.head_dim, buf.ptr,
                 sg.n, base, p_scratch, p_scales, p_codes, stream)
        host = np.empty(n4 + sg.n + numel, dtype=np.uint8)
        buf.download(host, stream, offset=rg)
    status = int(host[sg.n * 4:n4].view(np.uint32)[0])
    if status & 2:
        raw = np.empty(numel * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8)
        lib.call("kvc_memcpy_async", raw.ctypes.data, ptr, raw.nbytes, stream)
        lib.call("kvc_stream_synchronize", stream)
        t = torch.from_numpy(raw).view(dtype).reshape(shape)
        return codecs.encode(t, spec)  # stored losslessly, as the codec does
    return _assemble(base, spec, sg, status, host[n4:n4 + sg.n].view(np.int8), host[n4 + sg.n:])


def encode(t: torch.Tensor, spec: CodecSpec) -> tuple[int, U8]:
    """Same result as :func:`kvstore.codecs.pipeline.encode`; a CUDA tensor is quantised on its
    device (current torch stream) when the library is usable, else the codec runs."""
    if t.device.type == "cuda" and runtime().usable and \
            _fp8_applies(t.dtype, tuple(t.shape), spec):
        x = t.detach().contiguous()
        stream = int(torch.cuda.current_stream(x.device).cuda_stream)
        return encode_device(x.data_ptr(), x.dtype, tuple(x.shape), spec, stream,
                             cuda_index(x.device))
    return codecs.encode(t, spec)


# ------------------------------------------------------------------------ decode


def _parse(codec: int, payload: codecs.Payload, dtype: torch.dtype,
           shape: tuple[int, ...]) -> tuple[ScaleGroups, npt.NDArray[np.int8], U8]:
    """The codec's own payload parser (:func:`kvstore.codecs.pipeline.parse_fp8_payload`: the same
    checks, the same CorruptionError cases), then the kernels' row -> scale map of the
    groups it parsed (the codec's own plan, :func:`_groups`)."""
    parsed = codecs.parse_fp8_payload(codec, payload, dtype, shape)
    return _groups(shape, *parsed.granularities, *parsed.axes), parsed.scales, parsed.codes


def _is_fp8(codec: int, dtype: torch.dtype) -> bool:
    """Whether the kernels decode this block: a known FP8 codec id (an unknown one, even
    with an FP8 base in bits 0-3, is the codec's to refuse) into a float dtype."""
    return codecs.is_known(codec) and codec & 0x0F in (FP8_E4M3, FP8_E5M2) \
        and dtype in _DTYPE_CODE


def decode_host(codec: int, payload: codecs.Payload, dtype: torch.dtype,
                shape: tuple[int, ...], lib: Library | None = None) -> torch.Tensor:
    """The decode kernel's CPU twin (needs the built library, not a device)."""
    lib = lib or runtime().lib
    if lib is None:
        raise RuntimeError(runtime().reason)
    shape = tuple(int(d) for d in shape)
    if not _is_fp8(codec, dtype):
        return codecs.decode(codec, payload, dtype, shape)
    sg, scales, codes = _parse(codec, payload, dtype, shape)
    codes = np.ascontiguousarray(codes)
    scales = np.ascontiguousarray(scales)
    out = torch.empty(shape, dtype=dtype)
    lib.call("kvc_fp8_decode_host", codes.ctypes.data, scales.ctypes.data,
             sg.row_group.ctypes.data, sg.rows, sg.head_dim, codec & 0x0F, _DTYPE_CODE[dtype],
             out.data_ptr())
    return out


def decode_device(codec: int, payload: codecs.Payload, dtype: torch.dtype,
                  shape: tuple[int, ...], out_ptr: int, stream: int = 0,
                  device: int | None = None) -> None:
    """Decode into the C-contiguous device buffer at ``out_ptr`` (returns when done);
    ``device`` as for :func:`encode_device`."""
    from kvstore.cuda.device import DeviceBuffer, on_device, require_lib

    lib = require_lib()
    shape = tuple(int(d) for d in shape)
    if not _is_fp8(codec, dtype):
        raise ValueError(f"decode_device handles FP8 codecs into float dtypes, got "
                         f"{codec:#x} -> {dtype}")
    sg, scales, codes = _parse(codec, payload, dtype, shape)
    rg = sg.row_group.nbytes
    with on_device(device, lib), DeviceBuffer(rg + sg.n + codes.size, lib) as buf:
        buf.upload(sg.row_group, stream)
        if sg.n:
            buf.upload(np.ascontiguousarray(scales), stream, offset=rg)
        buf.upload(np.ascontiguousarray(codes), stream, offset=rg + sg.n)
        lib.call("kvc_fp8_decode", buf.ptr + rg + sg.n, buf.ptr + rg, buf.ptr, sg.rows,
                 sg.head_dim, codec & 0x0F, _DTYPE_CODE[dtype], out_ptr, stream)
        lib.call("kvc_stream_synchronize", stream)


def decode(codec: int, payload: codecs.Payload, dtype: torch.dtype, shape: tuple[int, ...],
           device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`kvstore.codecs.pipeline.decode` onto ``device``: FP8 payloads are dequantised by the
    kernel straight into a CUDA tensor when the library is usable, else on the CPU."""
    device = torch.device(device)
    if device.type == "cuda" and runtime().usable and _is_fp8(codec, dtype):
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        stream = int(torch.cuda.current_stream(device).cuda_stream)
        decode_device(codec, payload, dtype, tuple(shape), out.data_ptr(), stream,
                      cuda_index(device))
        return out
    return codecs.decode(codec, payload, dtype, tuple(shape)).to(device)


