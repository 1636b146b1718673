"""Block-key derivation (kvstore/keys.py) against FORMAT.md, "Keys" and "Test vectors".

Keys are content addresses that outlive processes, machines and kvstore releases: a key
that changes silently turns every stored block into a miss.  So the vectors below are
pinned byte for byte, and recomputed from the spec with plain ``hashlib`` to show that
FORMAT.md alone is enough to reimplement them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore import Namespace, chain_parents
from kvstore.errors import InvalidKeyError
from kvstore.keys import check_key, check_keys

FORMAT_MD = Path(__file__).resolve().parent.parent / "FORMAT.md"

# ----------------------------------------------------------------- vectors (FORMAT.md)

NS = Namespace(model="example/llama-tiny", dtype="float16", block_size=4)
NS_JSON = ('{"block_size":4,"cache_salt":null,"dtype":"float16","extra":[],"hash_version":1,'
           '"layout":"default","lora":null,"model":"example/llama-tiny","tp_rank":0,'
           '"tp_size":1}')
NS_DIGEST = "6308642b7f4773d727fe486f51555514"

NS2 = Namespace(model="org/Modèl-7B", dtype="bfloat16", block_size=16, layout="vllm/NHD",
                tp_rank=1, tp_size=2, lora="adapter-1", cache_salt="s3cret",
                extra=(("rope_scaling", "yarn:4"), ("kv_quant", "fp8")))
NS2_JSON = ('{"block_size":16,"cache_salt":"s3cret","dtype":"bfloat16","extra":'
            '[["kv_quant","fp8"],["rope_scaling","yarn:4"]],"hash_version":1,'
            '"layout":"vllm/NHD","lora":"adapter-1","model":"org/Modèl-7B","tp_rank":1,'
            '"tp_size":2}')
NS2_DIGEST = "f0b4a8ddc01bd2f85b6fbc150c38f578"

TOKENS = list(range(9))  # two full blocks of 4, token 8 is a partial block
CHAIN = ["782b070a2ad4030b8762ceac8ce20f2d", "924cc38c6017b641e4da25a5e4381a17"]

EXTRA = [(42, "image-0", bytes.fromhex("deadbeef")), None]
EXTRA0_ENCODING = ("03000000"
                   "01" "20000000" "2a" + "00" * 31 +
                   "02" "07000000" "696d6167652d30"
                   "03" "04000000" "deadbeef")
CHAIN_EXTRA = ["d6c6c1248793930e16733bb78bf2d552", "5dcd010d024dc6556f69d8a7936d4843"]

ENGINE_HASH_BYTES = bytes.fromhex("00112233445566778899aabbccddeeff")
ENGINE_INT = "9cd7d1da73a9dab49b2815eee031affe"    # engine_key(12345)
ENGINE_NEG = "a3eadb1986d1892a03b41ebd14c48bc8"    # engine_key(-1)
ENGINE_BYTES = "58cdf43fa53a06eed6ef7289874a4ad6"  # engine_key(ENGINE_HASH_BYTES)


def hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


# ----------------------------------------------------------------- a spec-only reimplementation

def _spec_h(person: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16, person=person).digest()


def _spec_item(item: int | str | bytes) -> bytes:
    if isinstance(item, int):
        tag, data = 1, item.to_bytes(32, "little", signed=True)
    elif isinstance(item, str):
        tag, data = 2, item.encode("utf-8")
    else:
        tag, data = 3, bytes(item)
    return bytes([tag]) + struct.pack("<I", len(data)) + data


def _spec_chain(digest: bytes, block_size: int, tokens: list[int],
                extra: list[Any] | None = None) -> list[bytes]:
    prev, out = digest, []
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size:(i + 1) * block_size]
        items = () if extra is None or extra[i] is None else extra[i]
        enc = struct.pack("<I", len(items)) + b"".join(_spec_item(x) for x in items)
        prev = _spec_h(b"kvstore-blk-v1", prev + struct.pack("<I", block_size)
                       + struct.pack(f"<{len(chunk)}I", *chunk) + enc)
        out.append(prev)
    return out


# ----------------------------------------------------------------- pinned vectors

def test_namespace_canonical_json_and_digest_vectors() -> None:
    """(a): the namespace text and its digest are part of the format."""
    assert NS.canonical_json() == NS_JSON
    assert NS.digest.hex() == NS_DIGEST
    assert NS2.canonical_json() == NS2_JSON
    assert NS2.digest.hex() == NS2_DIGEST


def test_namespace_digest_follows_the_spec() -> None:
    """digest = BLAKE2b-128 personalised kvstore-ns-v1 over the UTF-8 canonical JSON."""
    for ns, text in ((NS, NS_JSON), (NS2, NS2_JSON)):
        assert ns.digest == _spec_h(b"kvstore-ns-v1", text.encode("utf-8"))
    assert "è".encode() in NS2_JSON.encode("utf-8")  # written literally, not \u00e8


def test_chain_keys_vector() -> None:
    """(b): two full blocks, the trailing partial block gets no key."""
    assert hexes(NS.chain_keys(TOKENS)) == CHAIN
    assert hexes(NS.chain_keys(TOKENS[:8])) == CHAIN
    assert hexes(NS.chain_keys(TOKENS[:7])) == CHAIN[:1]


def test_chain_key_preimage_from_format_md() -> None:
    """The block-0 hash input printed in FORMAT.md really produces key_0."""
    preimage = bytes.fromhex(NS_DIGEST + "04000000" + "00000000010000000200000003000000"
                             + "00000000")
    assert _spec_h(b"kvstore-blk-v1", preimage).hex() == CHAIN[0]
    assert _spec_chain(bytes.fromhex(NS_DIGEST), 4, TOKENS) == [bytes.fromhex(k) for k in CHAIN]


def test_chain_keys_with_extra_vector() -> None:
    """(c): one int, one str and one bytes item on block 0, none on block 1."""
    assert hexes(NS.chain_keys(TOKENS, extra=EXTRA)) == CHAIN_EXTRA
    spec = _spec_chain(NS.digest, 4, TOKENS, EXTRA)
    assert hexes(spec) == CHAIN_EXTRA
    preimage = NS.digest + struct.pack("<I", 4) + struct.pack("<4I", 0, 1, 2, 3) \
        + bytes.fromhex(EXTRA0_ENCODING)
    assert _spec_h(b"kvstore-blk-v1", preimage).hex() == CHAIN_EXTRA[0]


def test_engine_key_vectors() -> None:
    """(d): engine hashes scoped to the namespace, int and bytes."""
    assert NS.engine_key(12345).hex() == ENGINE_INT
    assert NS.engine_key(-1).hex() == ENGINE_NEG
    assert NS.engine_key(ENGINE_HASH_BYTES).hex() == ENGINE_BYTES
    assert NS.engine_keys([12345, ENGINE_HASH_BYTES]) == [
        bytes.fromhex(ENGINE_INT), bytes.fromhex(ENGINE_BYTES)]
    for h, want in ((12345, ENGINE_INT), (-1, ENGINE_NEG), (ENGINE_HASH_BYTES, ENGINE_BYTES)):
        assert _spec_h(b"kvstore-eng-v1", NS.digest + _spec_item(h)).hex() == want


def test_format_md_quotes_the_pinned_vectors() -> None:
    """FORMAT.md and this file must agree, or one of them is stale."""
    text = FORMAT_MD.read_text(encoding="utf-8")
    for literal in (NS_JSON, NS_DIGEST, NS2_JSON, NS2_DIGEST, *CHAIN, *CHAIN_EXTRA,
                    ENGINE_INT, ENGINE_NEG, ENGINE_BYTES):
        assert literal in text, literal


# ----------------------------------------------------------------- stability and structure

def test_keys_are_identical_in_another_process() -> None:
    """No Python ``hash`` (randomised per process) or pickle may leak into a key."""
    code = (
        "from kvstore import Namespace\n"
        "ns = Namespace(model='example/llama-tiny', dtype='float16', block_size=4)\n"
        "print(ns.digest.hex())\n"
        "print(' '.join(k.hex() for k in ns.chain_keys(list(range(9)), extra=["
        "(42, 'image-0', bytes.fromhex('deadbeef')), None])))\n"
        "print(ns.engine_key(12345).hex())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env, timeout=120).stdout.split("\n")
    assert out[0] == NS.digest.hex() == NS_DIGEST
    assert out[1].split() == hexes(NS.chain_keys(TOKENS, extra=EXTRA)) == CHAIN_EXTRA
    assert out[2] == NS.engine_key(12345).hex()


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=48)


@given(token_lists)
def test_chain_prefix_property(tokens: list[int]) -> None:
    """A prompt's keys start with the keys of every shorter prompt it extends."""
    t16 = list(range(100, 116))
    assert NS.chain_keys(t16[:8]) == NS.chain_keys(t16)[:2]
    full = NS.chain_keys(tokens)
    assert len(full) == len(tokens) // 4
    for cut in range(len(tokens) + 1):
        assert NS.chain_keys(tokens[:cut]) == full[:cut // 4]


@given(token_lists, st.integers(0, 12))
def test_parent_continuation_equals_whole_chain(tokens: list[int], blocks_first: int) -> None:
    """Hashing a suffix with ``parent=`` gives the same keys as hashing everything."""
    split = min(blocks_first, len(tokens) // 4) * 4
    whole = NS.chain_keys(tokens)
    head = NS.chain_keys(tokens[:split])
    tail = NS.chain_keys(tokens[split:], parent=head[-1] if head else None)
    assert head + tail == whole


def test_parent_changes_every_key() -> None:
    """A different predecessor means a different prefix, so no key may collide."""
    other = NS.chain_keys(TOKENS, parent=bytes(16))
    assert other != NS.chain_keys(TOKENS)
    assert not set(other) & set(NS.chain_keys(TOKENS))


def test_different_namespaces_give_different_keys() -> None:
    """Every namespace field scopes the keys: KV of one config must never serve another."""
    base = Namespace(model="m", dtype="float16", block_size=4)
    variants = [
        base,
        replace(base, model="m2"),
        replace(base, dtype="bfloat16"),
        replace(base, block_size=8),
        replace(base, layout="NHD"),
        replace(base, tp_rank=0, tp_size=2),
        replace(base, tp_rank=1, tp_size=2),
        replace(base, lora="a"),
        replace(base, cache_salt="a"),
        replace(base, lora=""),
        replace(base, extra=(("k", "v"),)),
        replace(base, extra=(("k", "w"),)),
    ]
    assert len({ns.digest for ns in variants}) == len(variants)
    tokens = list(range(16))
    first = {ns.chain_keys(tokens)[0] for ns in variants}
    assert len(first) == len(variants)
    assert len({ns.engine_key(7) for ns in variants}) == len(variants)


def test_extra_order_in_namespace_does_not_matter() -> None:
    """``extra`` is a set of settings: sorted before hashing."""
    a = Namespace(model="m", dtype="d", block_size=4, extra=(("a", "1"), ("b", "2")))
    b = Namespace(model="m", dtype="d", block_size=4, extra=(("b", "2"), ("a", "1")))
    assert a.canonical_json() == b.canonical_json()
    assert a.digest == b.digest


def test_different_extra_gives_different_keys() -> None:
    """Per-block extras (image hashes, ...) must separate otherwise equal token blocks."""
    t = list(range(4))
    variants: list[list[Any]] = [
        [[1]], [["1"]], [[b"\x01"]], [[2]], [[1, 1]], [["a", "b"]], [["ab"]],
        [[b""]], [[""]], [[0]], [[-1]], [[2**255 - 1]], [[-(2**255)]],
    ]
    keys = [NS.chain_keys(t, extra=e)[0] for e in variants]
    keys.append(NS.chain_keys(t)[0])
    assert len(set(keys)) == len(keys)


def test_no_extra_equals_empty_extra() -> None:
    """FORMAT.md: None and an empty item list both encode as a zero count."""
    assert NS.chain_keys(TOKENS, extra=[None, None]) == NS.chain_keys(TOKENS)
    assert NS.chain_keys(TOKENS, extra=[[], ()]) == NS.chain_keys(TOKENS)


def test_extra_accepts_bytearray_and_memoryview_items() -> None:
    """Bytes-like items hash as their bytes."""
    want = NS.chain_keys(TOKENS, extra=[[b"\xde\xad"], None])
    for item in (bytearray(b"\xde\xad"), memoryview(b"\xde\xad")):
        extra: list[Any] = [[item], None]
        assert NS.chain_keys(TOKENS, extra=extra) == want


namespaces = st.builds(
    lambda model, dtype, bs, layout, tp, lora, salt, extra: Namespace(
        model=model, dtype=dtype, block_size=bs, layout=layout, tp_rank=tp[0],
        tp_size=tp[1], lora=lora, cache_salt=salt, extra=tuple(sorted(extra))),
    st.text(), st.text(), st.integers(1, 4096), st.text(),
    st.integers(1, 8).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
    st.none() | st.text(), st.none() | st.text(),
    st.lists(st.tuples(st.text(), st.text()), max_size=4, unique_by=lambda kv: kv[0]),
)


@given(namespaces)
def test_namespace_json_round_trip(ns: Namespace) -> None:
    """The canonical JSON stored in the meta table must give back the same namespace."""
    text = ns.canonical_json()
    again = Namespace.from_json(text)
    assert again == ns
    assert again.digest == ns.digest
    assert again.canonical_json() == text
    assert json.loads(text)["hash_version"] == 1


def test_namespace_json_round_trip_of_vectors() -> None:
    assert Namespace.from_json(NS_JSON) == NS
    assert Namespace.from_json(NS2_JSON).digest == NS2.digest


def test_namespace_json_round_trip_with_unsorted_extra() -> None:
    assert Namespace.from_json(NS2.canonical_json()) == NS2


# ----------------------------------------------------------------- accepted token containers

def test_token_containers_give_identical_keys() -> None:
    """Engines hand over lists, NumPy arrays or torch tensors; the key must not care."""
    tokens = [0, 1, 2, 3, 70000, 151642, 2**31, 2**32 - 1, 9]
    want = NS.chain_keys(tokens)
    assert len(want) == 2
    containers: list[Any] = [
        tuple(tokens),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=np.uint64),
        np.array(tokens, dtype=">u4"),  # big-endian input is re-encoded little-endian
        np.repeat(np.array(tokens, dtype=np.int64), 2)[::2],  # strided view
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int64).repeat_interleave(2)[::2],  # non-contiguous
    ]
    for c in containers:
        assert NS.chain_keys(c) == want, type(c)
    small = [5, 6, 7, 8]
    for c in (np.array(small, dtype=np.int8), np.array(small, dtype=np.uint16),
              torch.tensor(small, dtype=torch.int32), torch.tensor(small, dtype=torch.uint8)):
        assert NS.chain_keys(c) == NS.chain_keys(small)


