"""ctypes binding for the compiled slot kernels (``kvstore/_native/slots.c``).

A put stages, and a get verifies, a whole chunk of slots in **one** foreign call: the
slot headers, CRC32C and the copies into / out of the arena run in C, and ctypes
releases the GIL for the call, so a chunk is staged or verified in parallel with the
event loop and other threads.  Python only packs one 160-byte descriptor per slot
(``_DESC``, the C struct ``kvs_slot``) and reads the results back.

The kernels are an optional speed-up of :mod:`kvstore.io.slots`: the install builds them
when a C compiler is present, and ``kvstore.io.slots`` falls back to its Python path (same
bytes on disk, same verification results and errors) when they are missing.
``KVSTORE_NATIVE_SLOTS=0`` in the environment turns them off, e.g. to rule them out
while debugging.

Their CRC32C has three paths (``crc_path()``): ``"pclmul"`` (carry-less multiply
folding), ``"crc32"`` (the SSE4.2 instruction on three streams) and ``"table"``
(slicing-by-8, any CPU).  Which hardware path is faster depends on the CPU model (on
Zen 1 folding is, on Intel and newer AMD the crc32 instruction can be), so the faster is
timed on 64 KiB when the library loads (well under a millisecond);
``KVSTORE_CRC32C=pclmul|crc32|table`` forces one (``auto``, the default, times them).
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from kvstore._native import lib as native_lib
from kvstore.codecs import pipeline as codecs
from kvstore.codecs.tensors import CODE_DTYPES
from kvstore.disk.format import (
    MAX_NDIM,
    NO_PARENT,
    SLOT_FLAG_HAS_PARENT,
    SLOT_HEADER_BYTES,
    SlotHeader,
)
from kvstore.errors import CorruptionError, FormatVersionError

if TYPE_CHECKING:
    import torch

    from kvstore.disk.format import IndexEntry
    from kvstore.io.arena import ArenaRun

__all__ = ["available", "reason", "hardware_crc", "crc_path", "crc_paths", "crc32c",
           "time_crc32c", "stage", "verify", "Verified"]

_ABI_VERSION = 3
_CRC_ENV = "KVSTORE_CRC32C"
class StagedSlot(Protocol):
    """What :func:`stage` needs of one block of a put (``kvstore.io.slots.PutItem`` is
    one): its own type here, so that this binding does not import the module that
    calls it."""

    key: bytes
    parent: bytes | None
    data: torch.Tensor
    dtype: int
    shape: tuple[int, ...]
    codec: int
    raw_len: int
    payload_len: int
    crc: int
    seq: int
    encoded: codecs.Encoded | None


# The `path` argument of the C functions (enum in slots.c; 0 = the selected path).
_CRC_PATHS = {"table": 1, "crc32": 2, "pclmul": 3}
_CRC_NAMES = {v: k for k, v in _CRC_PATHS.items()}
_CRC_WORDS = {"table": "slicing-by-8 tables", "crc32": "SSE4.2 crc32",
              "pclmul": "PCLMULQDQ folding"}
# slot, data, slot_len, payload_len, raw_len, seq, shape[8], key, parent, flags, codec,
# dtype, ndim, crc, status, options -- the C struct kvs_slot, field for field.
_DESC = struct.Struct("<6Q8Q16s16sBBBBIiI")
_CRC = struct.Struct("<I")
_CRC_AT = 148               # offset of `crc` in a descriptor
assert _DESC.size == 160
_FRESH_DST, _COPIED = 1, 2
_ZEROS = (0,) * MAX_NDIM

# Status codes of kvs_verify (enum in slots.c).
_OK, _EARGS, _EHDR_TRUNCATED, _EMAGIC, _EHDR_CRC, _EVERSION, _EHDR_LEN = range(7)
_EUNKNOWN, _EOTHER_BLOCK, _EENTRY, _EPAYLOAD_TRUNCATED, _EPAYLOAD_CRC = range(7, 12)

_lib: ctypes.CDLL | None = None
_reason = "not loaded yet"
_known_codec = ctypes.create_string_buffer(bytes(codecs.is_known(i) for i in range(256)), 256)
_known_dtype = ctypes.create_string_buffer(bytes(i in CODE_DTYPES for i in range(256)), 256)


def _load() -> None:
    global _lib, _reason
    lib, _reason = native_lib.load(
        "_slots", "KVSTORE_NATIVE_SLOTS", "kvs_slots_abi_version", _ABI_VERSION,
        "compiled slot kernels not built (no C compiler at install time?); staging and "
        "verification run in Python")
    if lib is None:
        return
    vp, i64, u32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int
    lib.kvs_crc32c_path.restype = c_int
    lib.kvs_crc32c_supported.argtypes = [c_int]
    lib.kvs_crc32c_supported.restype = c_int
    lib.kvs_crc32c_select.argtypes = [c_int]
    lib.kvs_crc32c_select.restype = c_int
    lib.kvs_crc32c_calibrated.argtypes = [c_int]
    lib.kvs_crc32c_calibrated.restype = ctypes.c_double
    lib.kvs_crc32c_time.argtypes = [c_int, vp, vp, ctypes.c_size_t, i64]
    lib.kvs_crc32c_time.restype = ctypes.c_double
    lib.kvs_crc32c.argtypes = [u32, vp, ctypes.c_size_t, c_int]
    lib.kvs_crc32c.restype = u32
    lib.kvs_crc32c_copy.argtypes = [u32, vp, vp, ctypes.c_size_t, c_int]
    lib.kvs_crc32c_copy.restype = u32
    lib.kvs_stage.argtypes = [vp, i64]
    lib.kvs_stage.restype = i64
    lib.kvs_verify.argtypes = [vp, i64, vp, vp]
    lib.kvs_verify.restype = i64
    _lib = lib
    _reason = f"compiled slot kernels ({_reason}, {_select_crc(lib)})"


def _select_crc(lib: ctypes.CDLL) -> str:
    """Select the CRC32C path (``KVSTORE_CRC32C``, else the faster one timed now) and
    say which, and why, for ``reason()``."""
    want = os.environ.get(_CRC_ENV, "auto")
    if want not in ("auto", *_CRC_PATHS):
        raise ValueError(f"{_CRC_ENV}={want!r} is not a CRC32C path: use auto, "
                         f"{', '.join(_CRC_PATHS)} (or unset it)")
    if want != "auto" and not lib.kvs_crc32c_supported(_CRC_PATHS[want]):
        raise ValueError(f"{_CRC_ENV}={want}: this CPU cannot run that CRC32C path; use "
                         f"auto or one of {', '.join(crc_paths(lib))}")
    path = _CRC_NAMES[lib.kvs_crc32c_select(_CRC_PATHS.get(want, 0))]
    if want != "auto":
        return f"CRC32C by {_CRC_WORDS[path]}, forced by {_CRC_ENV}"
    timed = [f"{name} {lib.kvs_crc32c_calibrated(n):.1f}" for name, n in _CRC_PATHS.items()
             if lib.kvs_crc32c_calibrated(n) > 0]
    if not timed:
        return f"CRC32C by {_CRC_WORDS[path]}"
    return f"CRC32C by {_CRC_WORDS[path]}, timed faster at load ({', '.join(timed)} GB/s)"


_load()


def available() -> bool:
    """Whether the compiled kernels are loaded (else ``kvstore.io.slots`` runs in Python)."""
    return _lib is not None


def reason() -> str:
    """Which staging path the store uses, and why (for ``stats()`` and bug reports)."""
    return _reason


def hardware_crc() -> bool:
    """Whether the kernels' CRC32C uses the CPU's crc32 or carry-less multiply
    instructions (else it is the table path)."""
    return _lib is not None and crc_path() != "table"


def crc_path() -> str:
    """The kernels' CRC32C path: ``"pclmul"``, ``"crc32"`` or ``"table"``."""
    assert _lib is not None
    return _CRC_NAMES[_lib.kvs_crc32c_path()]


