"""GPU checks: kernels against the CPU reference, page-locked arena, no leaks.

Skipped (not failed) unless kvstore.cuda is usable: the library is built (set
KVSTORE_CUDA_LIB or run `python -m kvstore cuda build`) and a device is present.
tests/gpu/run_gpu_checks.sh builds the library and runs this module on a GPU machine.

Everything here works with the ctypes library alone (the library's own device
allocations, comparisons on the CPU against kvstore.codecs.pipeline and the torch reference), so
it runs where torch has no CUDA build; the torch-CUDA paths are checked in addition when
torch.cuda is available.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

import kvstore
from kvstore import cuda
from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec, KVLayout
from kvstore.cuda import fp8, paged
from kvstore.cuda._lib import Library, runtime
from kvstore.cuda.device import DeviceBuffer, Stream, copy_async
from kvstore.cuda.page_locked import pool
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.testing import parts
from tests.conformance import SMALL_EXTENT
from tests.realdata import require_kv_dir

pytestmark = pytest.mark.skipif(not cuda.available(), reason=f"no CUDA: {cuda.reason()}")
ROOT = Path(__file__).resolve().parents[2]
TORCH_CUDA = torch.cuda.is_available()


def _lib() -> Library:
    lib = runtime().lib
    assert lib is not None
    return lib


def _to_device(t: torch.Tensor) -> DeviceBuffer:
    """A copy of ``t``'s whole storage on the device (strided views keep their strides)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
    buf = DeviceBuffer(max(raw.nbytes, 1))
    buf.upload(raw)
    return buf


def _from_device(buf: DeviceBuffer, like: torch.Tensor) -> torch.Tensor:
    """The device copy of ``like``'s storage, viewed with ``like``'s geometry."""
    raw = torch.empty(like.untyped_storage().nbytes(), dtype=torch.uint8)
    buf.download(raw.numpy())
    whole = raw.view(like.dtype)
    return whole.as_strided(like.shape, like.stride(), like.storage_offset())


def _same_decode(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaNs included (NaN codes decode to the canonical quiet NaN)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


# --------------------------------------------------------------------------- FP8


def _device_roundtrip(x: torch.Tensor, spec: CodecSpec) -> None:
    x = x.clone(memory_format=torch.contiguous_format)  # own storage: the data starts at 0
    want_id, want = codecs.encode(x, spec)
    with Stream() as s, _to_device(x) as buf:
        got_id, got = fp8.encode_device(buf.ptr, x.dtype, tuple(x.shape), spec, s.handle)
        assert got_id == want_id, (x.dtype, spec)
        assert np.array_equal(got, want), f"GPU payload differs: {x.dtype} {spec}"
        if want_id & 0x0F == codecs.CODEC_RAW:
            return
        with DeviceBuffer(x.numel() * x.element_size()) as out:
            fp8.decode_device(got_id, got, x.dtype, tuple(x.shape), out.ptr, s.handle)
            dec = torch.empty(tuple(x.shape), dtype=x.dtype)
            out.download(dec.view(-1).view(torch.uint8).numpy())
    ref = codecs.decode(want_id, want, x.dtype, tuple(x.shape))
    assert _same_decode(dec, ref), f"GPU decode differs: {x.dtype} {spec}"


def _real() -> dict[torch.dtype, torch.Tensor]:
    data = require_kv_dir()
    k16 = torch.from_numpy(np.load(data / "smollm2_sample_K_fp16.npy"))
    v16 = torch.from_numpy(np.load(data / "smollm2_sample_V_fp16.npy"))
    kb = torch.from_numpy(np.load(data / "smollm2_sample_K_bf16bits.npy")).view(torch.bfloat16)
    vb = torch.from_numpy(np.load(data / "smollm2_sample_V_bf16bits.npy")).view(torch.bfloat16)
    return {torch.float16: torch.stack([k16, v16]), torch.bfloat16: torch.stack([kb, vb]),
            torch.float32: torch.stack([k16, v16]).float()}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_kernels_bit_exact_on_real_kv(fmt: str) -> None:
    layout = KVLayout(0, 2, 3)
    for x in _real().values():
        for gk, gv in itertools.product(codecs.GRANULARITIES, repeat=2):
            _device_roundtrip(x, CodecSpec(fp8=fmt, layout=layout, k_granularity=gk,
                                           v_granularity=gv))
        _device_roundtrip(x, CodecSpec(fp8=fmt, zstd=True, layout=layout))
        _device_roundtrip(x[0], CodecSpec(fp8=fmt))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_kernels_bit_exact_on_special_and_random_values(dtype: torch.dtype, fmt: str) -> None:
    g = torch.Generator().manual_seed(11)
    lo = {torch.float16: -7.0, torch.bfloat16: -40.0, torch.float32: -44.0}[dtype]
    x = (torch.randn(256, 8, 64, generator=g) * torch.logspace(lo, 4.0, 256).view(256, 1, 1))
    x = x.to(dtype)
    flat = x.view(-1)
    flat[::97] = float("nan")
    flat[5::101] = float("inf")
    flat[7::103] = -float("inf")
    flat[9::89] = -0.0
    x[3] = 0.0
    x[4] = float("nan")
    _device_roundtrip(x, CodecSpec(fp8=fmt))
    _device_roundtrip(x, CodecSpec(fp8=fmt, k_granularity="tensor"))
    if dtype != torch.float32:  # every 16-bit pattern
        pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        for seed in range(4):
            perm = torch.randperm(65536, generator=torch.Generator().manual_seed(seed))
            _device_roundtrip(pats[perm].reshape(2, 8, 32, 128),
                              CodecSpec(fp8=fmt, layout=KVLayout(0, 2, 1)))
    else:
        bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (64, 4, 128), generator=g,
                             dtype=torch.int32)
        _device_roundtrip(bits.view(torch.float32), CodecSpec(fp8=fmt))


