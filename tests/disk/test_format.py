"""The binary structures of kvstore/disk/format.py against FORMAT.md.

The decoders are the store's first line of defence against torn writes, bit rot and
stores written by other releases: they must turn every damaged or foreign input into
CorruptionError or FormatVersionError, never into a wrong value.  The pinned vectors
make any change of the on-disk bytes a deliberate act (and a FORMAT_VERSION bump).
"""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore import open_blocking
from kvstore.codecs.tensors import DTYPE_CODES
from kvstore.disk.format import (
    EXTENT_HEADER_BYTES,
    FORMAT_VERSION,
    KEY_BYTES,
    MAX_NDIM,
    PAGE,
    SLOT_HEADER_BYTES,
    SLOT_VERSION,
    ExtentHeader,
    IndexEntry,
    SlotHeader,
    crc32c,
    decode_extent_key,
    decode_free_key,
    extent_key,
    free_key,
    pack_u64,
    round_up,
    unpack_u64,
)
from kvstore.errors import CorruptionError, FormatVersionError
from kvstore.keys import Namespace, chain_parents

FORMAT_MD = Path(__file__).resolve().parents[2] / "FORMAT.md"

U8 = st.integers(0, 2**8 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
KEYS = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)

EXTENT_RECORD_BYTES = 40  # magic .. header_crc; the rest of the page is padding

# ----------------------------------------------------------------- the worked example

NS = Namespace(model="example/llama-tiny", dtype="float16", block_size=4)
K0 = bytes.fromhex("782b070a2ad4030b8762ceac8ce20f2d")
K1 = bytes.fromhex("924cc38c6017b641e4da25a5e4381a17")
T1 = torch.arange(6, 12, dtype=torch.float16).reshape(2, 3)
T1_PAYLOAD = bytes.fromhex("004600470048804800498049")
T1_CRC = 0x71A75621

SLOT_HEADER_LINES = [  # as printed in FORMAT.md, "Test vectors" (e)
    "4b56534201000001924cc38c6017b641e4da25a5e4381a17782b070a2ad4030b",
    "8762ceac8ce20f2d010001022156a7710c000000000000000c00000000000000",
    "0200000000000000020000000000000003000000000000000000000000000000",
    "00000000000000000000000000000000000000000000000083d007d6",
]
SLOT_HEADER_HEX = "".join(SLOT_HEADER_LINES[:3]) + "00" * 132 + SLOT_HEADER_LINES[3]
EXAMPLE_SLOT = SlotHeader(key=K1, parent=K0, codec=0, dtype=1, shape=(2, 3), payload_len=12,
                          raw_len=12, payload_crc=T1_CRC, seq=2)

EXTENT_HEADER_HEX = ("4b56535801000000010000000000004000000000000102030405060708090a0b"
                     "0c0d0e0fa41bae3c")
EXAMPLE_EXTENT = ExtentHeader(extent_id=1, extent_bytes=1 << 30, store_uuid=bytes(range(16)))

INDEX_ENTRY_LINES = [
    "0100010101000000002000000000000000100000000000000c000000000000000c00000000000000",
    "2156a771020000000000000000401e18240a0600782b070a2ad4030b8762ceac8ce20f2d",
]
EXAMPLE_ENTRY = IndexEntry(extent=1, offset=8192, slot_len=4096, payload_len=12, raw_len=12,
                           codec=0, dtype=1, payload_crc=T1_CRC, seq=2,
                           last_use=1_700_000_000_000_000, parent=K0)


def with_crc(buf: bytearray, covered: int) -> bytes:
    """Recompute the header CRC so that only the deliberately changed field is wrong."""
    struct.pack_into("<I", buf, covered, crc32c(bytes(buf[:covered])))
    return bytes(buf)


def flip(buf: bytes, bit: int) -> bytes:
    out = bytearray(buf)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


# ----------------------------------------------------------------- constants and CRC

