"""One ``bytes -> None`` fuzz target per decoder of on-disk bytes, and the ``TARGETS`` registry.

Contract under test (kvstore/disk/format.py docstring, FORMAT.md): a decoder turns *any*
input into a value or into a :class:`~kvstore.errors.KVStoreError` subclass
(``CorruptionError`` / ``FormatVersionError``).  The store relies on it: ``get_many``
quarantines a block on ``CorruptionError`` and answers a miss, fsck reports it; any
other exception (``struct.error``, ``TypeError``, ``UnicodeError`` ...) escapes those
handlers and takes down a read or an ``open()``.

So every target swallows ``KVStoreError`` and nothing else; anything else propagates
and is a finding (atheris reports it as a crash, Hypothesis as a failing example).
Beyond "no foreign exception", the binary targets also assert:

* the outcome equals the reference decoder in :mod:`fuzz.spec` (same value, or the
  same error class, in the order of checks FORMAT.md documents);
* a decoded value re-encodes to bytes that decode to an equal value (so fsck's
  rewrite / index rebuild cannot drift), and for slot headers ``len(shape) == ndim
  <= 8``;
* ``bytes`` and ``memoryview`` inputs give the same outcome where the decoder accepts
  both (the store hands ``SlotHeader.decode`` a memoryview of its I/O arena).

``*_mutated`` targets read their input as a recipe (valid fields + a mutation
program, see :mod:`fuzz.mutate`) so that damaged-but-re-sealed structures reach the
checks behind the magic and CRC.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fuzz import spec
from fuzz.mutate import (
    EXTENT_KEY_LAYOUT,
    EXTENT_LAYOUT,
    FIX_CRC,
    FREE_KEY_LAYOUT,
    INDEX_LAYOUT,
    SLOT_LAYOUT,
    TEXT_LAYOUT,
    U64_LAYOUT,
    Layout,
    Op,
    Reader,
    apply_ops,
    ops_from,
)
from kvstore.codecs import fp8
from kvstore.codecs import pipeline as codecs
from kvstore.disk.format import (
    KEY_BYTES,
    MAX_NDIM,
    PAGE,
    SLOT_HEADER_BYTES,
    ExtentHeader,
    IndexEntry,
    SlotHeader,
    decode_extent_key,
    decode_free_key,
    extent_key,
    free_key,
    pack_u64,
    round_up,
    unpack_u64,
)
from kvstore.errors import KVStoreError
from kvstore.io import slots
from kvstore.keys import Namespace

Target = Callable[[bytes], None]


def _outcome(decode: Callable[[Any], Any], buf: bytes | memoryview) -> Any:
    """The decoder's value, or the kvstore error it raised; anything else propagates."""
    try:
        return decode(buf)
    except KVStoreError as e:
        return e


# --------------------------------------------------------------------------- binary decoders


@dataclass(frozen=True)
class BinaryDecoder:
    """Everything a target needs to drive and judge one binary decoder."""

    name: str
    decode: Callable[[Any], Any]
    oracle: Callable[[bytes], spec.Expected]
    reencode: Callable[[Any], bytes]
    layout: Layout
    seed: Callable[[Reader], bytes]
    """Build a valid encoding from fuzz bytes (any input gives a valid one)."""
    takes_memoryview: bool = False
    extra_check: Callable[[bytes, Any], None] | None = None


def _seed_slot(r: Reader) -> bytes:
    key = r.take(KEY_BYTES)
    parent = r.take(KEY_BYTES) if r.uint(1) & 1 else None
    codec, dtype, ndim = r.uint(1), r.uint(1), r.uint(1) % (MAX_NDIM + 1)
    shape = tuple(r.uint(4) for _ in range(ndim))
    return SlotHeader(key=key, parent=parent, codec=codec, dtype=dtype, shape=shape,
                      payload_len=r.uint(4), raw_len=r.uint(4), payload_crc=r.uint(4),
                      seq=r.uint(8)).encode()


