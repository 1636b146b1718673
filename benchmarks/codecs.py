"""Speed, compression ratio and accuracy of the per-block codecs (kvstore.codecs).

What is measured
----------------
* Blocks of 2 MiB shaped ``[2, 32, 16, 8, 128]`` (K/V, layers, tokens, heads, head_dim)
  in float16 and bfloat16, with ``KVLayout(kv_axis=0, token_axis=2, head_axis=3)``.  The
  data is the real SmolLM2-135M K/V capture (``shared/data/kv``, or ``KVSTORE_TEST_DATA``)
  tiled into that shape, or standard normal numbers when it is absent (the table says
  which).  A single block is reused; encode/decode are timed separately.
* For each codec: encode and decode wall time per call (``time.perf_counter``), repeated
  ``--reps`` times after ``--warmup`` untimed calls, reported as GB/s of *input* (raw
  tensor) bytes, min / median / max (decimal GB).  Decode writes into a preallocated
  ``out`` tensor, as the store's ``get_many(out=...)`` would.
* Baseline: torch's own ``x.to(torch.float8_e4m3fn)`` / ``float8_e5m2`` (no scale) and
  ``.to(dtype)`` back, i.e. what a naive codec would run.
* Ratio: raw bytes / payload bytes.
* Accuracy (real data only): relative Frobenius error of the attention output
  ``softmax(QK^T/sqrt(d))V`` (causal, GQA 9 query / 3 KV heads, all 4 layers) with K and
  V round-tripped through the codec, per codec and scale granularity.

Rerun::

    python benchmarks/codecs.py                 # ~1 min
    python benchmarks/codecs.py --reps 5 --quick

The markdown table goes to stdout and to ``--out`` (default benchmarks/results/codecs.md).
The machine is a shared 2-core VM: the spread between min and max is noise, the
median is the figure to read.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.codecs.pipeline import CodecSpec, KVLayout, decode, encode  # noqa: E402

SHAPE = (2, 32, 16, 8, 128)
LAYOUT = KVLayout(kv_axis=0, token_axis=2, head_axis=3)
CODECS: list[tuple[str, CodecSpec]] = [
    ("raw", CodecSpec(layout=LAYOUT)),
    ("raw+zstd (byte planes)", CodecSpec(zstd=True, layout=LAYOUT)),
    ("fp8_e4m3", CodecSpec(fp8="e4m3", layout=LAYOUT)),
    ("fp8_e4m3+zstd", CodecSpec(fp8="e4m3", zstd=True, layout=LAYOUT)),
    ("fp8_e5m2", CodecSpec(fp8="e5m2", layout=LAYOUT)),
    ("fp8_e5m2+zstd", CodecSpec(fp8="e5m2", zstd=True, layout=LAYOUT)),
]


def data_dir() -> Path:
    """KVSTORE_TEST_DATA, else the full capture next to the checkout, else the tests'
    trimmed sample (tests/data/kv: 128 of the 512 tokens)."""
    env = os.environ.get("KVSTORE_TEST_DATA")
    if env:
        return Path(env)
    full = Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"
    return full if full.is_dir() else Path(__file__).resolve().parents[1] / "tests" / "data" / "kv"


def load_real() -> dict[str, torch.Tensor] | None:
    d = data_dir()
    if not (d / "smollm2_sample_meta.json").exists():
        return None
    out = {n: torch.from_numpy(np.load(d / f"smollm2_sample_{n}_fp16.npy")) for n in "QKV"}
    for n in "KV":
        out[n + "bf16"] = torch.from_numpy(
            np.load(d / f"smollm2_sample_{n}_bf16bits.npy").view(np.int16)).view(torch.bfloat16)
    return out


def make_block(real: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> torch.Tensor:
    """[2, 32, 16, 8, 128] from the real K/V ([4, 512, 3, 64]) tiled, or random normal."""
    if real is None:
        g = torch.Generator().manual_seed(0)
        return torch.randn(SHAPE, generator=g).to(dtype)
    sfx = "" if dtype == torch.float16 else "bf16"
    kv = torch.stack([real["K" + sfx], real["V" + sfx]])          # [2, 4, 512, 3, 64]
    # [2, L, T, H, D] -> take 16-token windows from the layers/tokens, tile heads to 8
    # and head_dim to 128 (two different tokens' vectors side by side)
    windows = kv.reshape(2, 128, 16, 3, 64)                         # 4 layers x 32 windows
    # Copies of a vector would compress far too well, so every copy is permuted along
    # head_dim with its own fixed permutation (values real, no long repeated runs).
    g = torch.Generator().manual_seed(0)
    parts = [windows[:, i::4][..., torch.randperm(64, generator=g)] for i in range(4)]
    x = torch.cat(parts[:3], dim=3)[:, :, :, :8]                    # 9 heads -> 8
    y = torch.cat(parts[1:], dim=3)[:, :, :, 1:9]
    x = torch.cat([x, y[..., torch.randperm(64, generator=g)]], dim=4)   # 64 -> 128
    return x.contiguous().to(dtype)


def timeit(fn: Callable[[], object], reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def gbps(nbytes: int, ts: list[float]) -> str:
    r = sorted(nbytes / t / 1e9 for t in ts)
    return f"{statistics.median(r):.2f} ({r[0]:.2f}-{r[-1]:.2f})"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.float().permute(0, 2, 1, 3) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def accuracy(real: dict[str, torch.Tensor]) -> list[str]:
    lay = KVLayout(0, 2, 3)
    lines = ["| dtype | codec | K granularity | V granularity | attention-output rel. error "
             "| K tensor rel. error | V tensor rel. error | ratio |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for dtype, sfx in ((torch.float16, ""), (torch.bfloat16, "bf16")):
        k, v = real["K" + sfx], real["V" + sfx]
        block = torch.stack([k, v])
        ref = attention(real["Q"], k, v)
        combos = [("e4m3", "token_head", "head"), ("e4m3", "token_head", "token_head"),
                  ("e4m3", "head", "head"), ("e4m3", "tensor", "tensor"),
                  ("e5m2", "token_head", "head"), ("e5m2", "tensor", "tensor")]
        for fp8, kg, vg in combos:
            spec = CodecSpec(fp8=fp8, zstd=True, layout=lay, k_granularity=kg, v_granularity=vg)
            cid, p = encode(block, spec)
            rt = decode(cid, p, dtype, tuple(block.shape))
            o = attention(real["Q"], rt[0], rt[1])
            e = float((o - ref).norm() / ref.norm())
            ek = float((rt[0].float() - k.float()).norm() / k.float().norm())
            ev = float((rt[1].float() - v.float()).norm() / v.float().norm())
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {fp8}+zstd | {kg} | {vg} "
                         f"| {e:.4f} | {ek:.4f} | {ev:.4f} | {block.numel() * 2 / p.size:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer reps, no accuracy section")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch intra-op thread counts to run the speed table with")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 5)

    real = load_real()
    source = f"real SmolLM2-135M K/V from {data_dir()} (tiled)" if real is not None \
        else "random normal (real data not found)"
    lines = [
        "# Codec throughput and ratio (kvstore.codecs)",
        "",
        f"Block: {list(SHAPE)}, 2 MiB, layout KVLayout(0, 2, 3); data: {source}.  "
        f"{args.reps} timed reps after {args.warmup} warm-up; GB/s of input (raw) bytes, "
        "median (min-max).  Decode writes into a preallocated tensor.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), numpy {np.__version__}, "
        f"Python {platform.python_version()}.  Shared VM: read the medians.  With 2 torch "
        "threads on a 2-core VM that has another busy process, each parallel torch op "
        "waits for a preempted worker thread (~8 ms, one scheduler slice), so the "
        "single-thread table is the one that shows the codec's cost.",
    ]
    for threads in args.threads:
        torch.set_num_threads(threads)
        lines += ["", f"### torch threads = {threads}", "",
                  "| dtype | codec | id used | encode GB/s | decode GB/s | ratio |",
                  "|---|---|---:|---:|---:|---:|"]
        lines += speed_table(real, args.reps, args.warmup)
    torch.set_num_threads(args.threads[0])
    if real is not None and not args.quick:
        lines += ["", "## Accuracy on the real capture (4 layers x 512 tokens, un-tiled)", "",
                  *accuracy(real)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "codecs.md").write_text(text)
    return 0


def speed_table(real: dict[str, torch.Tensor] | None, reps: int, warmup: int) -> list[str]:
    lines: list[str] = []
    for dtype in (torch.float16, torch.bfloat16):
        x = make_block(real, dtype)
        nbytes = x.numel() * x.element_size()
        dname = str(dtype).removeprefix("torch.")
        for name, spec in CODECS:
            cid, p = encode(x, spec)
            payload = bytes(p)
            out = torch.empty_like(x)
            te = timeit(lambda x=x, spec=spec: encode(x, spec), reps, warmup)
            td = timeit(lambda cid=cid, payload=payload, out=out, dt=dtype:
                        decode(cid, payload, dt, SHAPE, out=out), reps, warmup)
            lines.append(f"| {dname} | {name} | {cid:#04x} | {gbps(nbytes, te)} "
                         f"| {gbps(nbytes, td)} | {nbytes / len(payload):.2f} |")
        for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            q = x.to(f8)
            te = timeit(lambda x=x, f8=f8: x.to(f8), reps, warmup)
            td = timeit(lambda q=q, dt=dtype: q.to(dt), reps, warmup)
            lines.append(f"| {dname} | baseline torch `.to({str(f8).removeprefix('torch.')})`, "
                         f"no scale | - | {gbps(nbytes, te)} | {gbps(nbytes, td)} | 2.00 |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
