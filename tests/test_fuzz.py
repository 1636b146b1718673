"""Every fuzz target in fuzz/targets.py, driven by Hypothesis so CI exercises them too.

atheris (fuzz/run_atheris.py) is the deep, coverage-guided run; this file is the
bounded one that runs on every commit: each target sees a few hundred inputs, both
unstructured bytes and structure-aware mutations of valid encodings (see
fuzz/mutate.py), and the seed corpus is checked to decode.  ``max_examples`` is set
per test, on purpose independent of the Hypothesis profile, so that CI's small
"ci" profile still gives each decoder real coverage while the file stays well under
20 s.

Decoders that currently break the contract (raise something other than a
``KVStoreError``) are marked ``xfail(strict=True)`` with the exact reproducer, so the
suite stays green while the bug is open and turns red the moment it is fixed (then
drop the marker).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from fuzz import spec
from fuzz.mutate import (
    FIX_CRC,
    INTERESTING,
    MAX_CHUNK,
    N_KINDS,
    TEXT_LAYOUT,
    Op,
    Reader,
    apply_ops,
)
from fuzz.targets import (
    DECODERS,
    JSON_VALUES,
    NS_MEMBERS,
    SEEDS,
    TARGETS,
    NsOp,
    check_binary,
    check_namespace,
    check_slot_verifier,
    mutated_input,
    render_namespace,
)
from kvstore.disk.format import (
    KEY_BYTES,
    MAX_NDIM,
    PAGE,
    SLOT_HEADER_BYTES,
    ExtentHeader,
    IndexEntry,
    SlotHeader,
    extent_key,
    free_key,
    pack_u64,
    round_up,
)
from kvstore.errors import CorruptionError, FormatVersionError
from kvstore.keys import Namespace

U8 = st.integers(0, 2**8 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
KEYS = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])
"""Per-test budget, whatever profile is loaded.  Every target is driven by three or four
of these tests (raw bytes, recipes, structure-aware strategies, sealed random fields),
so each sees several hundred inputs per run."""
FUZZ_ONE_BUG = settings(FUZZ, report_multiple_bugs=False,
                        phases=[Phase.explicit, Phase.reuse, Phase.generate])
"""For the xfail tests: stop at the first failure, raise it as itself (not an
ExceptionGroup, so ``raises=`` can check its class) and do not spend time shrinking
it; NAMESPACE_FINDINGS pins minimal reproducers instead."""

BINARY = sorted(DECODERS)
MUTATED = [f"{name}_mutated" for name in BINARY]

# --------------------------------------------------------------------------- registry


def test_registry_covers_every_decoder() -> None:
    """Adding a decoder without a target (or a target without a name) should be noticed."""
    assert set(TARGETS) == set(BINARY) | set(MUTATED) | {
        "namespace_json", "namespace_record", "namespace_mutated", "codec_payload",
        "codec_mutated", "slot_verifier"}
    assert all(callable(t) for t in TARGETS.values())


def test_crc_oracle_matches_format_md() -> None:
    """The reference decoders use their own CRC32C; pin it to FORMAT.md's check value."""
    assert spec.crc32c(b"123456789") == 0xE3069283


# --------------------------------------------------------------------------- seed corpus


@pytest.mark.parametrize("name", BINARY)
def test_seed_corpus_decodes(name: str) -> None:
    """Every seed is a valid encoding: it decodes, and re-encodes to its own bytes."""
    d = DECODERS[name]
    assert SEEDS[name], f"no seeds for {name}"
    for seed in SEEDS[name]:
        value = d.decode(seed)
        encoded = d.reencode(value)
        assert seed[:len(encoded)] == encoded
        spec.check_outcome(name, seed, d.oracle(seed), value)
        TARGETS[name](seed)


@pytest.mark.parametrize("name", ["namespace_json", "namespace_record"])
def test_namespace_seed_corpus_decodes(name: str) -> None:
    for seed in SEEDS[name]:
        ns = Namespace.from_json(seed.decode("utf-8"))
        assert ns.canonical_json().encode("utf-8") == seed
        TARGETS[name](seed)


@pytest.mark.parametrize("name", BINARY)
@settings(FUZZ, max_examples=50)
@given(data=st.binary(max_size=128))
def test_mutation_seeds_are_valid(name: str, data: bytes) -> None:
    """The *_mutated targets must start from a valid encoding, whatever their input."""
    d = DECODERS[name]
    seed = d.seed(Reader(data))
    spec.check_outcome(name, seed, d.oracle(seed), d.decode(seed))
    assert mutated_input(name, b"") == d.seed(Reader(b""))  # b"": the seed, unmutated


