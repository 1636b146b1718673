"""kvstore/cuda/mover.py through the recording stand-in GPU (tests/cuda/standin.py,
``StandInGpu``): streams run only when a test says so, in CUDA's order, so a copy that
is not ordered by the right event reads or writes the wrong bytes here, and every
host-blocking call is recorded.  The cache "device memory" is host memory; everything
above the ctypes boundary is the real code.  The CPU path (a CPU engine) runs the same
calls with plain copies.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

import kvstore
from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec, KVLayout
from kvstore.cuda import CudaError, _lib, copies, paged
from kvstore.cuda import fp8 as gpu_fp8
from kvstore.cuda.mover import CaptureError, Mover
from kvstore.cuda.staging import DeviceStagingPool
from tests.cuda.standin import ILLEGAL_ADDRESS, OnDevice, StandInGpu

COMPUTE = 7        # the engine's stream, as the stand-in knows it
LAYERS = 3
NUM_BLOCKS = 12
SHAPE = (2, NUM_BLOCKS, 4, 2, 8)   # kv_first: [2, blocks, block_size, heads, head_dim]


def _layers(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(LAYERS)]


def _mover(layers: list[torch.Tensor], gpu: StandInGpu | None, blocks: int = 8,
           **kw: object) -> Mover:
    block_bytes = LAYERS * 2 * 4 * 2 * 8 * layers[0].element_size()
    m = Mover(layers, "kv_first", staging_bytes=blocks * block_bytes, lib=gpu,  # type: ignore[arg-type]
              compute_stream=lambda: COMPUTE, **kw)  # type: ignore[arg-type]
    if gpu is not None:
        gpu.run()
        gpu.syncs.clear()   # construction may wait (row-group upload); the steps may not
    return m


def _expected(layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return paged.gather_reference(layers, ids, "kv_first")


pytestmark = pytest.mark.anyio


async def test_save_copies_a_layer_only_after_the_compute_stream_wrote_it(
        gpu: StandInGpu) -> None:
    layers = _layers()
    m = _mover(layers, gpu)
    fresh = _layers(seed=1)
    ids = [5, 0, 9]
    batch = m.begin_save(ids)
    assert batch is not None
    for li in range(LAYERS):
        # the engine's forward writes layer li (queued, not yet run), then saves it
        gpu.enqueue(COMPUTE, lambda li=li: layers[li].copy_(fresh[li]))
        m.save_layer(batch, li)
    m.end_save(batch)
    assert not batch.done
    gpu.run([m.save_stream])                 # the copy stream alone cannot start:
    assert gpu.pending(m.save_stream) > 0    # it waits for layer 0's event
    gpu.run()
    with anyio.fail_after(10):
        await batch.wait()
    got = torch.stack(batch.blocks())
    assert torch.equal(got, _expected(fresh, ids))
    assert gpu.syncs == []
    batch.release()
    assert m.stats().staging_in_use_bytes == 0
    order = [n for n, _ in gpu.calls if n in ("kvc_event_record", "kvc_stream_wait_event",
                                                "kvc_gather")]
    assert order == ["kvc_event_record", "kvc_stream_wait_event", "kvc_gather"] * LAYERS
    m.close()


async def test_a_staged_buffer_is_not_reused_before_its_copy_done_event(
        gpu: StandInGpu) -> None:
    layers = _layers()
    m = _mover(layers, gpu, blocks=2)
    batch = m.begin_save([1, 2])
    assert batch is not None
    m.end_save(batch)
    address = batch.lease.address
    batch.release()              # released early: the copies are still queued
    assert m.begin_save([3]) is None            # so the staging is still taken
    assert m.stats().dropped_saves == 1 and m.stats().pending_leases == 1
    gpu.run()                    # the copies and the copy-done callback run
    again = m.begin_save([3, 4])
    assert again is not None and again.lease.address == address
    assert gpu.syncs == []
    again.release()
    gpu.run()
    m.close()


async def test_an_aborted_save_frees_its_staging_only_after_its_copies(
        gpu: StandInGpu) -> None:
    # The forward raised after two layers: no end_save, nothing to put; the lease
    # comes back once the copies already enqueued have run.
    layers = _layers()
    m = _mover(layers, gpu, blocks=2)
    batch = m.begin_save([1, 2])
    assert batch is not None
    m.save_layer(batch, 0)
    m.save_layer(batch, 1)
    batch.release()
    assert m.stats().staging_in_use_bytes > 0
    gpu.run()
    assert m.stats().staging_in_use_bytes == 0 and m.stats().pending_leases == 0
    assert gpu.syncs == []
    m.close()


async def test_a_cancelled_wait_lets_the_copies_finish_before_the_staging_is_reused(
        gpu: StandInGpu) -> None:
    layers = _layers()
    m = _mover(layers, gpu, blocks=2)
    batch = m.begin_save([4])
    assert batch is not None
    m.end_save(batch)
    finished = anyio.Event()

    async def saver() -> None:
        try:
            await batch.wait()
        finally:
            batch.release()
            finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(saver)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await anyio.wait_all_tasks_blocked()
            assert not finished.is_set()        # shielded: waits for the callback
            assert m.stats().staging_in_use_bytes > 0
            gpu.run()
            with anyio.fail_after(10):
                await finished.wait()
    assert m.stats().staging_in_use_bytes == 0
    m.close()


async def test_loads_are_read_only_after_their_layer_event(gpu: StandInGpu) -> None:
    layers = _layers()
    m = _mover(layers, gpu)
    stored = _expected(_layers(seed=3), [0, 1])     # two blocks "read from NVMe"
    batch = m.begin_load(2)
    assert batch is not None
    for dst, src in zip(batch.blocks(), stored):
        dst.copy_(src)
    ids = [10, 6]
    m.load(batch, ids)
    seen: list[torch.Tensor] = []
    for li in range(LAYERS):
        m.wait_layer(li)     # the forward's attention of layer li reads after this
        gpu.enqueue(COMPUTE, lambda li=li: seen.append(
            paged.gather_reference([layers[li]], ids, "kv_first")[:, 0].clone()))
    gpu.run([COMPUTE])
    assert seen == []        # the compute stream waits (on the GPU) for layer 0
    gpu.run()
    for li in range(LAYERS):
        assert torch.equal(seen[li], stored[:, li])
    batch.release()
    assert m.stats().staging_in_use_bytes == 0
    assert gpu.syncs == []
    m.close()


async def test_without_the_wait_the_model_catches_a_read_before_the_load(
        gpu: StandInGpu) -> None:
    # The stand-in is strict enough to matter: skip wait_layer and the read sees
    # the old bytes.
    layers = _layers()
    m = _mover(layers, gpu)
    old = paged.gather_reference([layers[0]], [3], "kv_first")[:, 0].clone()
    batch = m.begin_load(1)
    assert batch is not None
    batch.blocks()[0].copy_(_expected(_layers(seed=4), [0])[0])
    m.load(batch, [3])
    seen: list[torch.Tensor] = []
    gpu.enqueue(COMPUTE, lambda: seen.append(
        paged.gather_reference([layers[0]], [3], "kv_first")[:, 0].clone()))
    gpu.run([COMPUTE])
    assert torch.equal(seen[0], old)
    gpu.run()
    batch.release()
    m.close()


def test_staging_exhaustion_drops_and_counts_instead_of_waiting(gpu: StandInGpu) -> None:
    m = _mover(_layers(), gpu, blocks=2)
    assert m.begin_save([0, 1, 2]) is None
    first = m.begin_save([0, 1])
    assert first is not None
    assert m.begin_save([2]) is None
    s = m.stats()
    assert (s.dropped_saves, s.dropped_blocks, s.saves, s.saved_blocks) == (2, 4, 1, 2)
    assert gpu.syncs == [] and gpu.pending() == 0   # nothing was enqueued for them
    first.release()
    m.close()


def test_the_copy_out_rate_cap_drops_saves_over_it() -> None:
    now = [0.0]
    layers = _layers()
    block = LAYERS * 2 * 4 * 2 * 8 * 4
    m = _mover(layers, None, blocks=8, max_save_bytes_per_s=2 * block,
               clock=lambda: now[0])
    a = m.begin_save([0, 1])
    assert a is not None
    assert m.begin_save([2]) is None       # the second's bytes are over this second's cap
    assert m.stats().rate_dropped_saves == 1 and m.stats().rate_dropped_blocks == 1
    now[0] += 0.5
    b = m.begin_save([2])
    assert b is not None
    a.release()
    b.release()
    assert m.stats().staging_in_use_bytes == 0
    m.close()


async def test_the_cpu_path_runs_the_same_calls_with_plain_copies() -> None:
    layers = _layers()
    m = _mover(layers, None)
    assert not m.cuda
    ids = [2, 7]
    batch = m.begin_save(ids)
    assert batch is not None
    for li in range(LAYERS):
        m.save_layer(batch, li)
    m.end_save(batch)
    assert batch.done
    await batch.wait()
    staged = torch.stack(batch.blocks()).clone()
    assert torch.equal(staged, _expected(layers, ids))
    batch.release()
    load = m.begin_load(2)
    assert load is not None
    for dst, src in zip(load.blocks(), staged):
        dst.copy_(src)
    m.load(load, [11, 4])
    m.wait_layer(0)
    load.release()
    assert torch.equal(_expected(layers, [11, 4]), staged)
    m.close()


SPECS = [CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3)),
         CodecSpec(fp8="e5m2", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3),
                   k_granularity="head", v_granularity="tensor"),
         CodecSpec(fp8="e4m3", zstd=True)]


@pytest.mark.parametrize("spec", SPECS, ids=["e4m3", "e5m2-head", "e4m3-zstd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_fp8_on_the_gpu_is_byte_identical_to_the_cpu_codec(
        gpu: StandInGpu, host_lib: _lib.Library, spec: CodecSpec, dtype: torch.dtype) -> None:
    gpu.host = host_lib   # the kernels' element code, compiled for the host
    layers = _layers(seed=5, dtype=dtype)
    layers[1][0, 3, 0, 0, 0] = float("nan")     # a special value in block 3
    m = _mover(layers, gpu, codec=spec)
    ids = [3, 8, 0]
    batch = m.begin_save(ids)
    assert batch is not None
    m.end_save(batch)
    gpu.run()
    await batch.wait()
    want = [codecs.encode(b, spec) for b in _expected(layers, ids)]
    got = batch.payloads()
    for (wc, wp), g in zip(want, got):
        assert g is not None
        assert g[0] == wc and np.array_equal(g[1], wp)
    # half the bytes (or less) crossed the bus
    assert m.stats().copied_out_bytes < 0.6 * len(ids) * m.block_bytes
    assert gpu.syncs == []
    batch.release()
    m.close()


async def test_fp8_block_the_codec_stores_losslessly_is_dropped_not_misencoded(
        gpu: StandInGpu, host_lib: _lib.Library) -> None:
    gpu.host = host_lib
    layers = _layers(seed=6, dtype=torch.float16)
    layers[0][1, 2, 0, 0, 0] = 40000.0      # >= 2**15 in float16: the codec stores raw
    spec = SPECS[0]
    m = _mover(layers, gpu, codec=spec)
    batch = m.begin_save([2, 5])
    assert batch is not None
    m.end_save(batch)
    gpu.run()
    await batch.wait()
    got = batch.payloads()
    assert got[0] is None and m.stats().fp8_lossless_dropped == 1
    want = codecs.encode(_expected(layers, [5])[0], spec)
    assert got[1] is not None and np.array_equal(got[1][1], want[1])
    batch.release()
    m.close()


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first"])
@pytest.mark.parametrize("n", [3, 70])   # block by block, and through index_select
def test_the_cpu_path_round_trips_many_and_few_blocks(layout: str, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    shape = (2, 100, 2, 1, 4) if layout == "kv_first" else (100, 2, 2, 1, 4)
    layers = [torch.randn(shape, generator=g) for _ in range(2)]
    m = Mover(layers, layout, staging_bytes=1 << 20)  # type: ignore[arg-type]
    ids = list(range(99, 99 - n, -1))
    batch = m.begin_save(ids)
    assert batch is not None
    m.end_save(batch)
    want = paged.gather_reference(layers, ids, layout)  # type: ignore[arg-type]
    assert torch.equal(batch.staged(), want)
    dst = list(range(n))
    load = m.begin_load(n)
    assert load is not None
    load.staged().copy_(want)
    m.load(load, dst)
    assert torch.equal(paged.gather_reference(layers, dst, layout), want)  # type: ignore[arg-type]
    other = [torch.zeros_like(t) for t in layers]
    m2 = Mover(other, layout, staging_bytes=1 << 20)  # type: ignore[arg-type]
    m2.load_host(want, dst)
    assert torch.equal(paged.gather_reference(other, dst, layout), want)  # type: ignore[arg-type]
    batch.release()
    load.release()
    m.close()
    m2.close()


def test_saves_that_fill_their_staging_leave_the_loads_theirs(gpu: StandInGpu) -> None:
    m = _mover(_layers(), gpu, blocks=2)
    saving = m.begin_save([0, 1])
    assert saving is not None and m.begin_save([2]) is None      # saves: full
    loading = m.begin_load(2)
    assert loading is not None                                   # loads: their own room
    saving.release()
    loading.release()
    gpu.run()
    assert m.stats().staging_in_use_bytes == 0
    m.close()


async def test_a_failed_stream_raises_at_the_wait_and_still_frees_the_staging(
        gpu: StandInGpu) -> None:
    m = _mover(_layers(), gpu, blocks=2)
    batch = m.begin_save([1])
    assert batch is not None
    m.end_save(batch)
    gpu.stream_status = ILLEGAL_ADDRESS      # a sticky error: the callback reports it
    gpu.run()
    with anyio.fail_after(10), pytest.raises(CudaError):
        await batch.wait()
    batch.release()
    assert m.stats().staging_in_use_bytes == 0
    gpu.stream_status = 0
    m.close()


async def test_device_load_staging_is_bounded_reused_and_scattered_from(
        gpu: StandInGpu) -> None:
    layers = _layers()
    m = _mover(layers, gpu, blocks=2, device_loads=True)
    assert isinstance(m.load_pool, DeviceStagingPool)
    a = m.begin_load(2)
    assert a is not None and m.begin_load(1) is None        # full: refused, not waited
    stored = _expected(_layers(seed=9), [0, 1])
    a.staged().copy_(stored)
    m.load(a, [4, 8])
    a.release()                                             # copies still queued
    assert m.begin_load(1) is None
    gpu.run()
    b = m.begin_load(2)
    assert b is not None and b.lease.address == a.lease.address   # coalesced, reused
    assert torch.equal(_expected(layers, [4, 8]), stored)
    b.release()
    m.close()


def _capture_mover(layers: list[torch.Tensor], gpu: StandInGpu, **kw: object) -> Mover:
    # The compute stream's capture status as the engine's torch would report it.
    return _mover(layers, gpu, capturing=lambda: gpu.is_capturing(COMPUTE), **kw)


async def test_saves_during_cuda_graph_capture_are_skipped_counted_never_captured(
        gpu: StandInGpu) -> None:
    layers = _layers()
    m = _capture_mover(layers, gpu)
    gpu.begin_capture(COMPUTE)
    assert m.capturing() and m.begin_save([1, 2]) is None     # skipped at the start
    gpu.end_capture(COMPUTE)
    batch = m.begin_save([3, 4])                              # capture starts mid-step
    assert batch is not None
    m.save_layer(batch, 0)
    gpu.begin_capture(COMPUTE)
    m.save_layer(batch, 1)
    m.end_save(batch)
    gpu.end_capture(COMPUTE)
    assert batch.skipped and batch.ended
    assert gpu.captured == []            # nothing of kvstore's went into the graph
    s = m.stats()
    assert (s.capture_skipped_saves, s.capture_skipped_blocks) == (2, 4)
    batch.release()                      # its layer-0 copy still queued: held till done
    assert m.stats().staging_in_use_bytes > 0
    gpu.run()
    assert m.stats().staging_in_use_bytes == 0 and gpu.syncs == []
    m.close()


def test_without_the_guard_the_stand_in_catches_a_captured_save(gpu: StandInGpu) -> None:
    # The check above could fail: a mover that ignores the capture records its event
    # on the capturing stream and its save stream joins the capture.
    m = _mover(_layers(), gpu, capturing=lambda: False)
    batch = m.begin_save([1])
    assert batch is not None
    gpu.begin_capture(COMPUTE)
    m.save_layer(batch, 0)
    gpu.end_capture(COMPUTE)
    assert any("joined the capture" in c for c in gpu.captured)
    batch.release()
    gpu.capturing.clear()
    gpu.run()
    m.close()


def test_loads_during_cuda_graph_capture_are_refused_clearly(gpu: StandInGpu) -> None:
    layers = _layers()
    m = _capture_mover(layers, gpu)
    before = m.begin_load(1)
    assert before is not None
    before.staged().copy_(_expected(_layers(seed=2), [0]))
    m.load(before, [5])                  # enqueued before the capture, not waited yet
    gpu.begin_capture(COMPUTE)
    with pytest.raises(CaptureError, match="capturing a CUDA graph"):
        m.begin_load(1)
    with pytest.raises(CaptureError, match="capturing a CUDA graph"):
        m.load(before, [6])
    with pytest.raises(CaptureError, match="layer 0"):
        m.wait_layer(0)                  # its event cannot be waited on in the graph
    gpu.end_capture(COMPUTE)
    assert gpu.captured == []
    m.wait_all_layers()                  # after the capture: waited as usual
    before.release()
    gpu.run()
    assert torch.equal(_expected(layers, [5]), _expected(_layers(seed=2), [0]))
    m.close()


def test_the_default_capture_query_is_torchs(gpu: StandInGpu,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # kvstore's library has no capture query: the mover asks torch about its current
    # stream (this torch has no CUDA, so its answer is set here).
    m = _mover(_layers(), gpu)
    assert m.begin_save([0]) is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert m.capturing() and m.begin_save([1]) is None
    assert m.stats().capture_skipped_saves == 1
    monkeypatch.undo()
    gpu.run()
    m.close()


def test_a_save_over_the_per_save_cap_is_dropped_whole(gpu: StandInGpu) -> None:
    layers = _layers()
    block = LAYERS * 2 * 4 * 2 * 8 * 4
    m = _mover(layers, gpu, blocks=8, max_save_bytes_per_batch=2 * block)
    assert m.copied_bytes(3) == 3 * block
    assert m.begin_save([0, 1, 2]) is None
    s = m.stats()
    assert (s.rate_dropped_saves, s.rate_dropped_blocks, s.staging_in_use_bytes) == (1, 3, 0)
    assert gpu.pending() == 0            # nothing enqueued for it
    ok = m.begin_save([0, 1])
    assert ok is not None
    ok.release()
    m.close()


async def test_device_loads_of_fp8_blocks_land_dequantised_with_no_host_copy(
        tmp_path: Path, gpu: StandInGpu, host_lib: _lib.Library) -> None:
    """A load staged in device memory: get_many copies the FP8 payload (about half the
    bytes) from the store's arena into it and dequantises it there; the mover scatters
    from it; no synchronising call, no device -> host copy; the cache gets exactly what
    the CPU codec decodes."""
    gpu.host = host_lib
    gpu.auto = True
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3))
    plain = _layers(dtype=torch.float16)
    layers = [t.as_subclass(OnDevice) for t in plain]
    m = _mover(layers, gpu, device_loads=True)
    gpu.held = {m.load_stream}
    blocks = _expected(_layers(seed=7, dtype=torch.float16), [0, 1])
    keys = [b"\x61" * 16, b"\x62" * 16]
    async with kvstore.open(tmp_path, extent_bytes=4 << 20, codec=spec) as store:
        await store.put_many(keys, list(blocks))
        batch = m.begin_load(2)
        assert batch is not None
        staged = batch.blocks()
        assert all(isinstance(b, OnDevice) for b in staged)   # device staging
        OnDevice.log.clear()
        gpu.syncs.clear()
        gpu.copied.clear()
        decoded = copies.stats().fp8_decoded
        got = await store.get_many(keys, staged)
    assert all(g is s for g, s in zip(got, staged))
    assert copies.stats().fp8_decoded - decoded == 2
    # In: each block's scales and codes (its payload less the header), and the
    # kernel's row -> scale-group map once per geometry; fewer bytes than the block.
    copied_in = sum(n for call, s, n in gpu.copied if s != m.load_stream)
    payloads = sum(len(codecs.encode(b, spec)[1]) - gpu_fp8._HDR.size for b in blocks)
    row_group = gpu_fp8.scale_groups(m.block_shape, spec).row_group.nbytes
    assert payloads <= copied_in <= payloads + row_group
    assert payloads < 0.6 * blocks.numel() * blocks.element_size()
    m.load(batch, [9, 2])
    batch.release()
    gpu.held.clear()
    gpu.run()
    assert gpu.syncs == [] and OnDevice.log == []
    want = torch.stack([codecs.decode(*codecs.encode(b, spec), b.dtype, tuple(b.shape))
                        for b in blocks])
    assert torch.equal(_expected(plain, [9, 2]).view(torch.int16), want.view(torch.int16))
    m.close()
    copies.close()