def test_layout_constants() -> None:
    """These numbers are the format; changing one needs a FORMAT_VERSION bump (the
    store's) or a SLOT_VERSION bump (the slot and extent headers')."""
    assert FORMAT_VERSION == 2
    assert SLOT_VERSION == 1
    assert PAGE == 4096
    assert SLOT_HEADER_BYTES == 256
    assert EXTENT_HEADER_BYTES == PAGE
    assert KEY_BYTES == 16
    assert MAX_NDIM == 8


def test_crc32c_is_castagnoli() -> None:
    """FORMAT.md names CRC-32C; its standard check value pins the variant."""
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283  # incremental form


@given(st.integers(0, 2**40))
def test_round_up(n: int) -> None:
    r = round_up(n)
    assert r % PAGE == 0 and n <= r < n + PAGE


def test_dtype_codes_are_the_documented_table() -> None:
    """Codes are stored in every slot and entry and are never reused."""
    assert {str(d).removeprefix("torch."): c for d, c in DTYPE_CODES.items()} == {
        "float16": 1, "bfloat16": 2, "float32": 3, "float8_e4m3fn": 4, "float8_e5m2": 5,
        "uint8": 6, "int8": 7, "float64": 8, "int16": 9, "int32": 10, "int64": 11,
        "bool": 12,
    }


# ----------------------------------------------------------------- slot header

slot_headers = st.builds(
    SlotHeader,
    key=KEYS,
    parent=st.none() | KEYS,
    codec=U8,
    dtype=U8,
    shape=st.lists(U64, max_size=MAX_NDIM).map(tuple),
    payload_len=U64,
    raw_len=U64,
    payload_crc=U32,
    seq=U64,
)


@given(slot_headers)
def test_slot_header_round_trip(h: SlotHeader) -> None:
    raw = h.encode()
    assert len(raw) == SLOT_HEADER_BYTES == 256
    assert SlotHeader.decode(raw) == h
    assert raw[:4] == b"KVSB"
    assert raw[136:252] == bytes(116)  # reserved bytes are zero
    assert h.slot_len == round_up(256 + h.payload_len)


@given(slot_headers, st.binary(max_size=64))
def test_slot_header_decodes_from_a_whole_slot(h: SlotHeader, tail: bytes) -> None:
    """Readers pass the slot as read (header + payload), as bytes or a memoryview."""
    buf = h.encode() + tail
    assert SlotHeader.decode(buf) == h
    assert SlotHeader.decode(memoryview(bytearray(buf))) == h


def test_parent_flag_distinguishes_none_from_zero_key() -> None:
    """An all-zero parent is a parent; absence is told by the flag, not by the bytes."""
    none = SlotHeader(key=K1, parent=None, codec=0, dtype=1, shape=(), payload_len=0,
                      raw_len=0, payload_crc=0, seq=0)
    zero = replace(none, parent=bytes(16))
    assert none.encode()[40] == 0 and zero.encode()[40] == 1
    assert SlotHeader.decode(none.encode()).parent is None
    assert SlotHeader.decode(zero.encode()).parent == bytes(16)


def test_slot_header_refuses_too_many_dims() -> None:
    h = SlotHeader(key=K1, parent=None, codec=0, dtype=1, shape=(1,) * 9, payload_len=0,
                   raw_len=0, payload_crc=0, seq=0)
    with pytest.raises(ValueError, match="8 dimensions"):
        h.encode()


@given(slot_headers, st.integers(0, SLOT_HEADER_BYTES * 8 - 1))
def test_slot_header_bit_flip_is_corruption(h: SlotHeader, bit: int) -> None:
    """Every byte of the header is under magic or CRC: no single flip goes unnoticed."""
    with pytest.raises(CorruptionError):
        SlotHeader.decode(flip(h.encode(), bit))