# --------------------------------------------------------------------------- unstructured bytes


def _pad_to_page(prefix: bytes) -> bytes:
    return prefix + bytes(PAGE - len(prefix))


RAW_INPUTS = {
    "slot_header": st.binary(max_size=SLOT_HEADER_BYTES + 16),
    "extent_header": st.one_of(st.binary(max_size=64),
                               st.binary(max_size=64).map(_pad_to_page)),
    "index_entry": st.one_of(st.binary(max_size=96), st.binary(min_size=76, max_size=76)),
    "extent_key": st.binary(max_size=16),
    "free_key": st.binary(max_size=24),
    "u64": st.binary(max_size=16),
}
"""Plain bytes per decoder, with lengths around the structure's size (and, for the
extent header, whole pages with a random record, which plain bytes would never reach)."""


@pytest.mark.parametrize("name", BINARY)
@FUZZ
@given(data=st.data())
def test_raw_bytes(name: str, data: st.DataObject) -> None:
    TARGETS[name](data.draw(RAW_INPUTS[name], label="input"))


@pytest.mark.parametrize("name", MUTATED)
@FUZZ
@given(data=st.binary(max_size=160))
def test_mutated_targets_on_recipes(name: str, data: bytes) -> None:
    """The atheris-facing structure-aware targets, fed arbitrary recipes."""
    TARGETS[name](data)


# --------------------------------------------------------------------------- structure-aware


def _index_entry(payload_len: int, extra_pages: int, offset_pages: int, parent: bytes | None,
                 extent: int, raw_len: int, codec: int, dtype: int, crc: int, seq: int,
                 last_use: int) -> IndexEntry:
    return IndexEntry(extent=extent, offset=PAGE * offset_pages,
                      slot_len=round_up(SLOT_HEADER_BYTES + payload_len) + PAGE * extra_pages,
                      payload_len=payload_len, raw_len=raw_len, codec=codec, dtype=dtype,
                      payload_crc=crc, seq=seq, last_use=last_use, parent=parent)


VALID = {
    "slot_header": st.builds(
        SlotHeader, key=KEYS, parent=st.none() | KEYS, codec=U8, dtype=U8,
        shape=st.lists(U64, max_size=MAX_NDIM).map(tuple), payload_len=U64, raw_len=U64,
        payload_crc=U32, seq=U64).map(SlotHeader.encode),
    "extent_header": st.builds(ExtentHeader, extent_id=U32, extent_bytes=U64,
                               store_uuid=KEYS).map(ExtentHeader.encode),
    "index_entry": st.builds(
        _index_entry, payload_len=st.integers(0, 2**40), extra_pages=st.integers(0, 3),
        offset_pages=st.integers(1, 2**40), parent=st.none() | KEYS, extent=U32,
        raw_len=U64, codec=U8, dtype=U8, crc=U32, seq=U64, last_use=U64,
    ).map(IndexEntry.encode),
    "extent_key": U32.map(extent_key),
    "free_key": st.tuples(U32, U64).map(lambda t: free_key(*t)),
    "u64": U64.map(pack_u64),
}
"""Valid encodings of every binary structure, from the encoders in kvstore.disk.format."""

OPS = st.lists(st.builds(Op, kind=st.integers(0, N_KINDS - 1), a=st.integers(0, 2**16),
                         b=U8, data=st.binary(max_size=MAX_CHUNK)), max_size=6)
FIELD_OPS = st.lists(st.builds(Op, kind=st.just(INTERESTING), a=st.integers(0, 64), b=U8),
                     min_size=1, max_size=4)
"""Mutations that hit fields with boundary values only, so that, re-sealed, they reach
every post-CRC check (version, header_len, ndim, geometry) instead of dying on length."""


@pytest.mark.parametrize("name", BINARY)
@FUZZ
@given(data=st.data())
def test_structure_aware_mutations(name: str, data: st.DataObject) -> None:
    """Valid encoding -> bit flips / byte sets / boundary values / truncation / extension,
    optionally CRC re-sealed -> the decoder agrees with FORMAT.md and round-trips."""
    seed = data.draw(VALID[name], label="valid")
    ops = data.draw(st.one_of(OPS, FIELD_OPS), label="ops")
    if data.draw(st.booleans(), label="reseal"):
        ops = [*ops, Op(FIX_CRC)]
    check_binary(name, apply_ops(seed, ops, DECODERS[name].layout))


