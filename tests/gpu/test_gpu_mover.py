"""The data mover (kvstore/cuda/mover.py), get_many(out=CUDA) and a put's CUDA values on a
real GPU, under ``torch.cuda.set_sync_debug_mode("error")`` around the engine-side calls
(a synchronising torch call raises): saves copied out after each layer's write, loads
read after their layer's event, FP8 payloads byte-identical to ``kvstore.codecs.pipeline``.
Skipped where CUDA is not usable (tests/cuda covers the same through the stand-in)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import kvstore
from kvstore import cuda
from kvstore._cuda_path import CUDA_COPIER
from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec, KVLayout
from kvstore.codecs.tensors import encoded_block
from kvstore.cuda import paged
from kvstore.cuda.mover import Mover

pytestmark = [
    pytest.mark.skipif(not cuda.available(), reason=f"no CUDA: {cuda.reason()}"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA"),
]
SHAPE = (2, 64, 16, 8, 128)  # Llama-3-8B's per-layer paged cache, 64 blocks


@contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _layers(n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(SHAPE, generator=g, device="cuda").to(torch.bfloat16)
            for _ in range(n)]


@pytest.mark.anyio
async def test_save_after_each_layers_write_and_load_before_its_read() -> None:
    layers = _layers()
    fresh = _layers(seed=1)
    m = Mover(layers, "kv_first", staging_bytes=64 << 20)
    ids = [5, 9, 40]
    with no_sync():
        batch = m.begin_save(ids)
        assert batch is not None
        for li, layer in enumerate(layers):
            torch.cuda._sleep(1_000_000)          # a slow kernel before the write
            layer.copy_(fresh[li])                # the forward writes the layer
            m.save_layer(batch, li)
        m.end_save(batch)
    await batch.wait()
    want = paged.gather_reference(fresh, ids, "kv_first").cpu()
    assert torch.equal(batch.staged().clone(), want)
    batch.release()
    load = m.begin_load(3)
    assert load is not None
    load.staged().copy_(want.flip(0))
    with no_sync():
        m.load(load, [1, 2, 3])
        for li in range(len(layers)):
            m.wait_layer(li)    # the compute stream waits on the GPU, not this thread
    # attention's reads, queued on the compute stream after its waits
    seen = [paged.gather_reference([layer], [1, 2, 3], "kv_first") for layer in layers]
    await load.wait()
    load.release()
    for li in range(len(layers)):
        assert torch.equal(seen[li][:, 0].cpu(), want.flip(0)[:, li])
    m.close()


@pytest.mark.anyio
async def test_fp8_saves_are_the_codecs_bytes() -> None:
    layers = _layers()
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3))
    m = Mover(layers, "kv_first", staging_bytes=64 << 20, codec=spec)
    ids = [0, 17, 63]
    with no_sync():
        batch = m.begin_save(ids)
        assert batch is not None
        m.end_save(batch)
    await batch.wait()
    for got, block in zip(batch.payloads(), paged.gather_reference(layers, ids, "kv_first").cpu()):
        want = codecs.encode(block, spec)
        assert got is not None and got[0] == want[0] and np.array_equal(got[1], want[1])
    assert m.stats().copied_out_bytes < 0.6 * len(ids) * m.block_bytes
    batch.release()
    m.close()


@pytest.mark.anyio
async def test_fp8_payloads_from_the_gpu_are_stored_as_they_are(tmp_path: Path) -> None:
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3))
    layers = _layers(seed=3)
    m = Mover(layers, "kv_first", staging_bytes=64 << 20, codec=spec)
    with no_sync():
        batch = m.begin_save([2, 3])
        assert batch is not None
        m.end_save(batch)
    await batch.wait()
    values = [encoded_block(p[0], p[1], m.dtype, m.block_shape)
              for p in batch.payloads() if p is not None]
    keys = [b"\x41" * 16, b"\x42" * 16]
    async with kvstore.open(tmp_path, extent_bytes=64 << 20, codec=spec) as store:
        assert (await store.put_many(keys, values)).written == 2
        got = await store.get_many(keys)
    batch.release()
    m.close()
    for g, b in zip(got, paged.gather_reference(layers, [2, 3], "kv_first").cpu()):
        want = codecs.decode(*codecs.encode(b, spec), b.dtype, tuple(b.shape))
        assert g is not None and torch.equal(g.view(torch.int16), want.view(torch.int16))


@pytest.mark.anyio
async def test_store_device_paths_never_synchronise(tmp_path: Path) -> None:
    blocks = [torch.randn(1 << 19, device="cuda").to(torch.float16) for _ in range(3)]
    keys = [bytes([i]) * 16 for i in range(3)]
    async with kvstore.open(tmp_path, extent_bytes=64 << 20) as store:
        with no_sync():
            values = await CUDA_COPIER.to_host(blocks)
        await store.put_many(keys, values)
        outs = [torch.empty_like(b) for b in blocks]
        with no_sync():
            got = await store.get_many(keys, outs)
    assert all(g is o for g, o in zip(got, outs))
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))


@pytest.mark.anyio
async def test_fp8_blocks_read_into_cuda_tensors_are_dequantised_there(tmp_path: Path) -> None:
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3))
    blocks = [b.cpu() for b in paged.gather_reference(_layers(seed=5), [0, 1], "kv_first")]
    keys = [b"\x51" * 16, b"\x52" * 16]
    async with kvstore.open(tmp_path, extent_bytes=64 << 20, codec=spec) as store:
        await store.put_many(keys, blocks)
        outs = [torch.empty(b.shape, dtype=b.dtype, device="cuda") for b in blocks]
        with no_sync():
            got = await store.get_many(keys, outs)
    assert all(g is o for g, o in zip(got, outs))
    for o, b in zip(outs, blocks):
        want = codecs.decode(*codecs.encode(b, spec), b.dtype, tuple(b.shape))
        assert torch.equal(o.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.anyio
async def test_device_loads_land_from_the_arena_and_scatter_without_a_sync(
        tmp_path: Path) -> None:
    layers = _layers()
    m = Mover(layers, "kv_first", staging_bytes=64 << 20, device_loads=True)
    blocks = [b.cpu() for b in paged.gather_reference(_layers(seed=7), [0, 1, 2], "kv_first")]
    keys = [bytes([0x60 + i]) * 16 for i in range(3)]
    async with kvstore.open(tmp_path, extent_bytes=64 << 20) as store:
        await store.put_many(keys, blocks)
        with no_sync():
            batch = m.begin_load(3)
            assert batch is not None and batch.staged().device.type == "cuda"
            got = await store.get_many(keys, batch.blocks())
            assert all(g is not None for g in got)
            m.load(batch, [10, 20, 30])
            for li in range(len(layers)):
                m.wait_layer(li)
        await batch.wait()
    batch.release()
    want = torch.stack(blocks)
    assert torch.equal(paged.gather_reference(layers, [10, 20, 30], "kv_first").cpu(), want)
    m.close()
