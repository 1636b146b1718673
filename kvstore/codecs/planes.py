"""The zstd stage: one compressor and decompressor per thread, the stage over FP8
codes, and lossless byte planes for float bytes.

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
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import torch
import zstandard

from kvstore.codecs.fp8 import PAYLOAD_VERSION
from kvstore.codecs.spec import U8, ZSTD, ZSTD_LEVEL, as_bytes_u8, finish, prepare_out
from kvstore.errors import CorruptionError

__all__ = ["decode_planes", "decompress", "encode_planes", "zstd_stage"]


def encode_planes(raw: U8, itemsize: int) -> U8 | None:
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
    struct.pack_into("<BBH", out.data, 0, PAYLOAD_VERSION, itemsize, 0)
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


def zstd_stage(base: int, payload: U8, head: int) -> tuple[int, U8]:
    """An FP8 payload (its first ``head`` bytes are header and scales) with its codes
    zstd-compressed, or as it is when that does not make it smaller."""
    frame = _cctx().compress(payload[head:].data)
    if head + len(frame) < payload.size:
        return base | ZSTD, np.concatenate([payload[:head], np.frombuffer(frame, np.uint8)])
    return base, payload


def decompress(frame: U8, size: int) -> U8:
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


def decode_planes(data: U8, dtype: torch.dtype, shape: tuple[int, ...],
                   out: torch.Tensor | None) -> torch.Tensor:
    ret, work = prepare_out(out, dtype, shape)
    isz = work.element_size()
    numel = work.numel()
    if data.size < 4:
        raise CorruptionError("zstd payload truncated")
    version, nplanes, reserved = struct.unpack_from("<BBH", data.data, 0)
    if version != PAYLOAD_VERSION or reserved or nplanes != isz or numel == 0:
        raise CorruptionError(
            f"bad zstd payload header (version {version}, {nplanes} planes for "
            f"{isz}-byte elements, numel {numel})")
    table = 4 + 8 * nplanes
    if data.size < table:
        raise CorruptionError("zstd payload plane table truncated")
    pos = table
    dst = as_bytes_u8(work).reshape(numel, isz)
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
            plane = decompress(chunk, numel)
        dst[:, i] = plane
    if pos != data.size:
        raise CorruptionError(f"zstd payload has {data.size - pos} trailing bytes")
    return finish(ret, work)
