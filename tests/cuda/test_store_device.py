"""``Store.get_many(out=CUDA tensors)`` and the put path's CUDA values go through
kvstore/cuda/copies.py: copies on kvstore's copy stream, ordered after the caller's
stream by an event, completion awaited through the eventfd; never a ``synchronize``,
never a device -> host ``.to("cpu")``.

Through the stand-in GPU (tests/cuda/standin.py, ``StandInGpu`` keeping up with every
call) and ``OnDevice`` tensors (host memory that says it is on ``cuda:0`` and records
device -> host copies).  Before this path, ``get_many(out=...)`` ended in
``torch.cuda.current_stream().synchronize()`` (which raises on this CUDA-less torch) and
``host_bytes`` copied a CUDA value with ``.to("cpu")`` (recorded).
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore._cuda_path import CUDA_COPIER
from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec, KVLayout
from kvstore.codecs.tensors import encoded_block
from kvstore.cuda import _lib, copies, paged
from kvstore.cuda.mover import Mover
from kvstore.errors import UnsupportedTensorError
from kvstore.testing import parts
from tests.cuda.standin import OnDevice, StandInGpu

pytestmark = pytest.mark.anyio


@contextmanager
def _the_gpu(gpu: StandInGpu) -> Iterator[StandInGpu]:
    """kvstore.cuda sees ``gpu`` as its one device for the duration."""
    old = _lib.reset_for_tests(gpu.runtime(devices=1, device=0))
    try:
        yield gpu
    finally:
        copies.close()
        _lib.reset_for_tests(old)


@pytest.fixture
def gpu_keeping_up() -> Iterator[StandInGpu]:
    """The stand-in GPU running whatever it can after every call."""
    with _the_gpu(StandInGpu(auto=True)) as gpu:
        yield gpu


@pytest.fixture
def gpu_held() -> Iterator[StandInGpu]:
    """The stand-in GPU whose streams run only when the test says so."""
    with _the_gpu(StandInGpu()) as gpu:
        yield gpu


def _blocks(n: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g).to(torch.float16) for _ in range(n)]


@pytest.mark.parametrize("codec", [None, CodecSpec(zstd=True)], ids=["raw", "zstd"])
async def test_get_many_into_device_tensors_never_synchronises(
        tmp_path: Path, gpu_keeping_up: StandInGpu, codec: CodecSpec | None) -> None:
    blocks = _blocks(3, 8192)
    keys = [bytes([i]) * 16 for i in range(3)]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        await store.put_many(keys, blocks, codec=codec)
        plain = [torch.zeros(8192, dtype=torch.float16) for _ in blocks]
        outs = [t.as_subclass(OnDevice) for t in plain]
        OnDevice.log.clear()
        gpu_keeping_up.syncs.clear()
        got = await store.get_many(keys, outs)
    assert all(g is o for g, o in zip(got, outs))
    assert all(torch.equal(p, b) for p, b in zip(plain, blocks))
    assert gpu_keeping_up.syncs == [] and OnDevice.log == []
    names = [n for n, _ in gpu_keeping_up.calls]
    assert names.count("kvc_memcpy_async") >= 3 and "kvc_notify_eventfd" in names
    assert copies.stats().to_device >= 3


async def test_memory_tier_hits_into_device_tensors_are_enqueued_copies(
        tmp_path: Path, gpu_keeping_up: StandInGpu) -> None:
    """A memory-tier hit into a CUDA ``out`` is one copy from the page-locked region on
    kvstore's copy stream, awaited through the eventfd (before: ``out.copy_(...)`` on
    the caller's stream, which waits for the GPU on a real device)."""
    blocks = _blocks(3, 8192, seed=5)
    keys = [bytes([i + 40]) * 16 for i in range(3)]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20, memory_bytes=1 << 20) as store:
        await store.put_many(keys, blocks)   # write-through: now in memory
        plain = [torch.zeros(8192, dtype=torch.float16) for _ in blocks]
        outs = [t.as_subclass(OnDevice) for t in plain]
        OnDevice.log.clear()
        gpu_keeping_up.syncs.clear()
        before = copies.stats().to_device
        got = await store.get_many(keys, outs)
        assert store.stats().memory_hits == 3
    assert all(g is o for g, o in zip(got, outs))
    assert all(torch.equal(p, b) for p, b in zip(plain, blocks))
    assert gpu_keeping_up.syncs == [] and OnDevice.log == []
    assert copies.stats().to_device - before == 3
    assert "kvc_notify_eventfd" in [n for n, _ in gpu_keeping_up.calls]