def _seed_extent(r: Reader) -> bytes:
    return ExtentHeader(extent_id=r.uint(4), extent_bytes=r.uint(8),
                        store_uuid=r.take(16)).encode()


def _seed_index_entry(r: Reader) -> bytes:
    payload_len = r.uint(4)
    slot_len = round_up(SLOT_HEADER_BYTES + payload_len) + PAGE * (r.uint(1) % 4)
    parent = r.take(KEY_BYTES) if r.uint(1) & 1 else None
    return IndexEntry(extent=r.uint(4), offset=PAGE * (1 + r.uint(4)), slot_len=slot_len,
                      payload_len=payload_len, raw_len=r.uint(4), codec=r.uint(1),
                      dtype=r.uint(1), payload_crc=r.uint(4), seq=r.uint(8),
                      last_use=r.uint(8), parent=parent).encode()


def _slot_bounds(buf: bytes, header: SlotHeader) -> None:
    """FORMAT.md: ndim is 0..8 and shape has exactly ndim entries."""
    assert len(header.shape) <= MAX_NDIM, f"ndim {len(header.shape)} > {MAX_NDIM}: {buf.hex()}"
    assert len(header.shape) == buf[43], f"shape {header.shape} vs ndim {buf[43]}: {buf.hex()}"
    assert len(header.key) == KEY_BYTES
    assert header.parent is None or len(header.parent) == KEY_BYTES


DECODERS: dict[str, BinaryDecoder] = {
    d.name: d for d in (
        BinaryDecoder("slot_header", SlotHeader.decode, spec.slot_header,
                      lambda v: v.encode(), SLOT_LAYOUT, _seed_slot,
                      takes_memoryview=True, extra_check=_slot_bounds),
        BinaryDecoder("extent_header", ExtentHeader.decode, spec.extent_header,
                      lambda v: v.encode(), EXTENT_LAYOUT, _seed_extent,
                      takes_memoryview=True),
        BinaryDecoder("index_entry", IndexEntry.decode, spec.index_entry,
                      lambda v: v.encode(), INDEX_LAYOUT, _seed_index_entry,
                      takes_memoryview=True),
        BinaryDecoder("extent_key", decode_extent_key, spec.extent_key, extent_key,
                      EXTENT_KEY_LAYOUT, lambda r: extent_key(r.uint(4))),
        BinaryDecoder("free_key", decode_free_key, spec.free_key, lambda v: free_key(*v),
                      FREE_KEY_LAYOUT, lambda r: free_key(r.uint(4), r.uint(8))),
        BinaryDecoder("u64", unpack_u64, spec.u64, pack_u64, U64_LAYOUT,
                      lambda r: pack_u64(r.uint(8))),
    )
}


def check_binary(name: str, buf: bytes) -> None:
    """Run decoder ``name`` on ``buf`` and assert every property in the module docstring."""
    d = DECODERS[name]
    got = _outcome(d.decode, buf)
    spec.check_outcome(name, buf, d.oracle(buf), got)
    if d.takes_memoryview:
        via_view = _outcome(d.decode, memoryview(buf))
        assert type(via_view) is type(got) and (isinstance(got, KVStoreError) or via_view == got), \
            f"{name}: memoryview gave {via_view!r}, bytes gave {got!r} for {buf.hex()}"
    if isinstance(got, KVStoreError):
        return
    again = d.decode(d.reencode(got))  # a valid value must re-encode to a decodable one
    assert again == got, f"{name}: {got!r} re-encoded decodes to {again!r} ({buf.hex()})"
    if d.extra_check is not None:
        d.extra_check(buf, got)


def mutated_input(name: str, data: bytes) -> bytes:
    """The bytes a ``<name>_mutated`` target feeds its decoder for fuzz input ``data``.

    Layout of ``data``: one byte whose bit 0 says "re-seal the CRC after all mutations",
    then the seed's fields (see the ``_seed_*`` builders), then a mutation program
    (:func:`fuzz.mutate.ops_from`).  Short inputs are zero-padded, so ``b""`` is the
    all-zero valid encoding, unmutated.
    """
    d = DECODERS[name]
    r = Reader(data)
    reseal = r.uint(1) & 1
    seed = d.seed(r)
    ops = ops_from(r)
    if reseal:
        ops.append(Op(FIX_CRC))
    return apply_ops(seed, ops, d.layout)