def test_fp8_lossless_fallback_on_device() -> None:
    x = torch.ones(8, 64, dtype=torch.float16)
    x[1, 2] = 60000.0
    _device_roundtrip(x, CodecSpec(fp8="e4m3"))


@pytest.mark.skipif(not TORCH_CUDA, reason="torch has no CUDA here")
def test_fp8_torch_cuda_tensors() -> None:
    x = _real()[torch.bfloat16][:, :, :128].contiguous()
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(0, 2, 3))
    codec, payload = fp8.encode(x.cuda(), spec)
    want = codecs.encode(x, spec)
    assert codec == want[0] and np.array_equal(payload, want[1])
    dec = fp8.decode(codec, payload, x.dtype, tuple(x.shape), device="cuda")
    assert dec.device.type == "cuda"
    assert _same_decode(dec.cpu(), codecs.decode(codec, payload, x.dtype, tuple(x.shape)))


# --------------------------------------------------------------------------- gather/scatter

LAYOUTS = [
    ("kv_first", (2, 64, 16, 8, 128)),
    ("kv_first", (2, 64, 8, 16, 128)),
    ("blocks_first", (64, 2, 16, 8, 128)),
    ("blocks_first", (64, 16, 576)),
    ("blocks_first", (64, 4, 2, 16, 2, 64)),
]


@pytest.mark.parametrize("layout,shape", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("strided", [False, True])
def test_gather_kernel_matches_torch(layout: paged.Layout, shape: tuple[int, ...],
                                     dtype: torch.dtype, strided: bool) -> None:
    g = torch.Generator().manual_seed(5)
    axis = 1 if layout == "kv_first" else 0
    layers = []
    for _ in range(3):
        t = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8) if dtype == torch.uint8 \
            else torch.randn(shape, generator=g).to(dtype)
        if strided:  # a window of a larger cache: block stride/offset are the parent's
            t = torch.cat([t, t], dim=axis).narrow(axis, 7, shape[axis])
        layers.append(t)
    ids = np.array([5, 63, 0, 17, 17, 42], dtype=np.int64)
    want = paged.gather_reference(layers, ids, layout)
    bufs = [_to_device(t) for t in layers]
    try:
        ptrs = [b.ptr + int(t.storage_offset()) * t.element_size() for b, t in zip(bufs, layers)]
        outer, ostride, bstride, inner = paged._geometry(layers[0], axis)
        with Stream() as s, DeviceBuffer(want.numel() * want.element_size()) as st:
            paged.gather_ptrs(_lib(), ptrs, outer, ostride, bstride, inner, ids, st.ptr, s.handle)
            s.synchronize()
            got = torch.empty_like(want)
            st.download(got.reshape(-1).view(torch.uint8).numpy())
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    finally:
        for b in bufs:
            b.close()