async def test_a_puts_device_values_reach_the_host_by_awaited_copies(
        gpu_keeping_up: StandInGpu) -> None:
    blocks = _blocks(2, 4096, seed=1)
    values = [b.clone().as_subclass(OnDevice) for b in blocks]
    OnDevice.log.clear()
    staged = await CUDA_COPIER.to_host(values)
    assert [type(t) for t in staged] == [torch.Tensor, torch.Tensor]
    assert all(s.device.type == "cpu" and torch.equal(s, b) for s, b in zip(staged, blocks))
    assert gpu_keeping_up.syncs == [] and OnDevice.log == []
    pool = copies._staging()
    assert pool.stats().in_use_bytes > 0
    del staged
    gc.collect()
    assert pool.stats().in_use_bytes == 0   # the staging came back with its tensors


async def test_cpu_values_and_no_library_leave_values_alone(no_library: _lib.Runtime) -> None:
    cpu = _blocks(1, 64)
    assert await CUDA_COPIER.to_host(cpu) is cpu


async def test_put_many_of_device_tensors_never_synchronises(
        tmp_path: Path, gpu_keeping_up: StandInGpu) -> None:
    blocks = _blocks(3, 8192, seed=2)
    keys = [bytes([i + 10]) * 16 for i in range(3)]
    values = [b.clone().as_subclass(OnDevice) for b in blocks]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        OnDevice.log.clear()
        gpu_keeping_up.syncs.clear()
        result = await store.put_many(keys, values)
        assert OnDevice.log == [] and gpu_keeping_up.syncs == []   # before: .to("cpu")
        assert result.written == 3
        got = await store.get_many(keys)
    assert all(g is not None and torch.equal(g, b) for g, b in zip(got, blocks))



async def test_a_put_copies_only_the_device_values_it_writes(
        tmp_path: Path, gpu_keeping_up: StandInGpu) -> None:
    """Deduplicated blocks never leave the GPU: the put decides first, then copies the
    values of the blocks it writes (before, every value was copied, then most of a
    prefix's blocks thrown away as already stored)."""
    blocks = _blocks(5, 4096, seed=3)
    keys = [bytes([i + 40]) * 16 for i in range(5)]
    values = [b.clone().as_subclass(OnDevice) for b in blocks]

    def copies_out() -> int:
        return sum(n == "kvc_memcpy_async" for n, _ in gpu_keeping_up.calls)

    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        await store.put_many(keys[:3], values[:3])
        before, before_memcpy = copies.stats().to_host, copies_out()
        result = await store.put_many(keys, values)
        assert (result.written, result.deduplicated) == (2, 3)
        assert copies.stats().to_host - before == 2 and copies_out() - before_memcpy == 2
        again = await store.put_many(keys, values)
        assert (again.written, again.deduplicated) == (0, 5)
        assert copies.stats().to_host - before == 2 and copies_out() - before_memcpy == 2
        got = await store.get_many(keys)
    assert all(g is not None and torch.equal(g, b) for g, b in zip(got, blocks))
    assert OnDevice.log == [] and gpu_keeping_up.syncs == []


async def test_without_the_library_a_deduplicated_put_touches_no_device_memory(
        tmp_path: Path, no_library: _lib.Runtime) -> None:
    blocks = _blocks(2, 1024, seed=4)
    keys = [bytes([i + 50]) * 16 for i in range(2)]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        await store.put_many(keys, blocks)
        OnDevice.log.clear()
        result = await store.put_many(keys, [b.clone().as_subclass(OnDevice) for b in blocks])
        assert (result.written, result.deduplicated) == (0, 2)
        assert OnDevice.log == []   # before: host_bytes copied each value with .to("cpu")