def crc_paths(lib: ctypes.CDLL | None = None) -> list[str]:
    """The CRC32C paths this CPU runs (``crc32c(path=...)`` takes each)."""
    lib = lib or _lib
    assert lib is not None
    return [name for name, n in _CRC_PATHS.items() if lib.kvs_crc32c_supported(n)]


def _path_arg(path: str | None) -> int:
    if path is None:
        return 0
    assert _lib is not None
    if path not in _CRC_PATHS or not _lib.kvs_crc32c_supported(_CRC_PATHS[path]):
        raise ValueError(f"CRC32C path {path!r} is not one this CPU runs: {crc_paths()}")
    return _CRC_PATHS[path]


def _address(buf: bytes | bytearray | memoryview | np.ndarray) -> tuple[int, int, object]:
    """(address, length, keep-alive) of a contiguous buffer, read-only ones included."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else \
        np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return int(arr.ctypes.data), arr.size, arr


def _copy_address(copy_to: np.ndarray | None, n: int) -> int | None:
    if copy_to is None:
        return None
    if copy_to.dtype != np.uint8 or copy_to.size != n or not copy_to.flags.c_contiguous \
            or not copy_to.flags.writeable:
        raise ValueError(f"copy_to must be {n} writable contiguous uint8")
    return int(copy_to.ctypes.data)


def crc32c(data: bytes | bytearray | memoryview | np.ndarray, value: int = 0, *,
           path: str | None = None, copy_to: np.ndarray | None = None) -> int:
    """CRC32C of ``data`` continuing ``value``, as ``crc32c.crc32c(data, value)``;
    ``path`` (one of ``crc_paths()``) takes that path instead of the selected one and
    ``copy_to`` (a writable uint8 array of the same length) receives a copy made in the
    same pass."""
    assert _lib is not None
    addr, n, keep = _address(data)
    dst = _copy_address(copy_to, n)
    if dst is None:
        result = int(_lib.kvs_crc32c(value, addr, n, _path_arg(path)))
    else:
        result = int(_lib.kvs_crc32c_copy(value, addr, dst, n, _path_arg(path)))
    del keep
    return result


def time_crc32c(data: np.ndarray, calls: int, *, path: str | None = None,
                copy_to: np.ndarray | None = None) -> float:
    """Seconds ``calls`` back-to-back ``crc32c(data, path=path, copy_to=copy_to)`` take,
    timed in C (no Python call overhead; for benchmarks/crc_speed.py)."""
    assert _lib is not None
    addr, n, keep = _address(data)
    seconds = float(_lib.kvs_crc32c_time(_path_arg(path), addr, _copy_address(copy_to, n),
                                         n, calls))
    del keep
    return seconds


def _run_address(run: ArenaRun) -> int:
    return run.arena.address + run.offset


def stage(chunk: Sequence[tuple[StagedSlot, ArenaRun]]) -> None:
    """Stage every slot of ``chunk`` (same bytes as ``kvstore.io.slots.stage``) in one call:
    encoded payloads are first written into their runs by the codec, raw ones are copied
    by the kernel, which checksums the staged bytes in the same pass."""
    assert _lib is not None
    if not chunk:
        return
    descs = ctypes.create_string_buffer(len(chunk) * _DESC.size)
    for i, (item, run) in enumerate(chunk):
        n = item.payload_len
        if item.encoded is not None:
            item.encoded.write_into(run.array[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + n])
            item.encoded = None            # drop the reference to the caller's tensor
            src = 0                        # already in place: checksum it there
        else:
            data = item.data
            if data.device.type != "cpu" or not data.is_contiguous() or data.nbytes != n:
                raise ValueError(f"block data must be {n} contiguous CPU bytes, got "
                                 f"{data.nbytes} on {data.device}")
            src = data.data_ptr() if n else 0
        if len(item.shape) > MAX_NDIM:
            raise ValueError(f"at most {MAX_NDIM} dimensions")
        parent = item.parent
        _DESC.pack_into(
            descs, i * _DESC.size, _run_address(run), src, run.length, n, item.raw_len,
            item.seq, *item.shape, *_ZEROS[len(item.shape):], item.key,
            NO_PARENT if parent is None else parent,
            0 if parent is None else SLOT_FLAG_HAS_PARENT, item.codec, item.dtype,
            len(item.shape), 0, 0, 0)
    if _lib.kvs_stage(ctypes.addressof(descs), len(chunk)):
        raise ValueError("a payload does not fit its arena run")
    for i, (item, _) in enumerate(chunk):
        (item.crc,) = _CRC.unpack_from(descs, i * _DESC.size + _CRC_AT)


class Verified(NamedTuple):
    """A slot that passed verification: the header fields its payload is decoded with,
    and whether the raw payload was already copied to the destination given."""

    codec: int
    dtype: int
    shape: tuple[int, ...]
    payload_len: int
    copied: bool


def verify(batch: Sequence[tuple[ArenaRun, bytes, IndexEntry, int, int, bool]]
           ) -> list[Verified | CorruptionError | FormatVersionError]:
    """Verify slots read into the arena against their index entries, in one call.

    Each element is ``(run, key, entry, dst, dst_len, fresh)``: a raw payload of exactly
    ``dst_len`` bytes is copied to address ``dst`` (0: verify only).  ``fresh`` says
    nobody sees ``dst`` unless the slot verifies, which lets the kernel copy and checksum
    in one pass; otherwise a corrupt payload never reaches ``dst``.  The checks and their
    order, and the errors, are those of ``kvstore.io.slots.check_slot`` and ``check_payload``.
    """
    assert _lib is not None
    if not batch:
        return []
    descs = ctypes.create_string_buffer(len(batch) * _DESC.size)
    for i, (run, key, entry, dst, dst_len, fresh) in enumerate(batch):
        _DESC.pack_into(
            descs, i * _DESC.size, _run_address(run), dst, run.length, entry.payload_len,
            dst_len, entry.seq, *_ZEROS, key, NO_PARENT, 0, entry.codec, entry.dtype, 0,
            entry.payload_crc, 0, _FRESH_DST if fresh else 0)
    _lib.kvs_verify(ctypes.addressof(descs), len(batch), _known_codec, _known_dtype)
    out: list[Verified | CorruptionError | FormatVersionError] = []
    for i, (run, *_rest) in enumerate(batch):
        (_, _, _, payload_len, _, seq, *dims, key, _, _, codec, dtype, ndim, _, status,
         options) = _DESC.unpack_from(descs, i * _DESC.size)
        if status == _OK:
            out.append(Verified(codec, dtype, tuple(dims[:ndim]), payload_len,
                                bool(options & _COPIED)))
        elif status <= _EHDR_LEN:
            out.append(_header_error(run))
        elif status == _EUNKNOWN:
            out.append(CorruptionError(f"slot has unknown codec {codec} or dtype {dtype}"))
        elif status == _EOTHER_BLOCK:
            out.append(CorruptionError(
                f"slot holds another block (key {key.hex()}, seq {seq})"))
        elif status == _EENTRY:
            out.append(CorruptionError("slot header disagrees with its index entry"))
        elif status == _EPAYLOAD_TRUNCATED:
            out.append(CorruptionError(
                f"payload checksum mismatch: the slot's {payload_len}-byte payload runs "
                f"past the {run.length} bytes read"))
        else:
            out.append(CorruptionError("payload checksum mismatch"))
    return out


def _header_error(run: ArenaRun) -> CorruptionError | FormatVersionError:
    """The error the Python decoder gives for a header the kernel refused (rare: a torn
    or foreign slot), so that both paths report it in the same words."""
    try:
        SlotHeader.decode(run.view)
    except (CorruptionError, FormatVersionError) as e:
        return e
    return CorruptionError("slot header refused by the compiled checker")