def test_slot_header_truncated_is_corruption() -> None:
    raw = EXAMPLE_SLOT.encode()
    for n in range(SLOT_HEADER_BYTES):
        with pytest.raises(CorruptionError, match="truncated"):
            SlotHeader.decode(raw[:n])


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
def test_slot_header_other_version_is_format_version_error(version: int) -> None:
    buf = bytearray(EXAMPLE_SLOT.encode())
    struct.pack_into("<H", buf, 4, version)
    with pytest.raises(FormatVersionError, match=f"version {version}"):
        SlotHeader.decode(with_crc(buf, 252))


@pytest.mark.parametrize("offset, fmt, value", [
    (0, "4s", b"KVSX"),      # magic
    (6, "<H", 512),          # header_len
    (43, "<B", 9),           # ndim > MAX_NDIM
])
def test_slot_header_bad_fields_with_valid_crc_are_corruption(
        offset: int, fmt: str, value: object) -> None:
    """Magic, header_len and ndim are validated on their own, not only via the CRC."""
    buf = bytearray(EXAMPLE_SLOT.encode())
    struct.pack_into(fmt, buf, offset, value)
    with pytest.raises(CorruptionError):
        SlotHeader.decode(with_crc(buf, 252))


# ----------------------------------------------------------------- extent header

extent_headers = st.builds(ExtentHeader, extent_id=U32, extent_bytes=U64, store_uuid=KEYS)


@given(extent_headers)
def test_extent_header_round_trip(h: ExtentHeader) -> None:
    raw = h.encode()
    assert len(raw) == EXTENT_HEADER_BYTES == PAGE
    assert raw[EXTENT_RECORD_BYTES:] == bytes(PAGE - EXTENT_RECORD_BYTES)
    assert ExtentHeader.decode(raw) == h
    assert ExtentHeader.decode(memoryview(raw)) == h


@given(extent_headers, st.integers(0, EXTENT_RECORD_BYTES * 8 - 1))
def test_extent_header_bit_flip_is_corruption(h: ExtentHeader, bit: int) -> None:
    """Any flip in the record (magic .. header_crc, reserved bytes 6-7 included)."""
    with pytest.raises(CorruptionError):
        ExtentHeader.decode(flip(h.encode(), bit))


@given(st.integers(EXTENT_RECORD_BYTES * 8, PAGE * 8 - 1))
def test_extent_header_padding_bit_flip_is_corruption(bit: int) -> None:
    with pytest.raises(CorruptionError):
        ExtentHeader.decode(flip(EXAMPLE_EXTENT.encode(), bit))


def test_extent_header_truncated_is_corruption() -> None:
    raw = EXAMPLE_EXTENT.encode()
    for n in range(EXTENT_RECORD_BYTES):
        with pytest.raises(CorruptionError):
            ExtentHeader.decode(raw[:n])


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
def test_extent_header_other_version_is_format_version_error(version: int) -> None:
    buf = bytearray(EXAMPLE_EXTENT.encode())
    struct.pack_into("<H", buf, 4, version)
    with pytest.raises(FormatVersionError, match=f"version {version}"):
        ExtentHeader.decode(with_crc(buf, 36))


def test_extent_header_bad_magic_with_valid_crc_is_corruption() -> None:
    buf = bytearray(EXAMPLE_EXTENT.encode())
    buf[:4] = b"KVSB"  # a slot header where an extent header belongs
    with pytest.raises(CorruptionError, match="magic"):
        ExtentHeader.decode(with_crc(buf, 36))


# ----------------------------------------------------------------- index entry

@st.composite
def index_entries(draw: st.DrawFn) -> IndexEntry:
    slot_len = draw(st.integers(1, 2**40)) * PAGE
    return IndexEntry(
        extent=draw(U32),
        offset=draw(st.integers(1, 2**50)) * PAGE,
        slot_len=slot_len,
        payload_len=draw(st.integers(0, slot_len - SLOT_HEADER_BYTES)),
        raw_len=draw(U64),
        codec=draw(U8),
        dtype=draw(U8),
        payload_crc=draw(U32),
        seq=draw(U64),
        last_use=draw(U64),
        parent=draw(st.none() | KEYS),
    )