def _binary_target(name: str) -> Target:
    def target(data: bytes) -> None:
        check_binary(name, bytes(data))
    target.__name__ = f"fuzz_{name}"
    target.__doc__ = f"Raw bytes into the {name} decoder; see the module docstring."
    return target


def _mutated_target(name: str) -> Target:
    def target(data: bytes) -> None:
        check_binary(name, mutated_input(name, bytes(data)))
    target.__name__ = f"fuzz_{name}_mutated"
    target.__doc__ = (f"A valid {name} encoding, mutated (and CRC re-sealed on request), "
                      f"into its decoder; see :func:`mutated_input`.")
    return target


def check_slot_verifier(slot: bytes) -> bool:
    """``slot`` (a header, then payload bytes) through the one slot verifier the store's
    reads and fsck share (:func:`kvstore.io.slots.check_slot`, :func:`~kvstore.io.slots.check_payload`),
    called as they call it: without expectations, and with the key and index entry the
    header claims.  Only kvstore errors may escape; a slot that passes is the header the
    reference decoder reads, with a known codec and dtype, and its payload's CRC32C.
    Returns whether the slot was accepted."""
    expected = spec.slot_header(slot)
    accepted = False
    for with_claims in (False, True):
        try:
            header = slots.check_slot(slot, None, None)
            if with_claims:
                entry = IndexEntry(extent=1, offset=PAGE, slot_len=round_up(
                    SLOT_HEADER_BYTES + header.payload_len), payload_len=header.payload_len,
                    raw_len=header.raw_len, codec=header.codec, dtype=header.dtype,
                    payload_crc=header.payload_crc, seq=header.seq, last_use=0,
                    parent=header.parent)
                header = slots.check_slot(slot, header.key, entry)
            slots.check_payload(slot, header)
        except KVStoreError:
            continue
        assert not isinstance(expected, type) and header == expected, \
            f"slot verifier accepted {slot.hex()} as {header!r}; the spec says {expected!r}"
        payload = slot[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + header.payload_len]
        assert len(payload) == header.payload_len and spec.crc32c(payload) == header.payload_crc
        accepted = True
    return accepted


def fuzz_slot_verifier(data: bytes) -> None:
    """A valid slot header, mutated (see :func:`mutated_input`), then the rest of the input
    as payload, through the shared slot verifier (:func:`check_slot_verifier`)."""
    head = mutated_input("slot_header", bytes(data))
    check_slot_verifier(head[:SLOT_HEADER_BYTES] + bytes(data)[-256:])


fuzz_slot_header = _binary_target("slot_header")
fuzz_extent_header = _binary_target("extent_header")
fuzz_index_entry = _binary_target("index_entry")
fuzz_extent_key = _binary_target("extent_key")
fuzz_free_key = _binary_target("free_key")
fuzz_u64 = _binary_target("u64")
fuzz_slot_header_mutated = _mutated_target("slot_header")
fuzz_extent_header_mutated = _mutated_target("extent_header")
fuzz_index_entry_mutated = _mutated_target("index_entry")
fuzz_extent_key_mutated = _mutated_target("extent_key")
fuzz_free_key_mutated = _mutated_target("free_key")
fuzz_u64_mutated = _mutated_target("u64")


# --------------------------------------------------------------------------- namespace records


def check_namespace(text: str) -> None:
    """``Namespace.from_json`` on ``text``: a kvstore error, or a namespace that is usable.

    "Usable" means what the store does with one: compute its canonical JSON and its
    digest (the meta record's key), and read that canonical JSON back to the same
    canonical JSON and digest.
    """
    try:
        ns = Namespace.from_json(text)
    except KVStoreError:
        return
    canonical = ns.canonical_json()
    digest = ns.digest
    again = Namespace.from_json(canonical)
    assert again.canonical_json() == canonical, f"{text!r}: {canonical!r} is not a fixed point"
    assert again.digest == digest, f"{text!r}: digest changed on re-reading"


