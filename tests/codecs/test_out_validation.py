"""``get_many(out=...)`` refuses an output tensor that cannot hold a block, before any I/O
and as a ``KVStoreError`` (issue 31, item 7): a meta tensor (it has no memory: it was
counted as a hit with nothing written) and one whose elements share memory (``expand``:
a raw torch ``RuntimeError`` escaped midway)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
from kvstore.codecs.tensors import check_out_tensor
from kvstore.errors import KVStoreError, OutputMismatchError
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor, same

pytestmark = pytest.mark.anyio

BAD_OUTS = {
    "meta": lambda: torch.empty(16, device="meta"),
    "expanded": lambda: torch.empty(1).expand(16),
    "self-overlapping strides": lambda: torch.empty(16).as_strided((4, 4), (1, 1)),
    "sparse": lambda: torch.zeros(16).to_sparse(),
}


@pytest.mark.parametrize("name", list(BAD_OUTS))
@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory-tier"])
async def test_an_out_that_cannot_hold_the_block_is_refused_before_any_io(
        tmp_path: Path, name: str, memory: bool) -> None:
    k, = keys(1)
    value = make_tensor(torch.float32, (16,), 1)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT,
                            memory_bytes=(1 << 20) if memory else 0) as store:
        await store.put(k, value)
        before = store.stats()
        with pytest.raises(OutputMismatchError) as raised:
            await store.get_many([k], out=[BAD_OUTS[name]()])
        assert isinstance(raised.value, KVStoreError)
        after = store.stats()
        assert (after.hits, after.read_bytes, after.memory_hits) == (
            before.hits, before.read_bytes, before.memory_hits)  # nothing read, no hit
        assert same(await store.get(k, torch.empty(16)), value)  # a good out still works


@pytest.mark.parametrize("out", [
    torch.empty(4, 8)[:, ::2],  # strided, distinct elements
    torch.empty(4, 4).t(),
    torch.empty(16, 1)[:, 0],
], ids=["step", "transposed", "column"])
def test_views_with_distinct_elements_are_accepted(out: torch.Tensor) -> None:
    assert check_out_tensor(out, torch.float32, (out.numel(),)) is out
