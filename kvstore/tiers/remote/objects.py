"""Remote objects: one block per object, the local slot's own bytes (FORMAT.md,
"Remote objects").

An object is the slot header (256 bytes: magic, version, key, parent, codec, dtype,
shape, lengths, payload CRC32C, header CRC32C) and the payload, exactly as in the
extent file but without the 4 KiB padding, optionally followed by a 40-byte
authentication trailer (``KVSA``, version, algorithm, HMAC-SHA256).  Every object read
is verified here before a byte is used: header CRC, the key it should hold, codec and
dtype known, payload CRC32C, length, and - with an ``hmac_key`` - the tag.  The checks
are the slot verifier's own (``kvstore.io.slots.check_slot`` / ``check_payload``); only
the trailer is new.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import struct
from typing import cast

import numpy as np
import torch

from kvstore.codecs import result_buffers
from kvstore.codecs.pipeline import CODEC_RAW
from kvstore.codecs.tensors import CODE_DTYPES
from kvstore.disk.format import SLOT_HEADER_BYTES, SlotHeader
from kvstore.errors import CorruptionError
from kvstore.io import native_slots
from kvstore.io.arena import Arena, ArenaRun
from kvstore.io.slots import check_payload, check_slot, deliver

LAYOUT_VERSION = "v1"
AUTH_MAGIC = b"KVSA"
AUTH_VERSION = 1
AUTH_HMAC_SHA256 = 1
_AUTH = struct.Struct("<4sBBxx32s")
AUTH_TRAILER_BYTES = _AUTH.size  # 40
_AUTH_CONTEXT = b"kvstore-remote-v1\0"

ObjectBytes = bytes | bytearray | memoryview
"""An object's bytes as read (the S3 client's read-only response body) or written."""


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
           hmac_key: bytes | None) -> bytes | memoryview:
    """The object for a verified local slot (``slot`` from its first byte, at least
    header + payload long): header and payload, and the trailer when signing.  Unsigned,
    it is ``slot``'s own memory (a view, no copy of its MBs): send it before ``slot``'s
    buffer is reused."""
    n = SLOT_HEADER_BYTES + header.payload_len
    body = slot if isinstance(slot, bytes) and len(slot) == n else memoryview(slot)[:n]
    if hmac_key is None:
        return body
    trailer = _AUTH.pack(AUTH_MAGIC, AUTH_VERSION, AUTH_HMAC_SHA256,
                         _tag(hmac_key, namespace_digest, body))
    return b"".join((body, trailer))


def verify(data: ObjectBytes, key: bytes, *, namespace_digest: bytes,
           hmac_key: bytes | None, payload: bool = True) -> SlotHeader:
    """Check an object read from the remote; its header, or ``CorruptionError`` saying
    what was wrong (a ``FormatVersionError`` for a newer format).  ``payload=False``
    leaves the payload's CRC32C to ``decode(..., check=True)``, which takes it in the
    same pass as the copy out."""
    view = memoryview(data)
    header = check_slot(view, key, None)
    body_len = SLOT_HEADER_BYTES + header.payload_len
    extra = len(view) - body_len
    if extra not in (0, AUTH_TRAILER_BYTES):
        raise CorruptionError(f"object is {len(view)} bytes; its header says "
                              f"{body_len} (+{AUTH_TRAILER_BYTES} if signed)")
    if payload:
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


def read_only_tensor(data: ObjectBytes) -> torch.Tensor:
    """A flat uint8 tensor over ``data`` without a copy, also when ``data`` is read-only
    (the S3 client's response body).  torch has no read-only tensors and warns on
    ``frombuffer`` of one; kvstore only ever reads these (a decode copies out of them,
    a promotion's staging copies them into the arena), so the tensor is built on a
    ctypes alias of the buffer's memory, which holds ``data`` alive."""
    array = np.frombuffer(data, dtype=np.uint8)
    if array.size == 0:
        return torch.empty(0, dtype=torch.uint8)
    if array.flags.writeable:
        return torch.from_numpy(array)
    alias = (ctypes.c_uint8 * array.size).from_address(array.ctypes.data)
    alias._kvstore_holds = array  # type: ignore[attr-defined]
    return torch.frombuffer(alias, dtype=torch.uint8)


class _Buffer:
    """Object bytes shaped like the staging arena, so that the slot decoder
    (``kvstore.io.slots.deliver``) decodes remote blocks exactly like local ones."""

    def __init__(self, data: ObjectBytes) -> None:
        self.view = memoryview(data)
        self.tensor = read_only_tensor(data)
        self.array = np.frombuffer(data, dtype=np.uint8)


def decode(data: ObjectBytes, header: SlotHeader, out: torch.Tensor | None, *,
           check: bool = False) -> torch.Tensor:
    """The block's tensor (into ``out`` when given) from an object ``verify`` accepted
    (``header`` is what it returned).  ``check``: ``verify`` left the payload's CRC32C
    out (``payload=False``): it is taken here, raising ``CorruptionError`` before
    ``out`` is written; a raw payload into new memory is checked while it is copied (one
    pass over bytes that just came off the network, not two)."""
    if check and out is None and header.codec == CODEC_RAW and native_slots.available():
        payload = memoryview(data)[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + header.payload_len]
        result = result_buffers.empty(header.shape, CODE_DTYPES[header.dtype])
        copy = result.reshape(-1).view(torch.uint8).numpy()
        if native_slots.crc32c(payload, copy_to=copy) != header.payload_crc:
            raise CorruptionError("payload checksum mismatch")
        return result
    if check:
        check_payload(data, header)
    run = ArenaRun(cast(Arena, _Buffer(data)), 0, len(data))
    return deliver(run, header.codec, header.dtype, header.shape, header.payload_len, out)


def raw_payload(data: ObjectBytes, header: SlotHeader) -> torch.Tensor | None:
    """A raw (uncompressed) payload as a flat tensor viewing ``data`` (no copy; read it
    only); None for an encoded one."""
    if header.codec != CODEC_RAW:
        return None
    payload = read_only_tensor(data)[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + header.raw_len]
    return payload.view(CODE_DTYPES[header.dtype])