@pytest.mark.parametrize("layout,shape", LAYOUTS)
def test_scatter_kernel_matches_torch(layout: paged.Layout, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(9)
    src = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)]
    ids = np.array([3, 60, 11, 0], dtype=np.int64)
    staged = paged.gather_reference(src, ids, layout)
    want = [torch.zeros_like(t) for t in src]
    paged.scatter_reference(staged, want, ids, layout)
    axis = 1 if layout == "kv_first" else 0
    dst = [torch.zeros_like(t) for t in src]
    bufs = [_to_device(t) for t in dst]
    try:
        with Stream() as s, _to_device(staged) as st:
            outer, ostride, bstride, inner = paged._geometry(dst[0], axis)
            paged.scatter_ptrs(_lib(), [b.ptr for b in bufs], outer, ostride, bstride, inner,
                               ids, st.ptr, s.handle)
            s.synchronize()
            for b, w in zip(bufs, want):
                assert torch.equal(_from_device(b, w), w)
    finally:
        for b in bufs:
            b.close()


def test_gather_chunks_many_ids_and_layers() -> None:
    # > 320 ids and > 128 layers: the host splits launches; the result must not change
    layers = [torch.full((2, 400, 4, 16), float(i), dtype=torch.float16) for i in range(130)]
    for i, t in enumerate(layers):
        t[:, :, 0, 0] = torch.arange(400, dtype=torch.float16) + i
    ids = np.arange(399, -1, -1, dtype=np.int64)
    want = paged.gather_reference(layers, ids, "kv_first")
    bufs = [_to_device(t) for t in layers]
    try:
        with Stream() as s, DeviceBuffer(want.numel() * 2) as st:
            outer, ostride, bstride, inner = paged._geometry(layers[0], 1)
            paged.gather_ptrs(_lib(), [b.ptr for b in bufs], outer, ostride, bstride, inner,
                              ids, st.ptr, s.handle)
            s.synchronize()
            got = torch.empty_like(want)
            st.download(got.reshape(-1).view(torch.uint8).numpy())
        assert torch.equal(got, want)
    finally:
        for b in bufs:
            b.close()


@pytest.mark.skipif(not TORCH_CUDA, reason="torch has no CUDA here")
@pytest.mark.parametrize("layout,shape", LAYOUTS)
def test_torch_cuda_gather_scatter(layout: paged.Layout, shape: tuple[int, ...]) -> None:
    layers = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(4)]
    ids = torch.tensor([1, 9, 33, 2])
    staged = paged.gather(layers, ids, layout)
    torch.cuda.synchronize()
    assert torch.equal(staged.cpu(), paged.gather_reference([t.cpu() for t in layers], ids, layout))
    dst = [torch.zeros_like(t) for t in layers]
    paged.scatter(staged, dst, ids, layout)
    want = [torch.zeros_like(t).cpu() for t in layers]
    paged.scatter_reference(staged.cpu(), want, ids, layout)
    torch.cuda.synchronize()
    for d, w in zip(dst, want):
        assert torch.equal(d.cpu(), w)


# ---------------------------------------------------------------------- page-locked arena


