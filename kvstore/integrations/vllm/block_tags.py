"""What the vLLM connector keeps per stored block for vLLM's KV events: the tag given
to ``put_many(tags=)`` (docs/events.md, "vLLM's KV events").

A store key is a one-way digest of vLLM's block hash, so what a router needs of a
block (vLLM's own hash, its parent's, the token ids, the LoRA name, the extra keys, the
KV cache group) is kept beside it, as the block's tag, and comes back with every event
of the block and in the snapshot after a restart.  A tag is::

    scope (16 bytes: the namespace digest of the rank's key scope)
    || version (1 byte, 1)
    || msgpack array [hash, parent or nil, [token ids], lora name or nil,
                      [extra keys per vLLM's event] or nil, group index]

The scope comes first so that ``snapshot(tag_prefix=scope)`` lists exactly one
engine's (one rank's, one weight scope's) blocks.  msgpack (msgspec), never pickle: the
tag lands on disk.  The scheduler encodes the body (it knows the tokens and the
hashes); the worker puts its scope in front (it knows the namespace).

Kept apart from :mod:`kvstore.integrations.vllm` so that it imports without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["SCOPE_BYTES", "BlockInfo", "body_in_scope", "decode", "encode", "scoped_tag"]

SCOPE_BYTES = 16  # a namespace digest (kvstore.keys: 128 bits)
_VERSION = 1

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class BlockInfo:
    """One stored block as vLLM's ``BlockStored`` names it: ``hash`` and ``parent`` are
    vLLM's raw block hashes (bytes), ``token_ids`` the block's tokens, ``extra_keys`` the
    block's entry of the event's ``extra_keys`` (untagged, as vLLM publishes them),
    ``group`` the KV cache group."""

    hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group: int = 0


def encode(info: BlockInfo) -> bytes:
    """The tag's body (without the scope)."""
    extra = None if info.extra_keys is None else list(info.extra_keys)
    return bytes([_VERSION]) + _encoder.encode(
        [info.hash, info.parent, list(info.token_ids), info.lora_name, extra, info.group])


def _tuples(value: Any) -> Any:
    """msgpack gives arrays back as lists; vLLM's extra keys are tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def decode(body: bytes) -> BlockInfo:
    """A tag's body back; ValueError when it is not one this module wrote (another
    version, another writer's tag, truncated)."""
    if not body or body[0] != _VERSION:
        raise ValueError("not a vLLM connector block tag of version 1")
    try:
        fields = _decoder.decode(body[1:])
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed vLLM connector block tag: {e}") from e
    if not (isinstance(fields, list) and len(fields) == 6):
        raise ValueError("malformed vLLM connector block tag: not a 6-item array")
    hash_, parent, tokens, lora, extra, group = fields
    if not isinstance(hash_, bytes) or not (parent is None or isinstance(parent, bytes)) \
            or not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens) \
            or not (lora is None or isinstance(lora, str)) \
            or not (extra is None or isinstance(extra, list)) \
            or isinstance(group, bool) or not isinstance(group, int):
        raise ValueError("malformed vLLM connector block tag: a field of the wrong type")
    return BlockInfo(hash_, parent, tuple(tokens), lora,
                     None if extra is None else tuple(_tuples(e) for e in extra), group)


def scoped_tag(scope: bytes, body: bytes) -> bytes:
    """The tag stored: the rank's scope, then the body."""
    return scope + body


def body_in_scope(tag: bytes | None, scope: bytes) -> bytes | None:
    """A stored tag's body if the tag belongs to ``scope`` (else None: untagged, or
    another scope's block)."""
    if tag is None or len(tag) <= SCOPE_BYTES or not tag.startswith(scope):
        return None
    return tag[SCOPE_BYTES:]