def fuzz_namespace_json(data: bytes) -> None:
    """Any text into ``Namespace.from_json`` (invalid UTF-8 replaced, to isolate the parser)."""
    check_namespace(bytes(data).decode("utf-8", errors="replace"))


def fuzz_namespace_record(data: bytes) -> None:
    """A ``namespace:`` meta record value as the store reads it: bytes -> UTF-8 -> Namespace.

    ``Index.namespaces()`` does ``value.decode()`` on the record bytes, so a record that
    is not UTF-8 must also end in a kvstore error, not ``UnicodeDecodeError``.
    """
    try:
        ns = Namespace.from_record(bytes(data))
    except KVStoreError:
        return
    check_namespace(ns.canonical_json())


NS_MEMBERS = ("block_size", "cache_salt", "dtype", "extra", "hash_version", "layout", "lora",
              "model", "tp_rank", "tp_size", "zz_unknown")
"""The members of the canonical JSON (FORMAT.md "Namespace") plus one it does not have."""

JSON_VALUES = (
    "null", "true", "false", "0", "1", "-1", "2", "1.0", "1.5", "1e400", "NaN", "-Infinity",
    "18446744073709551616", "1" * 5000, '""', '"x"', '"1"', '"\\ud800"', '"\\u0000"',
    '"\u00e9\u6f22"', "[]", "{}", '{"a":1}', '[["a","b"]]', '[["b","x"],["a","y"]]',
    '[["a",1],["a","b"]]', '["ab"]', "[[]]", '[["a","b","c"]]', "[1]", "[null]",
    "[" * 3000 + "]" * 3000,
)
"""Raw JSON texts a member can be set to: each JSON type, numbers at and past the limits
Python's ``json``/``int`` impose, lone surrogates, and ``extra`` shapes that are not a
list of string pairs."""

_ALPHABET = "abz09/-_.\u00e9\u6f22"


class NsOp(NamedTuple):
    """Set member ``NS_MEMBERS[member]`` to ``JSON_VALUES[value]`` (kind 0) or delete it (1)."""

    kind: int
    member: int
    value: int = 0


def _text(r: Reader) -> str:
    return "".join(_ALPHABET[r.uint(1) % len(_ALPHABET)] for _ in range(r.uint(1) % 12))


def _seed_namespace(r: Reader) -> Namespace:
    tp_size = 1 + r.uint(1) % 8
    return Namespace(
        model=_text(r), dtype=_text(r), block_size=1 + r.uint(2), layout=_text(r) or "default",
        tp_rank=r.uint(1) % tp_size, tp_size=tp_size,
        lora=_text(r) if r.uint(1) & 1 else None,
        cache_salt=_text(r) if r.uint(1) & 1 else None,
        extra=tuple((_text(r), _text(r)) for _ in range(r.uint(1) % 3)),
    )


def render_namespace(ns: Namespace, ops: Sequence[NsOp]) -> str:
    """``ns``'s canonical JSON document with member-level edits, as JSON text."""
    doc = {k: json.dumps(v, ensure_ascii=False) for k, v in json.loads(ns.canonical_json()).items()}
    for op in ops:
        member = NS_MEMBERS[op.member % len(NS_MEMBERS)]
        if op.kind % 2 == 0:
            doc[member] = JSON_VALUES[op.value % len(JSON_VALUES)]
        else:
            doc.pop(member, None)
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in sorted(doc.items())) + "}"