def test_empty_and_short_token_lists_give_no_keys() -> None:
    assert NS.chain_keys([]) == []
    assert NS.chain_keys(np.array([], dtype=np.float64)) == []
    assert NS.chain_keys([1, 2, 3]) == []


# ----------------------------------------------------------------- errors

@pytest.mark.parametrize("tokens", [
    [0, 1, -1, 3],
    np.array([0, 1, -1, 3], dtype=np.int64),
    torch.tensor([0, 1, -1, 3]),
], ids=["list", "numpy", "torch"])
def test_negative_token_ids_are_refused(tokens: Any) -> None:
    with pytest.raises(InvalidKeyError, match=r"\[0, 2\*\*32\)"):
        NS.chain_keys(tokens)


@pytest.mark.parametrize("tokens", [
    [0, 1, 2**32, 3],
    np.array([0, 1, 2**32, 3], dtype=np.int64),
    np.array([0, 1, 2**64 - 1, 3], dtype=np.uint64),
    torch.tensor([0, 1, 2**32, 3]),
], ids=["list", "numpy-int64", "numpy-uint64", "torch"])
def test_token_ids_of_2_pow_32_or_more_are_refused(tokens: Any) -> None:
    """Silently wrapping to u32 would make different prompts share keys."""
    with pytest.raises(InvalidKeyError, match=r"\[0, 2\*\*32\)"):
        NS.chain_keys(tokens)