async def test_without_the_library_gets_into_device_tensors_never_synchronise(
        tmp_path: Path, no_library: _lib.Runtime) -> None:
    """No library: the reads hand torch's copy collector in where torch drives the
    device; here (torch without CUDA, a stand-in tensor) the copy is torch's own. Before,
    every such read ended in ``torch.cuda.current_stream().synchronize()``, which waits
    for all the caller's queued work (and raises on this CUDA-less torch)."""
    blocks = _blocks(2, 2048, seed=6)
    keys = [bytes([i + 70]) * 16 for i in range(2)]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        await store.put_many(keys, blocks)
        outs = [torch.zeros(2048, dtype=torch.float16).as_subclass(OnDevice) for _ in keys]
        OnDevice.log.clear()
        got = await store.get_many(keys, outs)
        assert OnDevice.log == []
    assert all(g is o for g, o in zip(got, outs))
    assert all(torch.equal(o.as_subclass(torch.Tensor), b) for o, b in zip(outs, blocks))

async def _cancel_with_copies_in_flight(gpu: StandInGpu, call: Callable[[], Awaitable[object]],
                                        held: Callable[[], bool]) -> None:
    """Run ``call`` until its copies are queued on ``gpu``, cancel it, check that it is
    still waiting for them (``held()``: what they use is still taken), let the GPU run
    them, and check that the call then ended cancelled."""
    scope = anyio.CancelScope()
    ended = []

    async def run() -> None:
        with scope:
            await call()
        ended.append(scope.cancelled_caught)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not gpu.pending():        # until the call's copies are enqueued
            await anyio.lowlevel.checkpoint()
        assert held()
        scope.cancel()
        for _ in range(20):             # the cancelled call is still waiting
            await anyio.lowlevel.checkpoint()
        assert ended == [] and held()
        gpu.run()                       # the GPU gets there: copies, callback
    assert ended == [True]


async def test_a_put_cancelled_with_its_copies_in_flight_writes_nothing_and_leaks_nothing(
        tmp_path: Path, gpu_held: StandInGpu) -> None:
    """The put's device -> host copies are queued on a GPU that has not run them when the
    put is cancelled: the put waits for them (their staging is not handed out while the
    GPU writes it), then ends without a block stored; the staging all comes back and
    the keys can be put again."""
    blocks = _blocks(3, 8192, seed=5)
    keys = [bytes([i + 60]) * 16 for i in range(3)]
    values = [b.clone().as_subclass(OnDevice) for b in blocks]
    pool = copies._staging()
    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        await _cancel_with_copies_in_flight(gpu_held, lambda: store.put_many(keys, values),
                                            lambda: pool.stats().in_use_bytes > 0)
        assert await store.contains_many(keys) == [False] * 3
        gc.collect()
        assert pool.stats().in_use_bytes == 0
        gpu_held.auto = True
        assert (await store.put_many(keys, values)).written == 3
        got = await store.get_many(keys)
    assert all(g is not None and torch.equal(g, b) for g, b in zip(got, blocks))
    assert gpu_held.syncs == []


async def test_a_get_cancelled_with_its_copies_in_flight_keeps_the_arena_until_they_ran(
        tmp_path: Path, gpu_held: StandInGpu) -> None:
    """The copies of a read into CUDA outputs are queued on a GPU that has not run them
    when the get is cancelled: the arena runs they copy from stay taken (no other read
    may land there) until the GPU ran them, then all of the arena comes back."""
    blocks = _blocks(3, 8192, seed=8)
    keys = [bytes([i + 80]) * 16 for i in range(3)]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        await store.put_many(keys, blocks)
        idle = parts(store).arena.free_bytes
        outs = [torch.zeros(8192, dtype=torch.float16).as_subclass(OnDevice) for _ in keys]
        await _cancel_with_copies_in_flight(gpu_held, lambda: store.get_many(keys, outs),
                                            lambda: parts(store).arena.free_bytes < idle)
        assert parts(store).arena.free_bytes == idle
        # the copies that were enqueued did land whole (not half-written)
        assert all(torch.equal(o.as_subclass(torch.Tensor), b) for o, b in zip(outs, blocks))
        gpu_held.auto = True
        again = await store.get_many(keys)
    assert all(g is not None and torch.equal(g, b) for g, b in zip(again, blocks))
    assert gpu_held.syncs == []


SPEC = CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3))