def mutated_namespace_text(data: bytes) -> str:
    """The text ``fuzz_namespace_mutated`` parses: up to 3 member edits (read first, so
    that even short inputs edit something), applied to a valid namespace built from the
    next bytes, then byte-level mutations of its UTF-8 encoding."""
    r = Reader(data)
    ns_ops = [NsOp(r.uint(1), r.uint(1), r.uint(1)) for _ in range(r.uint(1) % 4)]
    ns = _seed_namespace(r)
    raw = apply_ops(render_namespace(ns, ns_ops).encode("utf-8"), ops_from(r), TEXT_LAYOUT)
    return raw.decode("utf-8", errors="replace")


def fuzz_namespace_mutated(data: bytes) -> None:
    """A valid canonical namespace JSON, edited member-wise and byte-wise, into from_json."""
    check_namespace(mutated_namespace_text(bytes(data)))


# --------------------------------------------------------------------------- registry

def _codec_shape(data: bytes) -> tuple[int, torch.dtype, tuple[int, ...], bytes]:
    """Split fuzz input into what a slot header would give ``codecs.decode``: a codec id,
    a float dtype, a small shape, and the payload bytes."""
    head = (bytes(data[:4]) + bytes(4))[:4]
    codec = head[0] & 0x1F
    dtype = (torch.float16, torch.bfloat16, torch.float32)[head[1] % 3]
    shape = (1 + head[2] % 8, 1 + head[3] % 64)
    return codec, dtype, shape, bytes(data[4:])


_INTS = {2: torch.int16, 4: torch.int32}


def _decode_on_every_path(codec: int, payload: bytes, dtype: torch.dtype,
                          shape: tuple[int, ...]) -> torch.Tensor | None:
    """``codecs.decode`` on each of its paths (the compiled kernels when they are built,
    and NumPy/torch): two decoders of one format, which must both refuse (a kvstore
    error; None) or both give the same bits.  (tests/cuda/test_fp8_decoders_agree.py
    holds the GPU kernel's CPU twin to the same rule.)"""
    outcomes: list[torch.Tensor | type[KVStoreError]] = []
    native = fp8.NATIVE
    try:
        for path in dict.fromkeys((native, False)):
            fp8.NATIVE = path
            try:
                outcomes.append(codecs.decode(codec, payload, dtype, shape))
            except KVStoreError as e:
                outcomes.append(type(e))
    finally:
        fp8.NATIVE = native
    first = outcomes[0]
    for other in outcomes[1:]:
        if isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor):
            ints = _INTS[first.element_size()]
            assert torch.equal(first.view(ints), other.view(ints)), "codec paths differ"
        else:
            assert first is other, (first, other)
    return first if isinstance(first, torch.Tensor) else None


def fuzz_codec_payload(data: bytes) -> None:
    """Any bytes as a payload of any codec id: a tensor of the header's dtype and shape,
    or a kvstore error (the payload CRC passed, so the decoder is the last defence);
    the same outcome on both of the codec's paths."""
    codec, dtype, shape, payload = _codec_shape(data)
    out = _decode_on_every_path(codec, payload, dtype, shape)
    assert out is None or (out.dtype == dtype and tuple(out.shape) == shape)