@given(index_entries())
def test_index_entry_round_trip(e: IndexEntry) -> None:
    raw = e.encode()
    assert len(raw) == 76
    assert IndexEntry.decode(raw) == e
    assert IndexEntry.decode(memoryview(raw)) == e


@given(index_entries(), st.integers(0, 200).filter(lambda n: n != 76))
def test_index_entry_wrong_length_is_corruption(e: IndexEntry, n: int) -> None:
    raw = (e.encode() * 3)[:n]
    with pytest.raises(CorruptionError, match=f"{n} bytes"):
        IndexEntry.decode(raw)


@pytest.mark.parametrize("change", [
    dict(offset=4096 + 512),                    # offset not page-aligned
    dict(offset=1),
    dict(offset=0),                             # overlaps the extent header page
    dict(slot_len=4096 + 1),                    # slot_len not page-aligned
    dict(slot_len=0),                           # empty slot
    dict(payload_len=4096 - 256 + 1),           # payload overruns the slot
    dict(payload_len=2**64 - 1),
], ids=["offset-512", "offset-1", "offset-0", "slot-len", "slot-len-0", "payload-overrun",
        "payload-huge"])
def test_index_entry_bad_geometry_is_corruption(change: dict[str, int]) -> None:
    """An entry pointing across slot boundaries would read another block's bytes."""
    fields = dict(extent=1, offset=8192, slot_len=4096, payload_len=12, raw_len=12, codec=0,
                  dtype=1, payload_crc=0, seq=1, last_use=0, parent=None)
    fields.update(change)
    raw = IndexEntry(**fields).encode()  # type: ignore[arg-type]
    with pytest.raises(CorruptionError, match="geometry"):
        IndexEntry.decode(raw)


def test_index_entry_payload_may_fill_the_slot_exactly() -> None:
    e = IndexEntry(extent=1, offset=4096, slot_len=8192, payload_len=8192 - 256, raw_len=0,
                   codec=0, dtype=6, payload_crc=0, seq=1, last_use=0, parent=None)
    assert IndexEntry.decode(e.encode()) == e


@pytest.mark.parametrize("version", [0, 2, 255])
def test_index_entry_other_version_is_format_version_error(version: int) -> None:
    raw = bytearray(EXAMPLE_ENTRY.encode())
    raw[0] = version
    with pytest.raises(FormatVersionError):
        IndexEntry.decode(bytes(raw))


# ----------------------------------------------------------------- LMDB keys and values

@given(U32, U64)
def test_free_key_round_trip(extent: int, offset: int) -> None:
    k = free_key(extent, offset)
    assert len(k) == 12
    assert decode_free_key(k) == (extent, offset)


@given(U32)
def test_extent_key_round_trip(extent: int) -> None:
    k = extent_key(extent)
    assert len(k) == 4
    assert decode_extent_key(k) == extent


@given(st.lists(st.tuples(U32, U64), min_size=2, max_size=30))
def test_free_keys_sort_numerically(pairs: list[tuple[int, int]]) -> None:
    """LMDB orders keys by memcmp; the allocator's set_range relies on numeric order."""
    by_bytes = sorted(pairs, key=lambda p: free_key(*p))
    assert by_bytes == sorted(pairs)


@given(st.lists(U32, min_size=2, max_size=30))
def test_extent_keys_sort_numerically(ids: list[int]) -> None:
    assert sorted(ids, key=extent_key) == sorted(ids)


def test_lmdb_keys_are_big_endian() -> None:
    """A little-endian key would sort 256 before 1 (FORMAT.md, "Byte order")."""
    assert extent_key(1) == bytes.fromhex("00000001")
    assert free_key(1, 12288) == bytes.fromhex("000000010000000000003000")
    assert extent_key(1) < extent_key(256)
    assert free_key(1, 2**32) > free_key(1, 4096)
    assert free_key(1, 2**64 - 1) < free_key(2, 0)


