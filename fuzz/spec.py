"""Reference decoders written from FORMAT.md alone, to compare kvstore's decoders with.

A fuzz target that only checks "no foreign exception" would accept a decoder that
returns garbage, or raises ``CorruptionError`` where the spec says
``FormatVersionError`` (the store treats those differently: quarantine vs. refuse).
These oracles re-derive the expected outcome of every input from the byte tables in
FORMAT.md with plain slicing and ``int.from_bytes`` (no ``struct`` format strings
shared with ``kvstore.disk.format``), in the order of checks FORMAT.md documents.  Each
returns either the value the decoder must produce or the error class it must raise.
"""

from __future__ import annotations

import crc32c as _crc32c

from kvstore.disk.format import ExtentHeader, IndexEntry, SlotHeader
from kvstore.errors import CorruptionError, FormatVersionError, KVStoreError

Expected = object
"""The decoded value, or a ``type[KVStoreError]`` the decoder must raise."""

PAGE = 4096
SLOT_HEADER_BYTES = 256
SLOT_CRC_AT = 252
EXTENT_RECORD_BYTES = 40
EXTENT_CRC_AT = 36
INDEX_ENTRY_BYTES = 76
MAX_NDIM = 8
FORMAT_VERSION = 1
INDEX_ENTRY_VERSION = 1
HAS_PARENT = 0x01


def crc32c(data: bytes | bytearray) -> int:
    """CRC32C straight from the ``crc32c`` package, not through ``kvstore.disk.format``."""
    return int(_crc32c.crc32c(bytes(data)))


def le(buf: bytes, start: int, end: int) -> int:
    return int.from_bytes(buf[start:end], "little")


def be(buf: bytes, start: int, end: int) -> int:
    return int.from_bytes(buf[start:end], "big")


def slot_header(buf: bytes) -> Expected:
    """FORMAT.md "Slot header": length, magic, CRC, version, header_len and ndim."""
    if len(buf) < SLOT_HEADER_BYTES:
        return CorruptionError
    raw = buf[:SLOT_HEADER_BYTES]
    if raw[:4] != b"KVSB":
        return CorruptionError
    if crc32c(raw[:SLOT_CRC_AT]) != le(raw, SLOT_CRC_AT, SLOT_HEADER_BYTES):
        return CorruptionError
    if le(raw, 4, 6) != FORMAT_VERSION:
        return FormatVersionError
    ndim = raw[43]
    if le(raw, 6, 8) != SLOT_HEADER_BYTES or ndim > MAX_NDIM:
        return CorruptionError
    return SlotHeader(
        key=raw[8:24],
        parent=raw[24:40] if raw[40] & HAS_PARENT else None,
        codec=raw[41],
        dtype=raw[42],
        shape=tuple(le(raw, 72 + 8 * i, 80 + 8 * i) for i in range(ndim)),
        payload_len=le(raw, 48, 56),
        raw_len=le(raw, 56, 64),
        payload_crc=le(raw, 44, 48),
        seq=le(raw, 64, 72),
    )


def extent_header(buf: bytes) -> Expected:
    """FORMAT.md "Extent header": whole page, zero padding, magic, CRC, version."""
    if len(buf) < PAGE:
        return CorruptionError
    if any(buf[EXTENT_RECORD_BYTES:PAGE]):
        return CorruptionError
    if buf[:4] != b"KVSX":
        return CorruptionError
    if crc32c(buf[:EXTENT_CRC_AT]) != le(buf, EXTENT_CRC_AT, EXTENT_RECORD_BYTES):
        return CorruptionError
    if le(buf, 4, 6) != FORMAT_VERSION:
        return FormatVersionError
    return ExtentHeader(extent_id=le(buf, 8, 12), extent_bytes=le(buf, 12, 20),
                        store_uuid=buf[20:36])


def index_entry(buf: bytes) -> Expected:
    """FORMAT.md "IndexEntry": exact length, version, then slot geometry."""
    if len(buf) != INDEX_ENTRY_BYTES:
        return CorruptionError
    if buf[0] != INDEX_ENTRY_VERSION:
        return FormatVersionError
    offset, slot_len, payload_len = le(buf, 8, 16), le(buf, 16, 24), le(buf, 24, 32)
    if offset < PAGE or offset % PAGE or slot_len % PAGE or slot_len == 0 \
            or SLOT_HEADER_BYTES + payload_len > slot_len:
        return CorruptionError
    return IndexEntry(
        extent=le(buf, 4, 8), offset=offset, slot_len=slot_len, payload_len=payload_len,
        raw_len=le(buf, 32, 40), codec=buf[1], dtype=buf[2], payload_crc=le(buf, 40, 44),
        seq=le(buf, 44, 52), last_use=le(buf, 52, 60),
        parent=buf[60:76] if buf[3] & HAS_PARENT else None,
    )


def extent_key(buf: bytes) -> Expected:
    """FORMAT.md "Index": ``extents`` key, u32 big-endian."""
    return be(buf, 0, 4) if len(buf) == 4 else CorruptionError


def free_key(buf: bytes) -> Expected:
    """FORMAT.md "Index": ``free`` key, u32 BE extent then u64 BE offset."""
    return (be(buf, 0, 4), be(buf, 4, 12)) if len(buf) == 12 else CorruptionError


def u64(buf: bytes) -> Expected:
    """FORMAT.md "Meta records" / ``extents`` / ``free`` values: u64 little-endian."""
    return le(buf, 0, 8) if len(buf) == 8 else CorruptionError


def check_outcome(name: str, data: bytes, expected: Expected, got: object) -> None:
    """Fail loudly (AssertionError, a crash to atheris) unless ``got`` matches the spec."""
    if isinstance(expected, type) and issubclass(expected, KVStoreError):
        assert isinstance(got, expected), (
            f"{name}: FORMAT.md says {expected.__name__}, decoder gave {got!r} "
            f"for input {data.hex()}")
    else:
        assert not isinstance(got, KVStoreError) and got == expected, (
            f"{name}: FORMAT.md says {expected!r}, decoder gave {got!r} for input {data.hex()}")