@FUZZ
@given(seed=VALID["slot_header"], ops=st.one_of(OPS, FIELD_OPS))
@example(seed=SEEDS["slot_header"][0], ops=[Op(INTERESTING, 8, 9)])  # ndim := 9
@example(seed=SEEDS["slot_header"][0], ops=[Op(INTERESTING, 1, 2)])  # version := 2
def test_slot_header_resealed_is_bounded(seed: bytes, ops: list[Op]) -> None:
    """With a valid header CRC the checksum no longer protects the decoder: whatever it
    accepts must have ndim <= 8 and len(shape) == ndim, and rejects must be the
    documented ones (FormatVersionError for the version, CorruptionError otherwise)."""
    buf = apply_ops(seed, [*ops, Op(FIX_CRC)], DECODERS["slot_header"].layout)
    try:
        header = SlotHeader.decode(buf)
    except FormatVersionError:
        assert int.from_bytes(buf[4:6], "little") != 1
        return
    except CorruptionError as e:
        assert len(buf) < SLOT_HEADER_BYTES or buf[:4] != b"KVSB" or buf[43] > MAX_NDIM \
            or int.from_bytes(buf[6:8], "little") != SLOT_HEADER_BYTES, (e, buf.hex())
        return
    assert len(header.shape) == buf[43] <= MAX_NDIM
    check_binary("slot_header", buf)


@FUZZ
@given(body=st.binary(min_size=248, max_size=248))
def test_slot_header_sealed_random_body(body: bytes) -> None:
    """Magic + random fields + correct CRC: the decoder sees arbitrary field values."""
    raw = b"KVSB" + body
    check_binary("slot_header", raw + spec.crc32c(raw).to_bytes(4, "little"))


@FUZZ
@given(body=st.binary(min_size=32, max_size=32))
def test_extent_header_sealed_random_body(body: bytes) -> None:
    raw = b"KVSX" + body
    check_binary("extent_header", _pad_to_page(raw + spec.crc32c(raw).to_bytes(4, "little")))


# --------------------------------------------------------------------------- namespace records

NAMES = st.text(alphabet="abz09/-_.\u00e9\u6f22", max_size=12)


@st.composite
def namespaces(draw: st.DrawFn) -> Namespace:
    tp_size = draw(st.integers(1, 8))
    return Namespace(
        model=draw(NAMES), dtype=draw(NAMES), block_size=draw(st.integers(1, 2**16)),
        layout=draw(NAMES), tp_rank=draw(st.integers(0, tp_size - 1)), tp_size=tp_size,
        lora=draw(st.none() | NAMES), cache_salt=draw(st.none() | NAMES),
        extra=tuple(draw(st.lists(st.tuples(NAMES, NAMES), max_size=3))))


@FUZZ
@given(ns=namespaces())
def test_valid_namespace_records_round_trip(ns: Namespace) -> None:
    """The green half of the namespace contract: every record the store writes reads back."""
    record = ns.canonical_json().encode("utf-8")
    TARGETS["namespace_record"](record)
    assert Namespace.from_json(record.decode("utf-8")) == ns


@FUZZ_ONE_BUG
@given(data=st.binary(max_size=256))
def test_namespace_json_raw(data: bytes) -> None:
    TARGETS["namespace_json"](data)


@FUZZ_ONE_BUG
@given(data=st.binary(max_size=256))
def test_namespace_record_raw(data: bytes) -> None:
    TARGETS["namespace_record"](data)


@FUZZ_ONE_BUG
@given(data=st.binary(max_size=160))
def test_namespace_mutated_recipes(data: bytes) -> None:
    TARGETS["namespace_mutated"](data)


@FUZZ_ONE_BUG
@given(ns=namespaces(),
       ops=st.lists(st.builds(NsOp, kind=st.integers(0, 1),
                              member=st.integers(0, len(NS_MEMBERS) - 1),
                              value=st.integers(0, len(JSON_VALUES) - 1)), max_size=3),
       byte_ops=st.lists(st.builds(Op, kind=st.integers(0, N_KINDS - 1),
                                   a=st.integers(0, 2**16), b=U8,
                                   data=st.binary(max_size=MAX_CHUNK)), max_size=2))