@pytest.mark.anyio
async def test_page_locked_arena_get_then_h2d(tmp_path: Path) -> None:
    before = pool().registered_bytes
    block = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)  # 4 MiB of known bytes
    key = bytes(range(16))
    async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT * 4, staging_bytes=16 << 20,
                            page_lock_staging=True) as store:
        assert store.stats().cuda.startswith("cuda: page-locked arena (16777216 bytes) on device")
        assert pool().registered_bytes == before + parts(store).arena.size
        await store.put(key, block)
        # the store's read path lands the slot in the (page-locked) arena; H2D straight from it
        (entry,) = parts(store).index.get_entries([key])
        assert entry is not None
        run = await parts(store).arena.acquire(entry.slot_len)
        try:
            from kvstore.io.protocol import IoOp
            (res,) = await parts(store).engine.read([IoOp(parts(store).fds[entry.extent], entry.offset, run)])
            assert res == run.length
            with Stream() as s, DeviceBuffer(block.numel()) as dev:
                await copy_async(dev.ptr, parts(store).arena.address + run.offset + SLOT_HEADER_BYTES,
                                 block.numel(), s.handle)
                got = np.empty(block.numel(), dtype=np.uint8)
                dev.download(got)
        finally:
            parts(store).arena.release(run)
        assert np.array_equal(got, block.numpy())
        if TORCH_CUDA:  # get_many(out=cuda tensor): DMA from the arena run, no host copy
            out = torch.empty_like(block, device="cuda")
            (r,) = await store.get_many([key], out=[out])
            assert r is out and torch.equal(out.cpu(), block)
    assert pool().registered_bytes == before



@pytest.mark.skipif(not TORCH_CUDA, reason="torch has no CUDA build")
@pytest.mark.anyio
@pytest.mark.parametrize("memory_bytes", [0, 64 << 20], ids=["disk", "memory-tier"])
async def test_without_the_library_cuda_puts_and_gets_never_synchronise(
        tmp_path: Path, memory_bytes: int) -> None:
    """kvstore's CUDA library not built (the common case after ``pip install``): puts of
    CUDA tensors and gets into them go through torch's side stream (kvstore/cuda/
    torch_copies.py) under ``set_sync_debug_mode("error")``: no call that waits for the
    device on this thread, and every byte back as put."""
    from kvstore.cuda import _lib as cuda_lib

    old = cuda_lib.reset_for_tests(cuda_lib.load(tmp_path / "absent" / "libkvcuda.so"))
    try:
        assert not cuda.available()
        g = torch.Generator(device="cuda").manual_seed(7)
        blocks = [torch.randn(1 << 18, device="cuda", generator=g).to(torch.bfloat16)
                  for _ in range(6)]
        keys = [bytes([i + 1]) * 16 for i in range(6)]
        outs = [torch.empty_like(b) for b in blocks]
        before = pool().registered_bytes
        async with kvstore.open(tmp_path / "store", extent_bytes=SMALL_EXTENT * 8,
                                memory_bytes=memory_bytes) as store:
            # page-locked through torch's cudart: the copies from it are DMAs
            assert "through torch" in store.stats().cuda, store.stats().cuda
            assert pool().registered_bytes >= before + parts(store).arena.size
            torch.cuda.set_sync_debug_mode("error")
            try:
                first = await store.put_many(keys[:4], blocks[:4])
                second = await store.put_many(keys, blocks)   # four deduplicated
                got = await store.get_many(keys, out=outs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert pool().registered_bytes == before   # unregistered at close
        assert (first.written, second.written, second.deduplicated) == (4, 2, 4)
        assert all(r is o for r, o in zip(got, outs))
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    finally:
        cuda_lib.reset_for_tests(old)

@pytest.mark.anyio
async def test_async_copy_completion_does_not_block_the_loop() -> None:
    import anyio

    n = 256 << 20
    host = np.arange(n // 8, dtype=np.int64).view(np.uint8)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    with Stream() as s, DeviceBuffer(n) as dev:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for _ in range(4):  # pageable source: CUDA stages it, still completes via eventfd
                await copy_async(dev.ptr, host.ctypes.data, n, s.handle)
            tg.cancel_scope.cancel()
        back = np.empty(n, dtype=np.uint8)
        dev.download(back)
    assert np.array_equal(back, host)
    assert ticks > 0  # other tasks ran while the copies were in flight


@pytest.mark.anyio
async def test_open_close_cycles_release_every_registration(tmp_path: Path) -> None:
    from tests.cuda.test_page_locked_hygiene import mapped

    async def cycles(n: int) -> None:
        for _ in range(n):
            async with kvstore.open(tmp_path, extent_bytes=SMALL_EXTENT, staging_bytes=32 << 20,
                                    index_map_bytes=64 << 20, page_lock_staging=True) as store:
                assert pool().regions == 1
                store.stats()

    await cycles(3)
    before = mapped()
    await cycles(50)
    after = mapped()
    assert pool().regions == 0 and pool().registered_bytes == 0
    assert after[0] - before[0] < 10 and after[1] - before[1] < (32 << 20), (before, after)


def test_page_locked_pool_is_bounded() -> None:
    from kvstore.cuda.page_locked import PageLockedPool
    from kvstore.io.arena import Arena

    arena = Arena(1 << 20)
    small = PageLockedPool(limit_bytes=arena.size - 4096)
    try:
        with pytest.raises(cuda.CudaError, match="page-locked memory limit"):
            small.register(arena.address, arena.size, "test arena")
        assert small.regions == 0
        ok = PageLockedPool(limit_bytes=arena.size)
        ok.register(arena.address, arena.size, "test arena")
        assert ok.registered_bytes == arena.size
        ok.unregister(arena.address)
        assert ok.registered_bytes == 0 and ok.regions == 0
    finally:
        arena.close()


# --------------------------------------------------------------------------- failures and placement

_STICKY = """
import anyio, numpy as np
from kvstore.cuda import CudaError, paged
from kvstore.cuda._lib import runtime
from kvstore.cuda.device import Stream, wait_stream

async def main() -> None:
    lib = runtime().lib
    s = Stream()
    # pointers no allocation covers: the kernel faults, a sticky error of the context
    paged.gather_ptrs(lib, [0x10], 1, 0, 4096, 4096, np.zeros(1, np.int64), 0x20, s.handle)
    try:
        with anyio.fail_after(60):
            await wait_stream(s.handle, lib)
    except CudaError as e:
        print("wait_stream raised", e.code, e)
    except TimeoutError:
        print("wait_stream HUNG")
    else:
        print("wait_stream returned without an error")

anyio.run(main)
"""


def test_sticky_error_is_raised_by_wait_stream_not_hung() -> None:
    # In a child process: the sticky error ends that process's CUDA context.
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _STICKY], capture_output=True, text=True,
                          timeout=180, env=env, check=False)
    assert "wait_stream raised" in proc.stdout, proc.stdout + proc.stderr
    code = int(proc.stdout.split("wait_stream raised", 1)[1].split()[0])
    assert code > 0  # e.g. 700, cudaErrorIllegalAddress