@pytest.mark.parametrize("tokens", [
    [0.0, 1.0, 2.0, 3.0],
    np.arange(4, dtype=np.float32),
    torch.arange(4, dtype=torch.float16),
    np.array([True, False, True, False]),
    torch.tensor([True, False, True, False]),
], ids=["list", "numpy-float", "torch-float", "numpy-bool", "torch-bool"])
def test_non_integer_token_arrays_are_refused(tokens: Any) -> None:
    with pytest.raises(InvalidKeyError, match="integers"):
        NS.chain_keys(tokens)


@pytest.mark.parametrize("tokens", [
    [[0, 1, 2, 3], [4, 5, 6, 7]],
    np.arange(8).reshape(2, 4),
    torch.arange(8).reshape(2, 4),
    np.int64(3),
], ids=["list", "numpy", "torch", "scalar"])
def test_token_arrays_that_are_not_1d_are_refused(tokens: Any) -> None:
    """A batch of prompts is not one prompt."""
    with pytest.raises(InvalidKeyError, match="1-D"):
        NS.chain_keys(tokens)


@pytest.mark.parametrize("item", [True, False])
def test_bool_extra_items_are_refused(item: bool) -> None:
    """bool is an int subclass; hashing it as 0/1 would be a silent ambiguity."""
    with pytest.raises(InvalidKeyError, match="bool"):
        NS.chain_keys(TOKENS, extra=[[item], None])
    with pytest.raises(InvalidKeyError, match="bool"):
        NS.engine_key(item)