def fuzz_codec_mutated(data: bytes) -> None:
    """A valid payload of a real block, then byte edits: decode or a kvstore error,
    alike on both of the codec's paths."""
    codec, dtype, shape, edits = _codec_shape(data)
    spec = codecs.CodecSpec(fp8=(None, "e4m3", "e5m2")[codec % 3], zstd=bool(codec & 0x10))
    g = torch.Generator().manual_seed(len(edits))
    value = torch.randn(shape, generator=g).to(dtype)
    used, payload = codecs.encode(value, spec)
    raw = bytearray(payload.tobytes())
    for i in range(0, len(edits) - 1, 2):
        if raw:
            raw[edits[i] * 257 % len(raw)] = edits[i + 1]
    if len(edits) % 3 == 1:
        raw = raw[: len(raw) * edits[0] // 256] if edits else raw
    out = _decode_on_every_path(used, bytes(raw), dtype, shape)
    assert out is None or (out.dtype == dtype and tuple(out.shape) == shape)


TARGETS: dict[str, Target] = {
    "slot_header": fuzz_slot_header,
    "slot_header_mutated": fuzz_slot_header_mutated,
    "extent_header": fuzz_extent_header,
    "extent_header_mutated": fuzz_extent_header_mutated,
    "index_entry": fuzz_index_entry,
    "index_entry_mutated": fuzz_index_entry_mutated,
    "extent_key": fuzz_extent_key,
    "extent_key_mutated": fuzz_extent_key_mutated,
    "free_key": fuzz_free_key,
    "free_key_mutated": fuzz_free_key_mutated,
    "u64": fuzz_u64,
    "u64_mutated": fuzz_u64_mutated,
    "namespace_json": fuzz_namespace_json,
    "namespace_record": fuzz_namespace_record,
    "namespace_mutated": fuzz_namespace_mutated,
    "codec_payload": fuzz_codec_payload,
    "codec_mutated": fuzz_codec_mutated,
    "slot_verifier": fuzz_slot_verifier,
}
"""Target name (as given to ``fuzz/run_atheris.py``) -> ``bytes -> None`` function."""


def _example_namespaces() -> list[Namespace]:
    return [
        Namespace(model="example/llama-tiny", dtype="float16", block_size=4),  # FORMAT.md
        Namespace(model="meta-llama/Llama-3.1-8B", dtype="bfloat16", block_size=16,
                  layout="vllm-flash", tp_rank=1, tp_size=2, lora="adapter-7",
                  cache_salt="tenant-\u00e9", extra=(("rope", "yarn"), ("kv_quant", "fp8"))),
    ]


SEEDS: dict[str, list[bytes]] = {
    "slot_header": [
        SlotHeader(key=bytes(range(16)), parent=None, codec=0, dtype=1, shape=(2, 3),
                   payload_len=12, raw_len=12, payload_crc=0x71A75621, seq=1).encode(),
        SlotHeader(key=b"\xff" * 16, parent=bytes(16), codec=0, dtype=3,
                   shape=(1, 2, 3, 4, 5, 6, 7, 8), payload_len=2**20, raw_len=2**20,
                   payload_crc=0, seq=2**64 - 1).encode(),
        SlotHeader(key=bytes(16), parent=b"\x01" * 16, codec=0, dtype=12, shape=(),
                   payload_len=0, raw_len=0, payload_crc=0, seq=0).encode() + bytes(PAGE - 256),
    ],
    "extent_header": [
        ExtentHeader(extent_id=1, extent_bytes=1 << 30, store_uuid=bytes(range(16))).encode(),
        ExtentHeader(extent_id=2**32 - 1, extent_bytes=16 << 10, store_uuid=b"\xff" * 16)
        .encode() + bytes(PAGE),
    ],
    "index_entry": [
        IndexEntry(extent=1, offset=PAGE, slot_len=PAGE, payload_len=12, raw_len=12, codec=0,
                   dtype=1, payload_crc=0x71A75621, seq=1, last_use=1_700_000_000_000_000,
                   parent=None).encode(),
        IndexEntry(extent=7, offset=PAGE * 1000, slot_len=3 * PAGE,
                   payload_len=3 * PAGE - SLOT_HEADER_BYTES, raw_len=0, codec=0, dtype=11,
                   payload_crc=2**32 - 1, seq=2**64 - 1, last_use=0,
                   parent=b"\xab" * 16).encode(),
    ],
    "extent_key": [extent_key(1), extent_key(2**32 - 1)],
    "free_key": [free_key(1, PAGE), free_key(2**32 - 1, 2**64 - PAGE)],
    "u64": [pack_u64(0), pack_u64(1 << 30), pack_u64(2**64 - 1)],
    "namespace_json": [ns.canonical_json().encode() for ns in _example_namespaces()],
    "namespace_record": [ns.canonical_json().encode() for ns in _example_namespaces()],
}
"""Valid encodings per raw target (each decodes without error; tests check it), used as
the starting corpus for atheris.  ``*_mutated`` targets need none: any input, even
``b""``, already starts from a valid encoding."""
