"""Remote objects (kvstore/tiers/remote/objects.py, FORMAT.md "Remote objects"): the local
slot's bytes, verified on read; anything else is refused with the reason."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvstore.disk.format import SLOT_HEADER_BYTES, SlotHeader, crc32c
from kvstore.errors import CorruptionError
from kvstore.tiers.remote import objects
from tests.conformance import NS, keys, make_tensor, same

DIGEST = NS.digest
HMAC = b"k" * 32


def slot(key: bytes, value: torch.Tensor, parent: bytes | None = None) -> tuple[bytes, SlotHeader]:
    payload = value.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = SlotHeader(key=key, parent=parent, codec=0, dtype=2, shape=tuple(value.shape),
                        payload_len=len(payload), raw_len=len(payload),
                        payload_crc=crc32c(payload), seq=7)
    return header.encode() + payload + bytes(100), header  # padding, like a slot


def test_object_names_follow_the_documented_layout() -> None:
    key = keys(1)[0]
    assert objects.object_name("fleet", DIGEST, key) == f"fleet/v1/{DIGEST.hex()}/{key.hex()}"


@pytest.mark.parametrize("hmac_key", [None, HMAC])
def test_an_object_round_trips_bit_exact(hmac_key: bytes | None) -> None:
    key, value = keys(1)[0], make_tensor(torch.bfloat16, (4, 8), 1)
    raw, header = slot(key, value)
    data = objects.encode(raw, header, namespace_digest=DIGEST, hmac_key=hmac_key)
    assert len(data) == SLOT_HEADER_BYTES + header.payload_len + (
        objects.AUTH_TRAILER_BYTES if hmac_key else 0)
    assert objects.verify(data, key, namespace_digest=DIGEST, hmac_key=hmac_key) == header
    got = objects.decode(bytearray(data), header, None)
    assert same(got, value)
    view = objects.raw_payload(bytearray(data), header)  # the raw payload, no copy
    assert view is not None and same(view.reshape(value.shape), value)


def test_a_read_only_body_decodes_and_promotes_without_a_copy_or_a_warning() -> None:
    """The S3 client's response body is read-only; decode and the promotion's view read
    it in place (torch would warn on a tensor over read-only memory), and the view keeps
    the body alive after every other reference is gone."""
    key, value = keys(1)[0], make_tensor(torch.bfloat16, (4, 8), 3)
    raw, header = slot(key, value)
    body = memoryview(objects.encode(raw, header, namespace_digest=DIGEST, hmac_key=None))
    assert body.readonly
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert same(objects.decode(body, header, None, check=True), value)
        view = objects.raw_payload(body, header)
    assert view is not None
    del body
    assert same(view.reshape(value.shape), value)
    assert objects.read_only_tensor(b"").numel() == 0


@pytest.mark.parametrize("out", [False, True])
def test_decode_with_check_refuses_a_bad_payload_and_leaves_out_alone(out: bool) -> None:
    """``verify(payload=False)`` + ``decode(check=True)``: the CRC32C is taken while
    decoding; a flipped payload bit raises before the caller's ``out`` is written."""
    key, value = keys(1)[0], make_tensor(torch.bfloat16, (4, 8), 4)
    raw, header = slot(key, value)
    data = bytearray(objects.encode(raw, header, namespace_digest=DIGEST, hmac_key=None))
    data[SLOT_HEADER_BYTES + 5] ^= 0x10
    assert objects.verify(data, key, namespace_digest=DIGEST, hmac_key=None,
                          payload=False) == header
    target = torch.zeros(4, 8, dtype=torch.bfloat16) if out else None
    with pytest.raises(CorruptionError, match="checksum"):
        objects.decode(data, header, target, check=True)
    assert target is None or not target.any()


def _bad(data: bytes, key: bytes, hmac_key: bytes | None, why: str) -> None:
    with pytest.raises(CorruptionError, match=why):
        objects.verify(data, key, namespace_digest=DIGEST, hmac_key=hmac_key)


def test_bad_crc_wrong_key_truncation_and_foreign_objects_are_refused() -> None:
    k0, k1 = keys(2)
    raw, header = slot(k0, make_tensor(torch.bfloat16, (4, 8), 2))
    data = bytearray(objects.encode(raw, header, namespace_digest=DIGEST, hmac_key=None))
    flipped = bytearray(data)
    flipped[SLOT_HEADER_BYTES + 3] ^= 1
    _bad(bytes(flipped), k0, None, "checksum")
    _bad(bytes(data), k1, None, "another block")
    _bad(bytes(data[:-1]), k0, None, "bytes")
    _bad(b"not a kvstore object at all" * 20, k0, None, "magic")


def test_hmac_key_refuses_unsigned_and_foreign_signed_objects() -> None:
    key = keys(1)[0]
    raw, header = slot(key, make_tensor(torch.bfloat16, (4, 8), 3))
    unsigned = objects.encode(raw, header, namespace_digest=DIGEST, hmac_key=None)
    _bad(unsigned, key, HMAC, "not signed")
    other = objects.encode(raw, header, namespace_digest=DIGEST, hmac_key=b"x" * 32)
    _bad(other, key, HMAC, "HMAC")
    # the namespace is bound into the tag: no replay under another namespace
    replay = objects.encode(raw, header, namespace_digest=bytes(16), hmac_key=HMAC)
    _bad(replay, key, HMAC, "HMAC")
    # a reader without a key still checks CRC and key of a signed object
    assert objects.verify(other, key, namespace_digest=DIGEST, hmac_key=None) == header