@pytest.mark.parametrize("n", [0, 3, 5, 8])
def test_extent_key_wrong_length_is_corruption(n: int) -> None:
    with pytest.raises(CorruptionError):
        decode_extent_key(bytes(n))


@pytest.mark.parametrize("n", [0, 4, 11, 13])
def test_free_key_wrong_length_is_corruption(n: int) -> None:
    with pytest.raises(CorruptionError):
        decode_free_key(bytes(n))


@given(U64)
def test_u64_values_are_little_endian(value: int) -> None:
    raw = pack_u64(value)
    assert raw == value.to_bytes(8, "little")
    assert unpack_u64(raw) == value


@pytest.mark.parametrize("n", [0, 4, 7, 9, 16])
def test_unpack_u64_wrong_length_is_corruption(n: int) -> None:
    with pytest.raises(CorruptionError):
        unpack_u64(bytes(n))


# ----------------------------------------------------------------- pinned vectors

def test_worked_example_payload() -> None:
    """The payload of the worked example is the float16 bytes of T1 and their CRC32C."""
    assert NS.chain_keys(list(range(9))) == [K0, K1]
    payload = T1.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert payload == T1_PAYLOAD
    assert crc32c(payload) == T1_CRC


def test_slot_header_pinned_vector() -> None:
    """Any change of the slot header bytes breaks this test (FORMAT.md, worked example)."""
    raw = EXAMPLE_SLOT.encode()
    assert raw.hex() == SLOT_HEADER_HEX
    assert SlotHeader.decode(bytes.fromhex(SLOT_HEADER_HEX)) == EXAMPLE_SLOT
    assert struct.unpack_from("<I", raw, 252)[0] == crc32c(raw[:252]) == 0xD607D083


def test_extent_header_pinned_vector() -> None:
    raw = EXAMPLE_EXTENT.encode()
    assert raw[:EXTENT_RECORD_BYTES].hex() == EXTENT_HEADER_HEX
    assert raw[EXTENT_RECORD_BYTES:] == bytes(PAGE - EXTENT_RECORD_BYTES)


def test_index_entry_pinned_vector() -> None:
    raw = EXAMPLE_ENTRY.encode()
    assert raw.hex() == "".join(INDEX_ENTRY_LINES)
    assert IndexEntry.decode(raw) == EXAMPLE_ENTRY


def test_format_md_quotes_the_pinned_vectors() -> None:
    """FORMAT.md and this file must agree, or one of them is stale."""
    text = FORMAT_MD.read_text(encoding="utf-8")
    for literal in (*SLOT_HEADER_LINES, "(132 zero bytes)", EXTENT_HEADER_HEX,
                    *INDEX_ENTRY_LINES, "00 46 00 47 00 48 80 48 00 49 80 49"):
        assert literal in text, literal


def test_store_writes_the_worked_example(tmp_path: Path) -> None:
    """The worked example is what a real put leaves on disk, not just what encode() says."""
    t0 = torch.arange(0, 6, dtype=torch.float16).reshape(2, 3)
    with open_blocking(tmp_path, namespace=NS, engine="threads", sync=False,
                       extent_bytes=1 << 20) as store:
        store.put_many([K0, K1], [t0, T1], parents=chain_parents([K0, K1]))
    raw = (tmp_path / "extents" / "00000001.kvx").read_bytes()
    assert len(raw) == 1 << 20
    header = ExtentHeader.decode(raw[:PAGE])
    assert (header.extent_id, header.extent_bytes) == (1, 1 << 20)
    slot = raw[8192:8192 + PAGE]
    assert slot[:SLOT_HEADER_BYTES].hex() == SLOT_HEADER_HEX
    assert slot[256:268] == T1_PAYLOAD
    assert slot[268:] == bytes(PAGE - 268)  # padding to 4 KiB is zero
    assert SlotHeader.decode(raw[4096:]).key == K0