@pytest.mark.parametrize("item", [2**255, -(2**255) - 1, 1.5, None, object()])
def test_unencodable_extra_items_are_refused(item: Any) -> None:
    with pytest.raises(InvalidKeyError):
        NS.chain_keys(TOKENS, extra=[[item], None])


@pytest.mark.parametrize("extra", [[], [None], [None, None, None]])
def test_extra_of_wrong_length_is_refused(extra: list[Any]) -> None:
    """One extra entry per full block, or the blocks and extras are misaligned."""
    with pytest.raises(InvalidKeyError, match="extra has"):
        NS.chain_keys(TOKENS, extra=extra)


def test_bad_parent_is_refused() -> None:
    with pytest.raises(InvalidKeyError, match="16 bytes"):
        NS.chain_keys(TOKENS, parent=bytes(15))


def test_bad_namespace_parameters_are_refused() -> None:
    with pytest.raises(InvalidKeyError, match="block_size"):
        Namespace(model="m", dtype="d", block_size=0)
    with pytest.raises(InvalidKeyError, match="tp_rank"):
        Namespace(model="m", dtype="d", block_size=4, tp_rank=2, tp_size=2)


# ----------------------------------------------------------------- check_key / check_keys

def test_check_key_accepts_16_bytes_like() -> None:
    k = bytes(range(16))
    assert check_key(k) is k
    assert check_key(bytearray(k)) == k and type(check_key(bytearray(k))) is bytes
    assert check_key(memoryview(k)) == k and type(check_key(memoryview(k))) is bytes
    assert check_keys([k, bytearray(k)]) == [k, k]
    assert check_keys(iter([k])) == [k]
    assert check_keys([]) == []


