"""Encoders and decoders for every structure kvstore puts on disk.

FORMAT.md (repository root) is the specification; this module is its only
implementation.  Every decoder validates lengths, magic, version and CRC32C before
trusting a field and raises :class:`~kvstore.errors.CorruptionError` or
:class:`~kvstore.errors.FormatVersionError`, nothing else (the fuzz targets hold it to
that).  All integers are little-endian except LMDB keys, which are big-endian so that
LMDB's byte order is numeric order.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

import crc32c as _crc32c

from kvstore.errors import CorruptionError, FormatVersionError

FORMAT_VERSION = 2
"""Version of the store's format written by this build: the index's tables and meta
records (the ``format_version`` meta record).  Bumped whenever old builds could misread
new stores.  2: the free-space counters and the ``claims``/``pending`` tables of stores
shared by several processes (issue 43); a version-1 store is upgraded in place by the
first open (kvstore/index/space_counters.py)."""

SLOT_VERSION = 1
"""Version of the slot and extent headers (their ``version`` field); format 2 did not
change them."""

PAGE = 4096
"""Alignment of every slot, extent header and O_DIRECT transfer."""

KEY_BYTES = 16
NO_PARENT = bytes(KEY_BYTES)
MAX_NDIM = 8


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli), hardware-accelerated where the CPU has it."""
    return int(_crc32c.crc32c(data, value))


def _check_len(name: str, value: bytes, n: int) -> None:
    if len(value) != n:
        raise ValueError(f"{name} must be {n} bytes, got {len(value)}")


def round_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


# --------------------------------------------------------------------------- slot header

SLOT_MAGIC = b"KVSB"
SLOT_HEADER_BYTES = 256
# magic, version, header_len, key, parent, flags, codec, dtype, ndim, payload_crc,
# payload_len, raw_len, seq, shape[8]
_SLOT = struct.Struct("<4sHH16s16sBBBBIQQQ8Q")
_SLOT_CRC_AT = SLOT_HEADER_BYTES - 4
assert _SLOT.size <= _SLOT_CRC_AT

SLOT_FLAG_HAS_PARENT = 0x01


@dataclass(frozen=True, slots=True)
class SlotHeader:
    """The self-describing header at the start of every slot (FORMAT.md, "Slot")."""

    key: bytes
    parent: bytes | None
    codec: int
    dtype: int
    shape: tuple[int, ...]
    payload_len: int
    raw_len: int
    payload_crc: int
    seq: int

    @property
    def slot_len(self) -> int:
        return round_up(SLOT_HEADER_BYTES + self.payload_len)

    def encode(self) -> bytes:
        _check_len("key", self.key, KEY_BYTES)
        if self.parent is not None:
            _check_len("parent", self.parent, KEY_BYTES)
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"at most {MAX_NDIM} dimensions")
        flags = SLOT_FLAG_HAS_PARENT if self.parent is not None else 0
        dims = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        body = _SLOT.pack(
            SLOT_MAGIC, SLOT_VERSION, SLOT_HEADER_BYTES, self.key,
            self.parent if self.parent is not None else NO_PARENT,
            flags, self.codec, self.dtype, len(self.shape), self.payload_crc,
            self.payload_len, self.raw_len, self.seq, *dims,
        ).ljust(_SLOT_CRC_AT, b"\0")
        return body + struct.pack("<I", crc32c(body))

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> SlotHeader:
        """Parse and verify a slot header; ``buf`` must hold at least its 256 bytes."""
        if len(buf) < SLOT_HEADER_BYTES:
            raise CorruptionError(f"slot header truncated: {len(buf)} of {SLOT_HEADER_BYTES} bytes")
        raw = bytes(buf[:SLOT_HEADER_BYTES])
        if raw[:4] != SLOT_MAGIC:
            raise CorruptionError(f"bad slot magic {raw[:4]!r} (expected {SLOT_MAGIC!r})")
        (stored_crc,) = struct.unpack_from("<I", raw, _SLOT_CRC_AT)
        if crc32c(raw[:_SLOT_CRC_AT]) != stored_crc:
            raise CorruptionError("slot header checksum mismatch")
        (_, version, header_len, key, parent, flags, codec, dtype, ndim, payload_crc,
         payload_len, raw_len, seq, *dims) = _SLOT.unpack_from(raw)
        if version != SLOT_VERSION:
            raise FormatVersionError(
                f"slot written by format version {version}; this build reads {SLOT_VERSION}")
        if header_len != SLOT_HEADER_BYTES or ndim > MAX_NDIM:
            raise CorruptionError(f"bad slot header_len={header_len} ndim={ndim}")
        return cls(
            key=key,
            parent=parent if flags & SLOT_FLAG_HAS_PARENT else None,
            codec=codec, dtype=dtype, shape=tuple(dims[:ndim]),
            payload_len=payload_len, raw_len=raw_len, payload_crc=payload_crc, seq=seq,
        )


