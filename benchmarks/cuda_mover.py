"""The data mover (kvstore/cuda/mover.py) on a synthetic engine step, without vLLM:
a paged KV cache shaped like Llama-3-8B's (32 layers, 8 KV heads, head dim 128, block
16 tokens, bf16, FlashAttention's ``[2, num_blocks, 16, 8, 128]`` per layer).  GPU
machine only (``--cpu-smoke``: the same code on CPU tensors, tiny shapes, for the tests).

    python benchmarks/cuda_mover.py [--steps 8] [--new-tokens 2048] [--prefix-tokens 4096]
                                    [--dir DIR] [--out benchmarks/results/cuda_mover.md]

An emulated engine step: per layer, a matmul on the compute stream (``[new_tokens, 4096]
@ [4096, 14336]``), then the step's new KV written into the layer's new blocks
(a copy into their slice of the cache); with saves on, ``Mover.save_layer`` after each layer and
``end_save`` at the end, the put of the step's blocks started on the store's event loop
(a portal thread) when their copy-done event fires.  The engine-side calls run under
``torch.cuda.set_sync_debug_mode("error")``: any synchronising torch call raises and is
counted; calls of the CUDA library that block the host (``kvc_stream_synchronize``) are
counted through a wrapper.  Numbers:

* step time, saves off / on (CUDA events on the compute stream, median of ``--steps``);
* GPU -> NVMe: the step's blocks saved (mover copy-out + durable put), GB/s until the
  last put is acknowledged, no compute running;
* NVMe -> GPU: a ``--prefix-tokens`` prefix read from the store (O_DIRECT) into the
  mover's page-locked staging and scattered into the cache, until its copy-done event;
* baselines: ``pin_memory()`` + ``copy_(non_blocking=True)`` of the same bytes each way,
  and fio (io_uring, O_DIRECT, same block size) on the store's disk when fio is there;
* FP8 on the GPU: a save with an ``fp8_e4m3`` codec: bytes over PCIe against raw, the
  time to quantise and copy out, payloads byte-identical to ``kvstore.codecs.pipeline.encode``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from anyio.from_thread import start_blocking_portal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvstore  # noqa: E402
from kvstore.codecs import pipeline as codecs  # noqa: E402
from kvstore.codecs.pipeline import CodecSpec, KVLayout  # noqa: E402
from kvstore.cuda import _lib, paged  # noqa: E402
from kvstore.cuda.mover import Mover, SaveBatch  # noqa: E402

GB = 1e9


class CountingLib:
    """The CUDA library, counting calls that block the host (``synchronising``)."""

    BLOCKING = ("kvc_stream_synchronize",)

    def __init__(self, lib: Any) -> None:
        self._lib, self.blocking, self.counting = lib, 0, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def call(self, name: str, *args: Any) -> None:
        if self.counting and name in self.BLOCKING:
            self.blocking += 1
        self._lib.call(name, *args)

    def try_call(self, name: str, *args: Any) -> int:
        if self.counting and name in self.BLOCKING:
            self.blocking += 1
        return int(self._lib.try_call(name, *args))


class SyncGuard:
    """``set_sync_debug_mode("error")`` around engine-side calls (GPU only), and the
    library's host-blocking calls counted there."""

    def __init__(self, cuda: bool, lib: CountingLib | None) -> None:
        self.cuda, self.lib, self.errors = cuda, lib, 0

    def __enter__(self) -> SyncGuard:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error")
        if self.lib is not None:
            self.lib.counting = True
        return self

    def __exit__(self, et: Any, e: Any, tb: Any) -> bool:
        if self.lib is not None:
            self.lib.counting = False
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        if e is not None and "synchroniz" in str(e).lower():
            self.errors += 1
            print(f"SYNCHRONISING CALL: {e}", flush=True)
            return True
        return False


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _keys(prefix: int, n: int) -> list[bytes]:
    return [(prefix << 32 | i).to_bytes(16, "little") for i in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = not args.cpu_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        rt = _lib.runtime()
        if not (torch.cuda.is_available() and rt.usable):
            raise SystemExit(f"needs torch CUDA and kvstore's CUDA library: {rt.reason}")
    layers_n, heads, head_dim, bs = (32, 8, 128, 16) if cuda else (2, 2, 16, 4)
    hidden, ffn = (4096, 14336) if cuda else (64, 128)
    new_tokens, prefix_tokens = args.new_tokens, args.prefix_tokens
    new_blocks, prefix_blocks = new_tokens // bs, prefix_tokens // bs
    steps = args.steps
    num_blocks = prefix_blocks + (3 * steps + 2) * new_blocks
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [torch.randn((2, num_blocks, bs, heads, head_dim), generator=g, device=dev)
              .to(torch.bfloat16) for _ in range(layers_n)]
    x = torch.randn((new_tokens, hidden), generator=g, device=dev).to(torch.bfloat16)
    w = torch.randn((hidden, ffn), generator=g, device=dev).to(torch.bfloat16)
    kv_new = torch.randn((2, new_blocks, bs, heads, head_dim), generator=g, device=dev) \
        .to(torch.bfloat16)
    lib = CountingLib(_lib.runtime().lib) if cuda else None
    layer_bytes = 2 * bs * heads * head_dim * 2
    block_bytes = layer_bytes * layers_n
    staging = max(args.staging_mib << 20, 2 * new_blocks * block_bytes)
    mover = Mover(layers, "kv_first", staging_bytes=staging, lib=lib,  # type: ignore[arg-type]
                  device_loads=args.device_loads)
    guard = SyncGuard(cuda, lib)
    out: dict[str, Any] = {"cuda": cuda, "layers": layers_n, "kv_heads": heads,
                           "head_dim": head_dim, "block_tokens": bs,
                           "block_bytes": block_bytes, "new_blocks_per_step": new_blocks,
                           "prefix_blocks": prefix_blocks, "steps": steps,
                           "device_loads": args.device_loads,
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    work = Path(args.dir or tempfile.mkdtemp(prefix="kvstore-mover-"))
    shutil.rmtree(work / "store", ignore_errors=True)
    with start_blocking_portal() as portal:
        cm = portal.wrap_async_context_manager(kvstore.open(
            work / "store", extent_bytes=1 << 30, staging_bytes=256 << 20))
        store = cm.__enter__()
        try:
            out.update(_measure(args, portal, store, mover, layers, x, w, kv_new, guard,
                                lib, cuda, new_blocks, prefix_blocks, block_bytes))
        finally:
            cm.__exit__(None, None, None)
    mover.close()
    out["sync_errors"] = guard.errors
    out["blocking_lib_calls"] = lib.blocking if lib is not None else 0
    out["fio"] = _fio(work, block_bytes, prefix_blocks * block_bytes) if cuda else None
    shutil.rmtree(work, ignore_errors=True)
    return out


def _measure(args: argparse.Namespace, portal: Any, store: kvstore.Store, mover: Mover,
             layers: list[torch.Tensor], x: torch.Tensor, w: torch.Tensor,
             kv_new: torch.Tensor, guard: SyncGuard,
             lib: CountingLib | None, cuda: bool, new_blocks: int, prefix_blocks: int,
             block_bytes: int) -> dict[str, Any]:
    futures: list[Any] = []

    async def put(batch: SaveBatch, keys: list[bytes], background: bool = True) -> int:
        """Blocks written (a background put may be dropped under backpressure)."""
        try:
            await batch.wait()
            r = await store.put_many(keys, batch.blocks(), background=background)
            return r.written + r.deduplicated
        finally:
            batch.release()

    def step(s: int, save: bool) -> None:
        lo, hi = s * new_blocks, (s + 1) * new_blocks
        ids_host = list(range(lo, hi))
        with guard:
            batch = mover.begin_save(ids_host) if save else None
            for li, layer in enumerate(layers):
                torch.matmul(x, w)
                layer[:, lo:hi].copy_(kv_new)   # the step's KV into its new blocks
                if batch is not None:
                    mover.save_layer(batch, li)
            if batch is not None:
                mover.end_save(batch)
                futures.append(portal.start_task_soon(put, batch, _keys(s, new_blocks)))

    def timed(save: bool, first: int) -> list[float]:
        times = []
        for s in range(first, first + args.steps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step(s, save)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1000)
            else:
                t0 = time.perf_counter()
                step(s, save)
                times.append(time.perf_counter() - t0)
        return times

    step(3 * args.steps + 1, False)          # warm-up: kernels, allocator
    _sync(cuda)
    off = timed(False, 0)
    on = timed(True, args.steps)
    for f in futures:
        f.result()
    futures.clear()
    res: dict[str, Any] = {"step_s_saves_off": statistics.median(off),
                           "step_s_saves_on": statistics.median(on)}
    res["save_cost"] = res["step_s_saves_on"] / res["step_s_saves_off"] - 1
    st = mover.stats()
    res["saves_dropped"] = st.dropped_saves + st.rate_dropped_saves

    # GPU -> NVMe: the next steps' blocks, no compute, durable foreground puts; when the
    # staging is full, the oldest put is waited for (a throughput run, not a step)
    t0 = time.perf_counter()
    for s in range(2 * args.steps, 3 * args.steps):
        while True:
            with guard:
                batch = mover.begin_save(list(range(s * new_blocks, (s + 1) * new_blocks)))
                if batch is not None:
                    mover.end_save(batch)
                    futures.append(portal.start_task_soon(put, batch, _keys(s, new_blocks),
                                                          False))
            if batch is not None:
                break
            next(f for f in futures if not f.done()).result()
    saved = sum(f.result() for f in futures) * block_bytes
    res["gpu_to_nvme_gbps"] = saved / (time.perf_counter() - t0) / GB
    futures.clear()

    # NVMe -> GPU: a prefix of the stored blocks, read and scattered
    keys = [k for s in range(2 * args.steps, 3 * args.steps) for k in _keys(s, new_blocks)]
    keys = keys[:prefix_blocks]
    target = list(range(len(keys)))     # block ids 0.. (the prefix's own blocks)
    loads = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        with guard:
            lb = mover.begin_load(len(keys))
        assert lb is not None, "the load staging is too small"
        got = portal.call(store.get_many, keys, lb.blocks())
        assert all(r is not None for r in got)
        with guard:
            mover.load(lb, target)
            for li in range(len(layers)):
                mover.wait_layer(li)
        portal.call(lb.wait)
        lb.release()
        loads.append(time.perf_counter() - t0)
    res["nvme_to_gpu_gbps"] = len(keys) * block_bytes / statistics.median(loads) / GB

    # Baselines: a pin_memory() buffer and copy_(non_blocking=True), each way, same
    # bytes (pinned once, outside the timing: the copy engine's rate, the ceiling)
    nbytes = len(keys) * block_bytes
    host = torch.empty(nbytes, dtype=torch.uint8)
    pinned = host.pin_memory() if cuda else host
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=layers[0].device)
    h2d, d2h = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        dev_buf.copy_(pinned, non_blocking=True)
        _sync(cuda)
        h2d.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pinned.copy_(dev_buf, non_blocking=True)
        _sync(cuda)
        d2h.append(time.perf_counter() - t0)
    res["pin_memory_h2d_gbps"] = nbytes / statistics.median(h2d) / GB
    res["pin_memory_d2h_gbps"] = nbytes / statistics.median(d2h) / GB
    del host, pinned, dev_buf

    # FP8 on the GPU
    spec = CodecSpec(fp8="e4m3", layout=KVLayout(kv_axis=1, token_axis=2, head_axis=3))
    fmover = Mover(layers, "kv_first", staging_bytes=new_blocks * block_bytes, codec=spec,
                   lib=lib)  # type: ignore[arg-type]
    ids = list(range(new_blocks))
    t0 = time.perf_counter()
    with guard:
        fb = fmover.begin_save(ids)
        assert fb is not None
        fmover.end_save(fb)
    portal.call(fb.wait)
    res["fp8_seconds"] = time.perf_counter() - t0
    res["fp8_raw_bytes"] = new_blocks * block_bytes
    res["fp8_bus_bytes"] = fmover.stats().copied_out_bytes
    res["fp8_gbps_raw"] = res["fp8_raw_bytes"] / res["fp8_seconds"] / GB
    payloads = fb.payloads()
    _sync(cuda)
    ref = paged.gather_reference(layers, ids[:2], "kv_first").cpu()
    res["fp8_byte_identical"] = all(
        p is not None and p[0] == w_[0] and np.array_equal(p[1], w_[1])
        for p, w_ in zip(payloads[:2], (codecs.encode(b, spec) for b in ref)))
    fb.release()
    fmover.close()
    return res


def _fio(work: Path, block: int, volume: int) -> dict[str, float] | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    from benchmarks.fio import measure_fio

    f = str(work / "fio.dat")
    w = measure_fio(fio, f, "write", block, volume, 8)
    r = measure_fio(fio, f, "read", block, volume, 8)
    return {"write_gbps": volume / w.seconds / GB, "read_gbps": volume / r.seconds / GB}


def markdown(d: dict[str, Any]) -> str:
    fio = d["fio"]
    slower = min(d["pin_memory_h2d_gbps"], fio["read_gbps"] if fio else float("inf"))
    lines = [
        "# The data mover on a synthetic Llama-3-8B-shaped step (`benchmarks/cuda_mover.py`)",
        "", f"Device: {d['device']}.  Cache: {d['layers']} layers, {d['kv_heads']} KV heads, "
        f"head dim {d['head_dim']}, {d['block_tokens']}-token blocks, bf16 "
        f"({d['block_bytes'] / (1 << 20):.1f} MiB per block); {d['new_blocks_per_step']} new "
        f"blocks per step, a {d['prefix_blocks']}-block prefix loaded; median of "
        f"{d['steps']} steps; loads staged in "
        f"{'device' if d['device_loads'] else 'page-locked host'} memory.", "",
        "| measure | value | target |", "|---|---|---|",
        f"| step time, saves off | {d['step_s_saves_off'] * 1e3:.2f} ms | |",
        f"| step time, saves on | {d['step_s_saves_on'] * 1e3:.2f} ms | |",
        f"| cost of saves | {d['save_cost'] * 100:.1f}% | <= 5% |",
        f"| saves dropped (no staging) | {d['saves_dropped']} | |",
        f"| GPU -> NVMe (copy-out + durable put) | {d['gpu_to_nvme_gbps']:.2f} GB/s | |",
        f"| NVMe -> GPU (read + scatter) | {d['nvme_to_gpu_gbps']:.2f} GB/s | >= 0.9 x "
        f"{slower:.2f} = {0.9 * slower:.2f} |",
        f"| pin_memory() + copy_(non_blocking) H2D / D2H | {d['pin_memory_h2d_gbps']:.2f} / "
        f"{d['pin_memory_d2h_gbps']:.2f} GB/s | |",
        "| fio read / write (O_DIRECT, io_uring) | " + (
            f"{fio['read_gbps']:.2f} / {fio['write_gbps']:.2f} GB/s" if fio else
            "fio not installed on this machine") + " | |",
        f"| FP8 on the GPU: bus bytes / raw | {d['fp8_bus_bytes'] / d['fp8_raw_bytes']:.3f} | "
        "~0.5 |",
        f"| FP8 quantise + copy-out | {d['fp8_gbps_raw']:.2f} GB/s of raw KV | |",
        f"| FP8 payloads byte-identical to kvstore.codecs | {d['fp8_byte_identical']} | "
        "True |",
        f"| synchronising torch calls (sync debug mode \"error\") | {d['sync_errors']} | 0 |",
        f"| host-blocking CUDA library calls on the save/load path | "
        f"{d['blocking_lib_calls']} | 0 |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--staging-mib", type=int, default=1024)
    p.add_argument("--device-loads", action=argparse.BooleanOptionalAction, default=True,
                   help="loads stage in device memory (default) or page-locked host memory")
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_mover.md"))
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU tensors, tiny shapes: the code paths, no GPU numbers")
    args = p.parse_args(argv)
    d = run(args)
    text = markdown(d)
    print(text, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(d, indent=1))
    ok = d["sync_errors"] == 0 and d["blocking_lib_calls"] == 0 and d["fp8_byte_identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