async def test_fp8_quantised_on_the_gpu_is_stored_as_the_codecs_payload(
        tmp_path: Path, gpu_keeping_up: StandInGpu, host_lib: _lib.Library) -> None:
    # The mover's GPU FP8 payloads, put as EncodedBlocks: the store writes them as they
    # are, and a get returns exactly what the CPU codec's payload decodes to.
    gpu_keeping_up.host = host_lib
    g = torch.Generator().manual_seed(4)
    layers = [torch.randn((2, 6, 4, 2, 16), generator=g).to(torch.bfloat16)
              for _ in range(3)]
    mover = Mover(layers, "kv_first", staging_bytes=1 << 20, codec=SPEC,
                  lib=gpu_keeping_up, compute_stream=lambda: 7)  # type: ignore[arg-type]
    batch = mover.begin_save([1, 4])
    assert batch is not None
    mover.end_save(batch)
    await batch.wait()
    payloads = batch.payloads()
    values = [encoded_block(p[0], p[1], mover.dtype, mover.block_shape)
              for p in payloads if p is not None]
    blocks = paged.gather_reference(layers, [1, 4], "kv_first")
    keys = [b"\x21" * 16, b"\x22" * 16]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20, codec=SPEC) as store:
        result = await store.put_many(keys, values)
        assert result.written == 2
        got = await store.get_many(keys)
    for g_, b in zip(got, blocks):
        codec, payload = codecs.encode(b, SPEC)
        assert g_ is not None and torch.equal(
            g_.view(torch.int16), codecs.decode(codec, payload, b.dtype, tuple(b.shape))
            .view(torch.int16))
    batch.release()
    mover.close()


async def test_an_encoded_block_put_without_its_codec_is_refused_not_stored_as_zeros(
        tmp_path: Path) -> None:
    b = torch.randn(2, 4, 16).to(torch.float16)
    codec, payload = codecs.encode(b, CodecSpec(fp8="e4m3"))
    value = encoded_block(codec, payload, b.dtype, tuple(b.shape))
    async with kvstore.open(tmp_path, extent_bytes=4 << 20) as store:
        with pytest.raises(UnsupportedTensorError, match="put it with that codec"):
            await store.put_many([b"\x31" * 16], [value])              # raw
        with pytest.raises(UnsupportedTensorError, match="is encoded with codec"):
            await store.put_many([b"\x31" * 16], [value], codec=CodecSpec(fp8="e5m2"))
        assert await store.get_many([b"\x31" * 16]) == [None]
        await store.put_many([b"\x31" * 16], [value], codec=CodecSpec(fp8="e4m3"))
        (got,) = await store.get_many([b"\x31" * 16])
    assert got is not None and torch.equal(got, codecs.decode(codec, payload, b.dtype,
                                                                tuple(b.shape)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_fp8_blocks_read_into_device_tensors_are_dequantised_on_the_gpu(
        tmp_path: Path, gpu_keeping_up: StandInGpu, host_lib: _lib.Library,
        dtype: torch.dtype) -> None:
    # The payload (half the bytes) goes to the GPU from the arena; the kernel (its host
    # twin behind the stand-in) writes exactly what the CPU codec decodes.
    gpu_keeping_up.host = host_lib
    g = torch.Generator().manual_seed(5)
    blocks = [torch.randn((3, 2, 4, 2, 16), generator=g).to(dtype) for _ in range(3)]
    keys = [bytes([i + 0x50]) * 16 for i in range(3)]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20, codec=SPEC) as store:
        await store.put_many(keys, blocks)
        plain = [torch.zeros_like(b) for b in blocks]
        outs = [p.as_subclass(OnDevice) for p in plain]
        before = copies.stats().fp8_decoded
        gpu_keeping_up.syncs.clear()
        OnDevice.log.clear()
        got = await store.get_many(keys, outs)
    assert all(o is r for o, r in zip(outs, got))
    assert copies.stats().fp8_decoded - before == 3
    assert gpu_keeping_up.syncs == [] and OnDevice.log == []
    assert [n for n, _ in gpu_keeping_up.calls].count("kvc_fp8_decode") == 3
    # The decoder's row-group map went up through 1 MiB of staging of its own: a read
    # page-locks no put staging (256 MiB) for a few KiB.
    staged = {purpose: pool.capacity for (lib, purpose), pool in copies._pools.items()
              if lib == id(gpu_keeping_up)}
    assert staged == {"row groups": copies.ROW_GROUP_STAGING_BYTES}
    for p, b in zip(plain, blocks):
        want = codecs.decode(*codecs.encode(b, SPEC), b.dtype, tuple(b.shape))
        assert torch.equal(p.view(torch.int16), want.view(torch.int16))
