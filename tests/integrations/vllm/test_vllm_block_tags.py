"""The vLLM connector's per-block tag (vLLM's hashes, tokens, LoRA name, extra keys,
group): encoded without pickle, read back exactly, refused when it is not one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.integrations.vllm import block_tags
from kvstore.integrations.vllm.block_tags import BlockInfo, body_in_scope, scoped_tag

SCOPE_A, SCOPE_B = b"A" * 16, b"B" * 16

extra_entry = st.one_of(st.none(), st.tuples(st.text(max_size=8)),
                        st.tuples(st.tuples(st.text(max_size=8), st.integers(0, 1 << 20)),
                                  st.text(max_size=8)))
infos = st.builds(
    BlockInfo, hash=st.binary(min_size=32, max_size=32),
    parent=st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
    token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=64).map(tuple),
    lora_name=st.one_of(st.none(), st.text(max_size=16)), extra_keys=extra_entry,
    group=st.integers(0, 7))


@given(infos)
def test_a_tag_reads_back_as_written(info: BlockInfo) -> None:
    body = block_tags.encode(info)
    assert block_tags.decode(body) == info
    tag = scoped_tag(SCOPE_A, body)
    assert body_in_scope(tag, SCOPE_A) == body
    assert body_in_scope(tag, SCOPE_B) is None  # another scope's block


def test_a_block_size_32_tag_is_small() -> None:
    info = BlockInfo(b"h" * 32, b"p" * 32, tuple(range(1000, 1032)))
    assert len(scoped_tag(SCOPE_A, block_tags.encode(info))) < 256


@pytest.mark.parametrize("body", [b"", b"\x02" + b"\x90", b"\x01\xff\x00", b"\x01\x93\x01\x02\x03",
                                  b"\x01" + block_tags.encode(BlockInfo(b"h", None, ()))[1:-1]])
def test_what_is_not_a_tag_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        block_tags.decode(body)


def test_untagged_and_short_tags_are_in_no_scope() -> None:
    assert body_in_scope(None, SCOPE_A) is None
    assert body_in_scope(SCOPE_A, SCOPE_A) is None  # a scope and no body


def test_the_scope_is_a_namespace_digest() -> None:
    from tests.conformance import NS

    assert len(NS.digest) == block_tags.SCOPE_BYTES
