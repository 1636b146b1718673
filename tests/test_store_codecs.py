"""Blocks written through a codec: lossless ones bit-exact, FP8 within its error, both
after a reopen; the codec each block used is recorded in it, so reads need no option."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvstore
from kvstore import fsck
from kvstore.codecs import CodecSpec, KVLayout
from tests.conformance import NS, SMALL_EXTENT, keys, make_tensor, same

pytestmark = pytest.mark.anyio

LAYOUT = KVLayout(kv_axis=0, token_axis=2, head_axis=3)  # [2, layers, tokens, heads, dim]


def kv_blocks(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [make_tensor(dtype, (2, 2, 16, 4, 64), i) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
async def test_lossless_zstd_is_bit_exact_and_smaller(tmp_path: Path, dtype: torch.dtype) -> None:
    values = kv_blocks(6, dtype)
    ks = keys(6)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT, codec=CodecSpec(zstd=True)) as store:
        await store.put_many(ks, values)
        stats = store.stats()
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:  # no codec option on read
        got = await store.get_many(ks)
    assert all(same(g, v) for g, v in zip(got, values))
    assert stats.compression_ratio > 1.05
    assert fsck.check(str(tmp_path), deep=True).findings == []


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
async def test_fp8_round_trip_within_its_error(tmp_path: Path, fp8: str) -> None:
    values = kv_blocks(4, torch.bfloat16)
    ks = keys(4)
    spec = CodecSpec(fp8=fp8, zstd=True, layout=LAYOUT)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT) as store:
        result = await store.put_many(ks, values, codec=spec)
        got = await store.get_many(ks)
        out = torch.empty_like(values[0])
        assert await store.get(ks[0], out=out) is out
        stats = store.stats()
    assert result.bytes_written < sum(v.numel() * 2 for v in values) * 0.6
    assert stats.compression_ratio > 1.9
    bound = 0.08 if fp8 == "e4m3" else 0.16
    for g, v in zip(got, values):
        assert g is not None and g.dtype == v.dtype and g.shape == v.shape
        err = ((g.float() - v.float()).norm() / v.float().norm()).item()
        assert err < bound
    assert torch.equal(out, got[0])


async def test_integer_blocks_stay_raw_under_an_fp8_codec(tmp_path: Path) -> None:
    value = make_tensor(torch.int32, (100,), 3)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT, codec=CodecSpec(fp8="e4m3")) as store:
        await store.put(keys(1)[0], value)
        assert same(await store.get(keys(1)[0]), value)


@pytest.mark.parametrize("spec", [CodecSpec(fp8="e4m3", layout=LAYOUT),
                                  CodecSpec(fp8="e5m2", zstd=True, layout=LAYOUT),
                                  CodecSpec(zstd=True)], ids=["fp8", "fp8+zstd", "zstd"])
async def test_a_batch_encoded_over_the_cores_decodes_like_blocks_encoded_one_by_one(
        tmp_path: Path, spec: CodecSpec) -> None:
    """Batches of 1 MiB and more are encoded by one worker thread per core; every block
    must come back exactly as the codec encodes it alone (no block mixed up with
    another's payload, no thread sharing a codec context)."""
    from kvstore import codecs

    values = [make_tensor(torch.bfloat16, (2, 2, 64, 8, 64), i) for i in range(9)]  # 9 x 256 KiB
    ks = keys(9)
    async with kvstore.open(tmp_path, namespace=NS, extent_bytes=SMALL_EXTENT * 4) as store:
        await store.put_many(ks, values, codec=spec)
        got = await store.get_many(ks)
    for g, v in zip(got, values):
        codec, payload = codecs.encode(v, spec)
        alone = codecs.decode(codec, payload, v.dtype, tuple(v.shape))
        assert g is not None and torch.equal(g, alone)
