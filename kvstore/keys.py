"""Block keys: 16-byte content addresses, chained over a prefix and scoped by a namespace.

A key names one block of KV for one model/layout.  The hash is BLAKE2b with a 16-byte
(128-bit) digest and a per-purpose personalisation string, over canonical bytes only
(no pickle, no Python ``hash``), so it is stable across processes, machines and Python
versions.  FORMAT.md ("Keys") specifies the bytes and pins test vectors;
``tests/test_keys.py`` checks them.

* ``Namespace.digest`` = H_ns(canonical JSON of the namespace fields).
* chained keys: ``h_0 = parent or digest``; ``h_i = H_blk(h_{i-1} || u32 n || tokens as
  u32 LE || extra(i))`` for every *full* block of ``block_size`` tokens.
* engine keys: ``H_eng(digest || tag || u32 len || hash bytes)`` wraps a hash an engine
  computed itself (vLLM's block hashes), so it is scoped by the namespace as well.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.disk.format import KEY_BYTES
from kvstore.errors import CorruptionError, FormatVersionError, InvalidKeyError

HASH_VERSION = 1
_PERSON_NS = b"kvstore-ns-v1"
_PERSON_BLOCK = b"kvstore-blk-v1"
_PERSON_ENGINE = b"kvstore-eng-v1"

ExtraItem = int | str | bytes
"""One per-block extra key (a multimodal input hash, a LoRA id, ...)."""

_TAG_INT = 1
_TAG_STR = 2
_TAG_BYTES = 3


def _h(person: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=person)
    for p in parts:
        h.update(p)
    return h.digest()


def _encode_item(item: ExtraItem) -> bytes:
    if isinstance(item, bool):  # bool is an int subclass; refuse the ambiguity
        raise InvalidKeyError("extra key items must be int, str or bytes, not bool")
    if isinstance(item, int):
        try:
            data = item.to_bytes(32, "little", signed=True)
        except OverflowError:
            raise InvalidKeyError(f"integer extra key {item} does not fit 256 bits") from None
        tag = _TAG_INT
    elif isinstance(item, str):
        data, tag = item.encode("utf-8"), _TAG_STR
    elif isinstance(item, (bytes, bytearray, memoryview)):
        data, tag = bytes(item), _TAG_BYTES
    else:
        raise InvalidKeyError(
            f"extra key items must be int, str or bytes, not {type(item).__name__}")
    return struct.pack("<BI", tag, len(data)) + data


def _encode_extra(extra: Sequence[ExtraItem] | ExtraItem | None) -> bytes:
    if extra is None:
        items: tuple[object, ...] = ()
    elif isinstance(extra, (int, str, bytes, bytearray, memoryview)):
        items = (extra,)  # one item for this block, not a sequence of characters/bytes
    else:
        items = tuple(extra)
    return struct.pack("<I", len(items)) + b"".join(_encode_item(i) for i in items)  # type: ignore[arg-type]


def _token_bytes(tokens: Any) -> np.ndarray:
    """Token ids as a 1-D little-endian uint32 array, refusing anything not an id."""
    if hasattr(tokens, "detach"):  # torch tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidKeyError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidKeyError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise InvalidKeyError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def check_key(key: object) -> bytes:
    """Return ``key`` as ``bytes`` if it is a valid 16-byte block key, else raise."""
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise InvalidKeyError(
            f"block keys are {KEY_BYTES} bytes (from Namespace.chain_keys / engine_key), "
            f"got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise InvalidKeyError(f"block keys are {KEY_BYTES} bytes, got {len(key)} bytes")
    return key


def check_keys(keys: Iterable[object]) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, str)):
        raise InvalidKeyError("pass a sequence of keys, not a single key")
    items: list[Any] = list(keys)
    # Fast path, C-level loops only: a list of 16-byte bytes is already valid.  Checking
    # each key in Python cost ~0.2 us a key, a third of match_prefix over 8k blocks.
    if set(map(type, items)) <= {bytes} and set(map(len, items)) <= {KEY_BYTES}:
        return items
    return [check_key(k) for k in items]


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV of one block unusable by another engine configuration.

    Two engines share stored blocks exactly when their namespaces are equal.  ``extra``
    holds anything else that changes the KV bytes (quantisation, RoPE scaling, ...).
    """

    model: str
    dtype: str
    block_size: int
    layout: str = "default"
    tp_rank: int = 0
    tp_size: int = 1
    lora: str | None = None
    cache_salt: str | None = None
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Normalised so that equal namespaces compare equal however extra was ordered.
        object.__setattr__(self, "extra", tuple(sorted(tuple(kv) for kv in self.extra)))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size <= 0:
            raise InvalidKeyError(f"block_size must be a positive int, got {self.block_size!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidKeyError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")

    def canonical_json(self) -> str:
        """The exact text hashed into :attr:`digest` (sorted keys, no whitespace)."""
        doc = {
            "hash_version": HASH_VERSION, "model": self.model, "dtype": self.dtype,
            "block_size": self.block_size, "layout": self.layout, "tp_rank": self.tp_rank,
            "tp_size": self.tp_size, "lora": self.lora, "cache_salt": self.cache_salt,
            "extra": [list(kv) for kv in sorted(self.extra)],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Namespace:
        """Parse a namespace meta record; anything malformed is a CorruptionError (a
        record of a newer hash version is a FormatVersionError)."""
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CorruptionError(f"namespace record is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise CorruptionError("namespace record is not a JSON object")
        unknown = set(doc) - set(_NS_FIELDS) - {"hash_version"}
        if unknown:
            raise CorruptionError(f"namespace record has unknown members {sorted(unknown)}")
        version = doc.pop("hash_version", HASH_VERSION)
        if version != HASH_VERSION:
            raise FormatVersionError(
                f"namespace record of hash version {version!r}; this build uses {HASH_VERSION}")
        for name, types in _NS_FIELDS.items():
            if name in doc and not (isinstance(doc[name], types)
                                    and not isinstance(doc[name], bool)):
                raise CorruptionError(f"namespace member {name!r} has a wrong type")
        for name in ("model", "dtype", "block_size"):
            if name not in doc:
                raise CorruptionError(f"namespace record lacks {name!r}")
        extra = doc.get("extra", [])
        if not all(isinstance(kv, list) and len(kv) == 2 and all(isinstance(x, str) for x in kv)
                   for kv in extra):
            raise CorruptionError("namespace extra must be a list of [str, str] pairs")
        doc["extra"] = tuple(tuple(kv) for kv in extra)
        try:
            ns = cls(**doc)
            ns.canonical_json().encode("utf-8")  # lone surrogates cannot be hashed
        except (InvalidKeyError, UnicodeEncodeError) as e:
            raise CorruptionError(f"invalid namespace record: {e}") from None
        return ns

    @classmethod
    def from_record(cls, raw: bytes) -> Namespace:
        """Parse a namespace meta record as stored (UTF-8 JSON bytes)."""
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptionError("namespace record is not UTF-8") from None
        return cls.from_json(text)

    @property
    def digest(self) -> bytes:
        return _h(_PERSON_NS, self.canonical_json().encode("utf-8"))

    def chain_keys(
        self,
        tokens: Any,
        *,
        parent: bytes | None = None,
        extra: Sequence[Sequence[ExtraItem] | ExtraItem | None] | None = None,
    ) -> list[bytes]:
        """Keys of every full block of ``tokens`` (a trailing partial block gets none).

        ``parent`` continues a chain (the key of the block before ``tokens[0]``); ``extra``
        gives per-block extra keys, one entry (or ``None``) per full block.
        """
        ids = _token_bytes(tokens)
        n_blocks = len(ids) // self.block_size
        if extra is not None and len(extra) != n_blocks:
            raise InvalidKeyError(f"extra has {len(extra)} entries for {n_blocks} full blocks")
        prev = self.digest if parent is None else check_key(parent)
        head = struct.pack("<I", self.block_size)
        keys: list[bytes] = []
        for i in range(n_blocks):
            chunk = ids[i * self.block_size:(i + 1) * self.block_size].tobytes()
            prev = _h(_PERSON_BLOCK, prev, head, chunk,
                      _encode_extra(None if extra is None else extra[i]))
            keys.append(prev)
        return keys

    def engine_key(self, engine_hash: bytes | int) -> bytes:
        """Scope a hash computed by the engine (bytes or int) to this namespace."""
        return _h(_PERSON_ENGINE, self.digest, _encode_item(engine_hash))

    def engine_keys(self, engine_hashes: Iterable[bytes | int]) -> list[bytes]:
        return [self.engine_key(h) for h in engine_hashes]


_NS_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str, "dtype": str, "block_size": int, "layout": str, "tp_rank": int,
    "tp_size": int, "lora": (str, type(None)), "cache_salt": (str, type(None)), "extra": list,
}


def chain_parents(keys: Sequence[bytes], first_parent: bytes | None = None) -> list[bytes | None]:
    """Parents for ``put_many`` when ``keys`` are consecutive blocks of one chain."""
    return [first_parent, *keys[:-1]] if keys else []
