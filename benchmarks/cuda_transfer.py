"""NVMe -> GPU throughput: reads land in the pinned staging arena and go to the GPU by
DMA, against the usual way (get into pageable memory, then pin/copy).  GPU machine only.

    python benchmarks/cuda_transfer.py [--volume-mib 1024] [--block-mib 2] [--reps 3]
                                       [--dir DIR] [--out benchmarks/results/cuda_transfer.md]

Paths, interleaved per repetition, cold O_DIRECT reads of the same blocks of one store
(written durably once), counted in payload bytes per second until the bytes are on the GPU:

* ``arena->gpu``   the store's read path (engine reads whole slots into the arena, CRC32C
                   verified as the store does) and ``cudaMemcpyAsync`` from the arena run
                   to device memory, completion awaited through the eventfd; the arena is
                   registered (``page_lock_staging=True``): no host copy at all;
* ``get_many(out=cuda)``  the public API with CUDA output tensors (torch CUDA only): the
                   same DMA from the arena run, one stream sync per block;
* ``baseline``     ``store.get_many()`` into pageable tensors, then
                   ``t.pin_memory().to('cuda', non_blocking=True)`` (torch CUDA), or, without
                   torch CUDA, a ``cudaMemcpyAsync`` from the pageable tensor (CUDA stages it);
* ``h2d ceiling``  H2D from the pinned arena alone (no disk), for scale.

The ratio ``arena->gpu / baseline`` is the number that matters (same process, same disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvstore  # noqa: E402
from kvstore import cuda  # noqa: E402
from kvstore.cuda.device import DeviceBuffer, Stream, wait_stream  # noqa: E402
from kvstore.disk.format import SLOT_HEADER_BYTES, crc32c  # noqa: E402
from kvstore.io.protocol import IoOp  # noqa: E402
from kvstore.testing import parts  # noqa: E402


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(n)]


async def write(path: Path, n: int, block: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    g = torch.Generator().manual_seed(0)
    async with kvstore.open(path, extent_bytes=1 << 30, page_lock_staging=False) as store:
        keys = _keys(n)
        for i in range(0, n, 16):
            blocks = [torch.randint(0, 256, (block,), generator=g, dtype=torch.uint8)
                      for _ in keys[i:i + 16]]
            await store.put_many(keys[i:i + 16], blocks)


async def arena_to_gpu(store: kvstore.Store, keys: list[bytes], dev: DeviceBuffer,
                       stream: Stream, block: int) -> float:
    entries = parts(store).index.get_entries(keys)
    assert all(e is not None for e in entries)
    chunk = max(1, (parts(store).arena.size // 2) // (block + SLOT_HEADER_BYTES))
    t0 = time.perf_counter()
    for c in range(0, len(keys), chunk):
        batch = entries[c:c + chunk]
        runs = [await parts(store).arena.acquire(e.slot_len) for e in batch if e is not None]
        try:
            res = await parts(store).engine.read([IoOp(parts(store).fds[e.extent], e.offset, r)
                                           for e, r in zip(batch, runs) if e is not None])
            for i, (e, r, n) in enumerate(zip(batch, runs, res)):
                assert n == r.length and e is not None
                payload = r.view[SLOT_HEADER_BYTES:SLOT_HEADER_BYTES + e.payload_len]
                if crc32c(payload) != e.payload_crc:
                    raise RuntimeError("checksum mismatch")
                stream.lib.call("kvc_memcpy_async", dev.ptr + (c + i) * block,
                                parts(store).arena.address + r.offset + SLOT_HEADER_BYTES, block,
                                stream.handle)
            await wait_stream(stream.handle, stream.lib)
        finally:
            for r in runs:
                parts(store).arena.release(r)
    return time.perf_counter() - t0


async def get_many_cuda(store: kvstore.Store, keys: list[bytes], outs: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    got = await store.get_many(keys, out=outs)
    torch.cuda.synchronize()
    assert all(g is not None for g in got)
    return time.perf_counter() - t0


async def baseline(store: kvstore.Store, keys: list[bytes], dev: DeviceBuffer, stream: Stream,
                   block: int, torch_cuda: bool) -> float:
    t0 = time.perf_counter()
    got = await store.get_many(keys)
    if torch_cuda:
        on_gpu = [t.pin_memory().to("cuda", non_blocking=True) for t in got if t is not None]
        torch.cuda.synchronize()
        assert len(on_gpu) == len(keys)
    else:
        for i, t in enumerate(got):
            assert t is not None
            stream.lib.call("kvc_memcpy_async", dev.ptr + i * block, t.data_ptr(), block,
                            stream.handle)
        await wait_stream(stream.handle, stream.lib)
    return time.perf_counter() - t0


async def h2d_ceiling(store: kvstore.Store, dev: DeviceBuffer, stream: Stream, total: int) -> float:
    n = min(parts(store).arena.size, dev.nbytes)
    parts(store).arena.array[:n] = 1  # fault the pages in
    t0 = time.perf_counter()
    done = 0
    while done < total:
        m = min(n, total - done)
        stream.lib.call("kvc_memcpy_async", dev.ptr + done % (dev.nbytes - m + 1),
                        parts(store).arena.address, m, stream.handle)
        done += m
    await wait_stream(stream.handle, stream.lib)
    return time.perf_counter() - t0


async def run(args: argparse.Namespace) -> dict[str, object]:
    block = args.block_mib << 20
    n = max(1, (args.volume_mib << 20) // block)
    # A directory of our own inside --dir: only what this run created is ever deleted.
    os.makedirs(args.dir, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="kvstore-cuda-transfer-", dir=args.dir)) / "store"
    await write(path, n, block)
    torch_cuda = torch.cuda.is_available()
    keys = _keys(n)
    times: dict[str, list[float]] = {"arena->gpu": [], "baseline": [], "h2d ceiling": []}
    if torch_cuda:
        times["get_many(out=cuda)"] = []
    async with kvstore.open(path, page_lock_staging=True) as store:
        info = store.stats()
        with Stream() as stream, DeviceBuffer(n * block) as dev:
            outs = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in keys] \
                if torch_cuda else []
            for _ in range(args.reps):
                times["arena->gpu"].append(await arena_to_gpu(store, keys, dev, stream, block))
                if torch_cuda:
                    times["get_many(out=cuda)"].append(await get_many_cuda(store, keys, outs))
                times["baseline"].append(await baseline(store, keys, dev, stream, block,
                                                        torch_cuda))
                times["h2d ceiling"].append(await h2d_ceiling(store, dev, stream, n * block))
            # correctness of the measured path: the device holds the stored bytes
            check = np.empty(block, dtype=np.uint8)
            await arena_to_gpu(store, keys[-1:], dev, stream, block)
            dev.download(check)
            (ref,) = await store.get_many(keys[-1:])
            assert ref is not None and np.array_equal(check, ref.numpy())
    shutil.rmtree(path.parent, ignore_errors=True)
    total = n * block
    rates = {k: total / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"blocks": n, "block_bytes": block, "reps": args.reps, "engine": info.engine,
            "o_direct": info.o_direct, "cuda": info.cuda, "torch_cuda": torch_cuda,
            "baseline_kind": "pin_memory().to(cuda)" if torch_cuda else "cudaMemcpy from pageable",
            "gb_per_s": rates, "ratio_vs_baseline": rates["arena->gpu"] / rates["baseline"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--volume-mib", type=int, default=1024)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=str(ROOT / ".bench-tmp" / "cuda"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_transfer.md"))
    args = ap.parse_args(argv)
    if not cuda.available():
        print(f"cuda_transfer: CUDA not usable ({cuda.reason()}); nothing measured",
              file=sys.stderr)
        return 2
    res = anyio.run(run, args)
    st = cuda.stats()
    lines = [
        "# NVMe -> GPU transfer (benchmarks/cuda_transfer.py)", "",
        f"Device: {st['device_name']}; {res['blocks']} blocks of {args.block_mib} MiB, "
        f"median of {res['reps']}; engine {res['engine']} (O_DIRECT {res['o_direct']}); "
        f"{res['cuda']}; baseline = {res['baseline_kind']}.", "",
        "| path | GB/s |", "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in res["gb_per_s"].items()),  # type: ignore[attr-defined]
        "", f"arena->gpu / baseline = **{res['ratio_vs_baseline']:.2f}x**", "",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
