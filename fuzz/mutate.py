"""Structure-aware mutation: start from a valid encoding, damage it, optionally re-seal it.

Random bytes almost never get past a decoder's magic and CRC checks, so the checks
*behind* them (version, header_len/ndim, geometry, field extraction) would go
untested.  Here a fuzz input is read as a recipe instead: the fields of a valid
structure, then a short program of mutations (bit flip, byte set, "interesting"
boundary value written into a named field, truncation, extension, overwrite, CRC
recomputation).  Recomputing the CRC after damaging a field is what lets a mutated
header reach the post-checksum checks.  The same :class:`Op` values are produced by
:func:`ops_from` (for atheris, from raw bytes) and by Hypothesis strategies in
``tests/test_fuzz.py``, and applied by the one function :func:`apply_ops`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from fuzz import spec

FLIP, SET, INTERESTING, TRUNCATE, EXTEND, OVERWRITE, FIX_CRC = range(7)
N_KINDS = 7
MAX_CHUNK = 16
MAX_OPS = 16

INTERESTING_INTS: dict[int, tuple[int, ...]] = {
    1: (0, 1, 2, 7, 8, 9, 0x7F, 0x80, 0xFE, 0xFF),
    2: (0, 1, 2, 255, 256, 257, 0x7FFF, 0x8000, 0xFFFF),
    4: (0, 1, 4095, 4096, 4097, 2**31 - 1, 2**31, 2**32 - 1),
    8: (0, 1, 255, 256, 4095, 4096, 4097, 2**32, 2**63 - 1, 2**63, 2**64 - 1),
}
"""Boundary values per field width: off-by-one around the limits the decoders check
(ndim 8/9, header_len 256, PAGE multiples) and around integer widths."""


ByteOrder = Literal["little", "big"]


class Op(NamedTuple):
    """One mutation.  ``a``/``b`` are reduced modulo the buffer or table size when applied,
    so any integers are valid (the fuzzer need not know the buffer's length)."""

    kind: int
    a: int = 0
    b: int = 0
    data: bytes = b""


@dataclass(frozen=True)
class Layout:
    """What a mutator needs to know about a structure: its fields and how to re-seal it."""

    name: str
    fields: tuple[tuple[int, int, ByteOrder], ...]  # (offset, size, byte order)
    fix_crc: Callable[[bytearray], None] | None = None


def _seal_slot(buf: bytearray) -> None:
    if len(buf) >= spec.SLOT_HEADER_BYTES:
        buf[spec.SLOT_CRC_AT:spec.SLOT_HEADER_BYTES] = \
            spec.crc32c(buf[:spec.SLOT_CRC_AT]).to_bytes(4, "little")


def _seal_extent(buf: bytearray) -> None:
    if len(buf) >= spec.EXTENT_RECORD_BYTES:
        buf[spec.EXTENT_CRC_AT:spec.EXTENT_RECORD_BYTES] = \
            spec.crc32c(buf[:spec.EXTENT_CRC_AT]).to_bytes(4, "little")


SLOT_LAYOUT = Layout(
    "slot_header",
    ((0, 4, "little"), (4, 2, "little"), (6, 2, "little"), (8, 16, "little"),
     (24, 16, "little"), (40, 1, "little"), (41, 1, "little"), (42, 1, "little"),
     (43, 1, "little"), (44, 4, "little"), (48, 8, "little"), (56, 8, "little"),
     (64, 8, "little"), *((72 + 8 * i, 8, "little") for i in range(8)),
     (136, 116, "little"), (252, 4, "little")),
    _seal_slot,
)
EXTENT_LAYOUT = Layout(
    "extent_header",
    ((0, 4, "little"), (4, 2, "little"), (6, 2, "little"), (8, 4, "little"),
     (12, 8, "little"), (20, 16, "little"), (36, 4, "little"), (40, 8, "little"),
     (4088, 8, "little")),
    _seal_extent,
)
INDEX_LAYOUT = Layout(
    "index_entry",
    ((0, 1, "little"), (1, 1, "little"), (2, 1, "little"), (3, 1, "little"),
     (4, 4, "little"), (8, 8, "little"), (16, 8, "little"), (24, 8, "little"),
     (32, 8, "little"), (40, 4, "little"), (44, 8, "little"), (52, 8, "little"),
     (60, 16, "little")),
)
EXTENT_KEY_LAYOUT = Layout("extent_key", ((0, 4, "big"),))
FREE_KEY_LAYOUT = Layout("free_key", ((0, 4, "big"), (4, 8, "big")))
U64_LAYOUT = Layout("u64", ((0, 8, "little"), (0, 4, "little"), (4, 4, "little")))
TEXT_LAYOUT = Layout("text", ())


def apply_ops(seed: bytes, ops: Sequence[Op], layout: Layout) -> bytes:
    """Apply ``ops`` in order to a copy of ``seed``; never raises for any op values."""
    buf = bytearray(seed)
    for op in ops:
        kind = op.kind % N_KINDS
        if kind == FLIP and buf:
            buf[op.a % len(buf)] ^= 1 << (op.b % 8)
        elif kind == SET and buf:
            buf[op.a % len(buf)] = op.b & 0xFF
        elif kind == INTERESTING and layout.fields:
            offset, size, order = layout.fields[op.a % len(layout.fields)]
            if offset + size <= len(buf):
                values = INTERESTING_INTS.get(size)
                if values is None:  # byte-string field: all zeros, all ones or a pattern
                    fill = (b"\x00", b"\xff", b"\x01")[op.b % 3]
                    buf[offset:offset + size] = fill * size
                else:
                    value = values[op.b % len(values)]
                    buf[offset:offset + size] = value.to_bytes(size, order)
        elif kind == TRUNCATE:  # odd b: cut anywhere; even b: drop a short tail only
            keep = op.a % (len(buf) + 1) if op.b & 1 else len(buf) - op.a % (MAX_CHUNK + 1)
            del buf[max(keep, 0):]
        elif kind == EXTEND:
            buf += op.data[:MAX_CHUNK]
        elif kind == OVERWRITE and buf:
            pos = op.a % len(buf)
            chunk = op.data[:MAX_CHUNK][: len(buf) - pos]
            buf[pos:pos + len(chunk)] = chunk
        elif kind == FIX_CRC and layout.fix_crc is not None:
            layout.fix_crc(buf)
    return bytes(buf)


class Reader:
    """Consumes a fuzz input as fixed-width fields, padding with zeros once exhausted,
    so every input (even empty) maps to a valid seed and a well-formed op list."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    @property
    def remaining(self) -> int:
        return len(self._data) - self._pos

    def take(self, n: int) -> bytes:
        chunk = self._data[self._pos:self._pos + n]
        self._pos += len(chunk)
        return chunk.ljust(n, b"\0")

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")


def ops_from(reader: Reader) -> list[Op]:
    """Decode the rest of a fuzz input into at most :data:`MAX_OPS` mutations."""
    ops: list[Op] = []
    while reader.remaining and len(ops) < MAX_OPS:
        kind, a, b = reader.uint(1) % N_KINDS, reader.uint(2), reader.uint(1)
        data = reader.take(reader.uint(1) % (MAX_CHUNK + 1)) if kind in (EXTEND, OVERWRITE) \
            else b""
        ops.append(Op(kind, a, b, data))
    return ops