# --------------------------------------------------------------------------- extent header

EXTENT_MAGIC = b"KVSX"
EXTENT_HEADER_BYTES = PAGE
# magic, version, extent_id, extent_bytes, store uuid
_EXTENT = struct.Struct("<4sHxxIQ16s")


@dataclass(frozen=True, slots=True)
class ExtentHeader:
    """First page of every extent file (FORMAT.md, "Extent file")."""

    extent_id: int
    extent_bytes: int
    store_uuid: bytes

    def encode(self) -> bytes:
        _check_len("store_uuid", self.store_uuid, 16)
        body = _EXTENT.pack(EXTENT_MAGIC, SLOT_VERSION, self.extent_id, self.extent_bytes,
                            self.store_uuid)
        return (body + struct.pack("<I", crc32c(body))).ljust(EXTENT_HEADER_BYTES, b"\0")

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> ExtentHeader:
        n = _EXTENT.size
        if len(buf) < EXTENT_HEADER_BYTES:
            raise CorruptionError(f"extent header truncated: {len(buf)} of {EXTENT_HEADER_BYTES} bytes")
        raw = bytes(buf[: n + 4])
        if any(bytes(buf[n + 4:EXTENT_HEADER_BYTES])):
            raise CorruptionError("extent header padding is not zero")
        magic, version, extent_id, extent_bytes, store_uuid = _EXTENT.unpack_from(raw)
        if magic != EXTENT_MAGIC:
            raise CorruptionError(f"bad extent magic {magic!r}")
        if crc32c(raw[:n]) != struct.unpack_from("<I", raw, n)[0]:
            raise CorruptionError("extent header checksum mismatch")
        if version != SLOT_VERSION:
            raise FormatVersionError(
                f"extent written by format version {version}; this build reads {SLOT_VERSION}")
        return cls(extent_id, extent_bytes, store_uuid)


# --------------------------------------------------------------------------- index value

