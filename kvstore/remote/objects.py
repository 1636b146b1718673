"""Remote objects: one block per object, the local slot's own bytes (FORMAT.md,
"Remote objects").

An object is the slot header (256 bytes: magic, version, key, parent, codec, dtype,
shape, lengths, payload CRC32C, header CRC32C) and the payload, exactly as in the
extent file but without the 4 KiB padding, optionally followed by a 40-byte
authentication trailer (``KVSA``, version, algorithm, HMAC-SHA256).  Every object read
is verified here before a byte is used: header CRC, the key it should hold, codec and
dtype known, payload CRC32C, length, and - with an ``hmac_key`` - the tag.  The checks
are the slot verifier's own (``kvstore.slots.check_slot`` / ``check_payload``); only
the trailer is new.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import cast

import numpy as np
import torch

from kvstore.codecs import CODEC_RAW
from kvstore.errors import CorruptionError
from kvstore.format import SLOT_HEADER_BYTES, SlotHeader
from kvstore.io.arena import Arena, ArenaRun
from kvstore.slots import check_payload, check_slot, deliver
from kvstore.tensors import CODE_DTYPES

LAYOUT_VERSION = "v1"
AUTH_MAGIC = b"KVSA"
AUTH_VERSION = 1
AUTH_HMAC_SHA256 = 1
_AUTH = struct.Struct("<4sBBxx32s")
AUTH_TRAILER_BYTES = _AUTH.size  # 40
_AUTH_CONTEXT = b"kvstore-remote-v1\0"


def namespace_prefix(prefix: str, namespace_digest: bytes) -> str:
    """The object-name prefix of one namespace: ``<prefix>/v1/<digest hex>/``."""
    return f"{prefix}/{LAYOUT_VERSION}/{namespace_digest.hex()}/"


def object_name(prefix: str, namespace_digest: bytes, key: bytes) -> str:
    return namespace_prefix(prefix, namespace_digest) + key.hex()


def _tag(hmac_key: bytes, namespace_digest: bytes, body: bytes | memoryview) -> bytes:
    # The namespace is bound too: an object cannot be replayed under another namespace.
    mac = hmac.new(hmac_key, _AUTH_CONTEXT + namespace_digest, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def encode(slot: bytes | memoryview, header: SlotHeader, *, namespace_digest: bytes,
           hmac_key: bytes | None) -> bytes:
    """The object for a verified local slot (``slot`` from its first byte, at least
    header + payload long): header and payload, and the trailer when signing."""
    body = bytes(slot[:SLOT_HEADER_BYTES + header.payload_len])
    if hmac_key is None:
        return body
    return body + _AUTH.pack(AUTH_MAGIC, AUTH_VERSION, AUTH_HMAC_SHA256,
                             _tag(hmac_key, namespace_digest, body))


def verify(data: bytes | bytearray | memoryview, key: bytes, *, namespace_digest: bytes,
           hmac_key: bytes | None) -> SlotHeader:
    """Check an object read from the remote; its header, or ``CorruptionError`` saying
    what was wrong (a ``FormatVersionError`` for a newer format)."""
    view = memoryview(data)
    header = check_slot(view, key, None)
    body_len = SLOT_HEADER_BYTES + header.payload_len
    extra = len(view) - body_len
    if extra not in (0, AUTH_TRAILER_BYTES):
        raise CorruptionError(f"object is {len(view)} bytes; its header says "
                              f"{body_len} (+{AUTH_TRAILER_BYTES} if signed)")
    check_payload(view, header)
    if extra:
        magic, version, alg, tag = _AUTH.unpack(view[body_len:])
        if magic != AUTH_MAGIC or version != AUTH_VERSION or alg != AUTH_HMAC_SHA256:
            raise CorruptionError("object has a malformed authentication trailer")
        if hmac_key is not None and not hmac.compare_digest(
                tag, _tag(hmac_key, namespace_digest, view[:body_len])):
            raise CorruptionError("object's HMAC tag does not match (written by a store "
                                  "with another hmac_key, or tampered with)")
    elif hmac_key is not None:
        raise CorruptionError("object is not signed, and hmac_key requires a valid tag")
    return header


class _Buffer:
    """Object bytes shaped like the staging arena, so that the slot decoder
    (``kvstore.slots.deliver``) decodes remote blocks exactly like local ones."""

    def __init__(self, data: bytearray) -> None:
        self.view = memoryview(data)
        self.tensor = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(
            0, dtype=torch.uint8)
        self.array = np.frombuffer(data, dtype=np.uint8)


def decode(data: bytearray, header: SlotHeader, out: torch.Tensor | None) -> torch.Tensor:
    """The block's tensor (into ``out`` when given) from an object ``verify`` accepted
    (``header`` is what it returned): the payload's CRC32C is not computed again."""
    run = ArenaRun(cast(Arena, _Buffer(data)), 0, len(data))
    return deliver(run, header.codec, header.dtype, header.shape, header.payload_len, out)


def raw_payload(data: bytearray, header: SlotHeader) -> torch.Tensor | None:
    """A raw (uncompressed) payload as a flat tensor viewing ``data`` (no copy); None for
    an encoded one."""
    if header.codec != CODEC_RAW:
        return None
    dtype = CODE_DTYPES[header.dtype]
    return torch.frombuffer(data, dtype=dtype, offset=SLOT_HEADER_BYTES,
                            count=header.raw_len // dtype.itemsize)