def test_namespace_structure_aware(ns: Namespace, ops: list[NsOp], byte_ops: list[Op]) -> None:
    """Valid canonical JSON, members edited to other JSON types / deleted / added, then a
    few byte mutations: from_json must give a usable namespace or a KVStoreError."""
    text = render_namespace(ns, ops)
    raw = apply_ops(text.encode("utf-8"), byte_ops, TEXT_LAYOUT)
    check_namespace(raw.decode("utf-8", errors="replace"))

_DOC = '{"block_size":1,"dtype":"d","model":"m"'
NAMESPACE_FINDINGS = [
    ("namespace_json", b"", json.JSONDecodeError, "empty record"),
    ("namespace_json", b"{", json.JSONDecodeError, "truncated record"),
    ("namespace_json", b"1", AttributeError, "JSON that is not an object"),
    ("namespace_json", b"[]", TypeError, "JSON array"),
    ("namespace_json", b"{}", TypeError, "members missing"),
    ("namespace_json", (_DOC + ',"zz":0}').encode(), TypeError, "unknown member"),
    ("namespace_json", (_DOC + ',"extra":5}').encode(), TypeError, "extra not a list"),
    ("namespace_json", (_DOC + ',"extra":null}').encode(), TypeError, "extra null"),
    ("namespace_json", b'"x"', AttributeError, "JSON string"),
    ("namespace_json", (_DOC + ',"tp_rank":"a"}').encode(), TypeError, "tp_rank a string"),
    ("namespace_json", (_DOC + ',"extra":[["a",1],["a","b"]]}').encode(), TypeError,
     "extra pairs that do not sort"),
    ("namespace_json", b"[" * 3000, RecursionError, "deep nesting"),
    ("namespace_json", (_DOC + ',"tp_size":' + "1" * 5000 + "}").encode(), ValueError,
     "integer over Python's 4300-digit limit"),
    ("namespace_json", b'{"block_size":1,"dtype":"d","model":"\\ud800"}', UnicodeEncodeError,
     "lone surrogate: from_json accepts it, .digest then fails to encode it"),
    ("namespace_record", b"\xff", UnicodeDecodeError, "record bytes that are not UTF-8"),
]


@pytest.mark.parametrize("target,data,raises", [
    pytest.param(t, d, e, id=why) for t, d, e, why in NAMESPACE_FINDINGS])
def test_namespace_findings(target: str, data: bytes, raises: type[BaseException]) -> None:
    """Exact reproducers of every kind of leak the fuzzer found (each once escaped as the
    listed exception); now each must end in a KVStoreError, which the target swallows."""
    TARGETS[target](data)


@FUZZ
@given(st.binary(max_size=4096))
def test_codec_payload_decoder(data: bytes) -> None:
    """Every codec decoder on arbitrary payload bytes: a tensor or the store's own error."""
    TARGETS["codec_payload"](data)


@FUZZ
@given(st.binary(min_size=4, max_size=64))
def test_codec_mutated_payloads(data: bytes) -> None:
    """Real encoded blocks with bytes changed or cut: a tensor or the store's own error."""
    TARGETS["codec_mutated"](data)


# --------------------------------------------------------------------------- the slot verifier


def _valid_slot(payload: bytes, key: bytes = bytes(range(16))) -> bytes:
    from kvstore.codecs.pipeline import CODEC_RAW
    from kvstore.codecs.tensors import DTYPE_CODES
    from kvstore.disk.format import crc32c

    header = SlotHeader(key=key, parent=None, codec=CODEC_RAW, dtype=DTYPE_CODES[torch.uint8],
                        shape=(len(payload),), payload_len=len(payload), raw_len=len(payload),
                        payload_crc=crc32c(payload), seq=7)
    return header.encode() + payload


@FUZZ
@given(data=st.binary(max_size=400))
def test_slot_verifier_on_recipes(data: bytes) -> None:
    """The store's and fsck's shared verifier, fed mutated slots (fuzz/targets.py)."""
    TARGETS["slot_verifier"](data)


@FUZZ
@given(payload=st.binary(min_size=1, max_size=300), flip=st.integers(min_value=0))
def test_slot_verifier_accepts_valid_slots_and_rejects_any_flipped_byte(
        payload: bytes, flip: int) -> None:
    slot = _valid_slot(payload)
    assert check_slot_verifier(slot)  # accepted, equal to the reference decoder's reading
    damaged = bytearray(slot)
    damaged[flip % len(slot)] ^= 0x01  # header (under its CRC) or payload (under its own)
    assert not check_slot_verifier(bytes(damaged))