def test_check_keys_fast_path_keeps_keys_and_falls_back_for_the_rest() -> None:
    keys = [bytes([i % 256]) * 16 for i in range(1000)]
    out = check_keys(keys)
    assert out == keys and out is not keys and all(a is b for a, b in zip(out, keys))

    class Key(bytes):
        pass

    mixed = check_keys([Key(bytes(16)), bytearray(16)])  # not all plain bytes: slow path
    assert mixed == [bytes(16), bytes(16)] and type(mixed[1]) is bytes
    # lengths that would average out to 16 are still caught key by key
    with pytest.raises(InvalidKeyError, match="got 17 bytes"):
        check_keys([bytes(17), bytes(15)])


@pytest.mark.parametrize("key, message", [
    (bytes(15), "got 15 bytes"),
    (bytes(17), "got 17 bytes"),
    (b"", "got 0 bytes"),
    ("0" * 16, "got str"),
    (bytes(16).hex(), "got str"),
    (12345, "got int"),
    (None, "got NoneType"),
    ([0] * 16, "got list"),
])
def test_check_key_rejects(key: object, message: str) -> None:
    with pytest.raises(InvalidKeyError, match=message):
        check_key(key)
    with pytest.raises(InvalidKeyError, match=message):
        check_keys([bytes(16), key])


@pytest.mark.parametrize("keys", [bytes(16), bytearray(16), "0" * 16])
def test_check_keys_rejects_a_single_key(keys: object) -> None:
    """Iterating one key would yield ints (or chars), so it is refused up front."""
    with pytest.raises(InvalidKeyError, match="sequence of keys"):
        check_keys(keys)  # type: ignore[arg-type]


def test_invalid_key_error_is_a_type_error() -> None:
    """Callers that already catch TypeError keep working (kvstore/errors.py)."""
    with pytest.raises(TypeError):
        check_key(1)


def test_chain_parents() -> None:
    a, b, c = (bytes([i]) * 16 for i in range(3))
    assert chain_parents([a, b, c]) == [None, a, b]
    assert chain_parents([b, c], first_parent=a) == [a, b]
    assert chain_parents([]) == []
