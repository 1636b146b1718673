"""End-to-end put/get throughput of the store with each codec, counted in INPUT bytes.

The design target: FP8 must be worth turning on, i.e. FP8 put and get throughput
(bytes the engine hands over / gets back per second) above raw.  Every codec runs in the
same process, interleaved per repetition, on the same file system, with durable puts
(fdatasync + LMDB commit) and cold O_DIRECT gets on a reopened store.

    python benchmarks/fp8_e2e.py [--reps 3] [--volume-mib 128] [--dir DIR]

Blocks are Llama-3-8B-like KV blocks, [2, 32 layers, 16 tokens, 8 heads, 128] bf16
(2 MiB), drawn as activation-scaled normals.  Results: benchmarks/results/fp8_e2e.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

import kvstore
from kvstore.codecs.pipeline import CodecSpec, KVLayout

LAYOUT = KVLayout(kv_axis=0, token_axis=2, head_axis=3)
CODECS: dict[str, CodecSpec | None] = {
    "raw": None,
    "zstd (lossless byte planes)": CodecSpec(zstd=True),
    "fp8_e4m3": CodecSpec(fp8="e4m3", layout=LAYOUT),
    "fp8_e4m3 + zstd": CodecSpec(fp8="e4m3", zstd=True, layout=LAYOUT),
}


async def one(path: Path, spec: CodecSpec | None, keys: list[bytes],
              blocks: list[torch.Tensor]) -> tuple[float, float, float]:
    """(put s, get s, compression ratio) for one fresh store."""
    shutil.rmtree(path, ignore_errors=True)
    async with kvstore.open(path, codec=spec, extent_bytes=1 << 30) as store:
        t0 = time.perf_counter()
        await store.put_many(keys, blocks)
        put = time.perf_counter() - t0
        ratio = store.stats().compression_ratio
    async with kvstore.open(path) as store:
        t0 = time.perf_counter()
        got = await store.get_many(keys)
        get = time.perf_counter() - t0
    assert all(g is not None for g in got)
    return put, get, ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--volume-mib", type=int, default=128)
    ap.add_argument("--dir", default="./.bench-tmp/fp8")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    n = max(1, args.volume_mib // 2)
    g = torch.Generator().manual_seed(0)
    blocks = [(torch.randn(2, 32, 16, 8, 128, generator=g) * 2).to(torch.bfloat16)
              for _ in range(n)]
    keys = [os.urandom(16) for _ in blocks]
    volume = sum(b.numel() * b.element_size() for b in blocks)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CODECS}
    # A directory of our own inside --dir: only what this run created is ever deleted.
    os.makedirs(args.dir, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvstore-fp8-e2e-", dir=args.dir))
    try:
        for rep in range(args.reps):
            for name, spec in CODECS.items():
                results[name].append(anyio.run(one, work / "store", spec, keys, blocks))
                print(f"rep {rep + 1} {name}: done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def mbps(xs: list[float]) -> str:
        v = sorted(volume / x / 1e6 for x in xs)
        return f"{v[0]:.0f} / **{statistics.median(v):.0f}** / {v[-1]:.0f}"

    raw_put = statistics.median(volume / r[0] for r in results["raw"])
    raw_get = statistics.median(volume / r[1] for r in results["raw"])
    lines = [
        "# Store throughput per codec (input bytes), durable puts, cold gets",
        "",
        f"- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; {n} blocks of 2 MiB bf16 "
        f"([2,32,16,8,128]) per measurement, {args.reps} interleaved repetitions; "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs",
        "- MB/s = 10^6 input bytes per second, min / **median** / max; ratio = median / raw median",
        "",
        "| codec | size ratio | put MB/s | get MB/s | put vs raw | get vs raw |",
        "|---|---|---|---|---|---|",
    ]
    for name, rs in results.items():
        put_med = statistics.median(volume / r[0] for r in rs)
        get_med = statistics.median(volume / r[1] for r in rs)
        lines.append(f"| {name} | {statistics.median(r[2] for r in rs):.2f} | "
                     f"{mbps([r[0] for r in rs])} | {mbps([r[1] for r in rs])} | "
                     f"{put_med / raw_put:.2f} | {get_med / raw_get:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8_e2e.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