INDEX_ENTRY_VERSION = 1
# version, codec, dtype, flags, extent, offset, slot_len, payload_len, raw_len, crc, seq,
# last_use, parent
_ENTRY = struct.Struct("<BBBBIQQQQIQQ16s")


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Value stored in the LMDB ``blocks`` table under a block key (FORMAT.md, "Index")."""

    extent: int
    offset: int
    slot_len: int
    payload_len: int
    raw_len: int
    codec: int
    dtype: int
    payload_crc: int
    seq: int
    last_use: int
    parent: bytes | None

    def encode(self) -> bytes:
        if self.parent is not None:
            _check_len("parent", self.parent, KEY_BYTES)
        flags = SLOT_FLAG_HAS_PARENT if self.parent is not None else 0
        return _ENTRY.pack(
            INDEX_ENTRY_VERSION, self.codec, self.dtype, flags, self.extent, self.offset,
            self.slot_len, self.payload_len, self.raw_len, self.payload_crc, self.seq,
            self.last_use, self.parent if self.parent is not None else NO_PARENT,
        )

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> IndexEntry:
        if len(buf) != _ENTRY.size:
            raise CorruptionError(f"index entry of {len(buf)} bytes (expected {_ENTRY.size})")
        (version, codec, dtype, flags, extent, offset, slot_len, payload_len, raw_len, crc,
         seq, last_use, parent) = _ENTRY.unpack(bytes(buf))
        if version != INDEX_ENTRY_VERSION:
            raise FormatVersionError(f"index entry version {version}; this build reads "
                                     f"{INDEX_ENTRY_VERSION}")
        if offset < PAGE or offset % PAGE or slot_len % PAGE or slot_len == 0 or \
                SLOT_HEADER_BYTES + payload_len > slot_len:
            raise CorruptionError(
                f"index entry with bad geometry offset={offset} slot_len={slot_len} "
                f"payload_len={payload_len}")
        return cls(extent, offset, slot_len, payload_len, raw_len, codec, dtype, crc, seq,
                   last_use, parent if flags & SLOT_FLAG_HAS_PARENT else None)


ENTRY_FLAG_UNREADABLE = 0x02
"""Bit 1 of an IndexEntry's flags, set in ``quarantine`` records only: the block could
not be read (an I/O error, a short read, a missing extent file): a suspicion, read
again later, not a failed verification.  Safe for older builds, which ignore flag bits
they do not know (FORMAT.md, "IndexEntry")."""
_FLAGS_AT = 3


def encode_quarantined(entry: IndexEntry, unreadable: bool) -> bytes:
    """A ``quarantine`` record: the entry, with ENTRY_FLAG_UNREADABLE when ``unreadable``."""
    raw = bytearray(entry.encode())
    if unreadable:
        raw[_FLAGS_AT] |= ENTRY_FLAG_UNREADABLE
    return bytes(raw)


def quarantined_unreadable(raw: bytes | memoryview) -> bool:
    """Whether a ``quarantine`` record says "could not be read" (ENTRY_FLAG_UNREADABLE)."""
    return len(raw) > _FLAGS_AT and bool(raw[_FLAGS_AT] & ENTRY_FLAG_UNREADABLE)


# --------------------------------------------------------------------------- LMDB keys

_EXTENT_KEY = struct.Struct(">I")
_LRU_KEY = struct.Struct(">Q16s")
_COUNT = struct.Struct("<I")


def lru_key(last_use: int, key: bytes) -> bytes:
    """Key of the ``lru`` table: oldest use first, ties broken by block key."""
    return _LRU_KEY.pack(last_use, key)


def pack_count(n: int) -> bytes:
    return _COUNT.pack(n)


def unpack_count(buf: bytes) -> int:
    if len(buf) != _COUNT.size:
        raise CorruptionError(f"expected a 4-byte count, got {len(buf)} bytes")
    return int(_COUNT.unpack(buf)[0])
_FREE_KEY = struct.Struct(">IQ")


def extent_key(extent: int) -> bytes:
    return _EXTENT_KEY.pack(extent)


def decode_extent_key(key: bytes) -> int:
    if len(key) != _EXTENT_KEY.size:
        raise CorruptionError(f"extent key of {len(key)} bytes")
    return int(_EXTENT_KEY.unpack(key)[0])


def free_key(extent: int, offset: int) -> bytes:
    return _FREE_KEY.pack(extent, offset)


def decode_free_key(key: bytes) -> tuple[int, int]:
    if len(key) != _FREE_KEY.size:
        raise CorruptionError(f"free-map key of {len(key)} bytes")
    extent, offset = _FREE_KEY.unpack(key)
    return int(extent), int(offset)


def pack_u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def unpack_u64(buf: bytes) -> int:
    if len(buf) != 8:
        raise CorruptionError(f"expected an 8-byte integer, got {len(buf)} bytes")
    return int(struct.unpack("<Q", buf)[0])


def new_store_uuid() -> bytes:
    return uuid.uuid4().bytes