@pytest.mark.skipif(not TORCH_CUDA, reason="torch has no CUDA here")
@pytest.mark.parametrize("pinned", [False, True])
def test_gather_scatter_with_host_staging(pinned: bool) -> None:
    # pageable host staging: the torch path (the kernel would fault on it);
    # pinned host staging: the kernel writes it in place.
    layers = [torch.randn(2, 32, 16, 4, 64, device="cuda").to(torch.bfloat16) for _ in range(3)]
    ids = [7, 0, 31, 2]
    shape = paged.staging_shape(layers[0].shape, 3, len(ids), "kv_first")
    out = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pinned)
    assert paged.device_can_reach(out, layers[0].device) == pinned
    got = paged.gather(layers, ids, "kv_first", out=out)
    torch.cuda.synchronize()
    want = paged.gather_reference([t.cpu() for t in layers], ids, "kv_first")
    assert got is out and torch.equal(out, want)
    dst = [torch.zeros_like(t) for t in layers]
    paged.scatter(out, dst, ids, "kv_first")
    torch.cuda.synchronize()
    back = paged.gather_reference([t.cpu() for t in dst], ids, "kv_first")
    assert torch.equal(back, want)


@pytest.mark.skipif(not TORCH_CUDA or torch.cuda.device_count() < 2,
                    reason="needs torch CUDA and two GPUs")
def test_fp8_on_the_second_gpu_leaves_the_current_device() -> None:
    torch.cuda.set_device(0)
    x = _real()[torch.bfloat16][:, :, :64].contiguous()
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(0, 2, 3))
    codec, payload = fp8.encode(x.to("cuda:1"), spec)
    want = codecs.encode(x, spec)
    assert codec == want[0] and np.array_equal(payload, want[1])
    dec = fp8.decode(codec, payload, x.dtype, tuple(x.shape), device="cuda:1")
    assert dec.device == torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
