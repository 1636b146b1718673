"""What a scrub at its default rate costs a concurrent get stream (DESIGN target: <= 10%).

    python benchmarks/scrub_cost.py [--dir DIR] [--store 2G] [--block 1M] [--batch 8]
                                    [--callers 1] [--seconds 3] [--reps 6] [--rate 64M]
                                    [--no-io-scheduling] [--out-dir benchmarks/results]

One store of ``--store`` bytes of ``--block`` blocks (the default engine: io_uring and
O_DIRECT where they work, so every get reads the device).  Each repetition runs the same
get stream twice for ``--seconds``, in the same process, once alone (the baseline) and
once beside ``Store.scrub(rate_bytes_per_s=--rate)`` (passes restarted for as long as the
stream runs), in alternating order (A B, B A, ...) so that drift does not favour either.
The stream: ``--callers`` tasks, each getting batches of ``--batch`` random blocks one
after another (a saturating closed loop: the scrub's worst case for the gets).

Reported per repetition: the stream's throughput with the scrub / without (the cost is
1 - that ratio), get latency p50/p99 both ways, and what the scrub read meanwhile (its
rate yields to gets: under a saturating stream it reads one batch per
``kvstore.core.scrub.PATIENCE_S``); then min / median / max of the ratios.  Results go to
``--out-dir/scrub_get_cost_at_<commit>.md`` and ``.json``.  ``--no-io-scheduling`` opens
the store with ``io_scheduling=False`` (no read-first scheduler: the scrub's reads go at
once, so it reads at its full rate and only the rate bounds its cost); its results go to
``scrub_get_cost_unscheduled_at_<commit>``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import anyio  # noqa: E402
import torch  # noqa: E402

import kvstore  # noqa: E402
import kvstore.core.scrub  # noqa: E402
from benchmarks.common import machine_info, parse_size, percentile, summary  # noqa: E402
from kvstore.testing import parts  # noqa: E402

MIB = 1 << 20


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(8, "big") * 2 for i in range(n)]


async def _fill(store: kvstore.Store, n: int, block: int) -> None:
    g = torch.Generator().manual_seed(0)
    keys = _keys(n)
    for start in range(0, n, 64):
        chunk = keys[start:start + 64]
        await store.put_many(chunk, [torch.randint(0, 256, (block,), dtype=torch.uint8,
                                                   generator=g) for _ in chunk])


async def _stream(store: kvstore.Store, n: int, args: argparse.Namespace,
                  scrub_rate: float | None) -> dict[str, float]:
    """The get stream for ``args.seconds``, with a scrub beside it when ``scrub_rate``."""
    keys = _keys(n)
    latencies: list[float] = []
    got = [0]
    before = store.stats().scrubbed_bytes
    deadline = time.perf_counter() + args.seconds

    async def caller(seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            batch = rng.sample(keys, args.batch)
            t = time.perf_counter()
            out = await store.get_many(batch)
            latencies.append(time.perf_counter() - t)
            assert all(o is not None for o in out)
            got[0] += len(batch) * args.block

    async def scrub(scope: anyio.CancelScope) -> None:
        with scope:
            while True:
                await store.scrub(rate_bytes_per_s=scrub_rate, restart=True)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        if scrub_rate is not None:
            tg.start_soon(scrub, scope)
        async with anyio.create_task_group() as callers:
            for i in range(args.callers):
                callers.start_soon(caller, i)
        scope.cancel()
    elapsed = time.perf_counter() - started
    return {"get_MBps": got[0] / elapsed / 1e6, "p50_ms": percentile(latencies, 50) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3, "gets": len(latencies),
            "scrub_MBps": (store.stats().scrubbed_bytes - before) / elapsed / 1e6}


async def measure(root: str, args: argparse.Namespace) -> dict[str, Any]:
    n = args.store // args.block
    path = os.path.join(root, "store")
    async with kvstore.open(path, extent_bytes=1 << 30, staging_bytes=256 << 20,
                            io_scheduling=args.io_scheduling) as store:
        await _fill(store, n, args.block)
        engine = f"{parts(store).engine.name}{' + O_DIRECT' if parts(store).engine.direct else ''}"
        await _stream(store, n, args, None)  # warm-up: one unmeasured run
        reps: list[dict[str, Any]] = []
        for rep in range(args.reps):
            runs: dict[str, dict[str, float]] = {}
            order = ("alone", "scrub") if rep % 2 == 0 else ("scrub", "alone")
            for mode in order:
                runs[mode] = await _stream(store, n, args,
                                           args.rate if mode == "scrub" else None)
            runs["ratio"] = {"get": runs["scrub"]["get_MBps"] / runs["alone"]["get_MBps"]}
            reps.append(runs)
            print(f"rep {rep}: alone {runs['alone']['get_MBps']:.0f} MB/s, with scrub "
                  f"{runs['scrub']['get_MBps']:.0f} MB/s (ratio {runs['ratio']['get']:.3f}), "
                  f"scrub read {runs['scrub']['scrub_MBps']:.1f} MB/s", file=sys.stderr)
    ratios = [r["ratio"]["get"] for r in reps]
    info = machine_info(root)
    return {
        "command": " ".join(["python benchmarks/scrub_cost.py", *sys.argv[1:]]),
        "commit": _commit(), "engine": engine, "blocks": n, "block_bytes": args.block,
        "batch": args.batch, "callers": args.callers, "seconds": args.seconds,
        "rate_bytes_per_s": args.rate, "patience_s": kvstore.core.scrub.PATIENCE_S,
        "io_scheduling": args.io_scheduling,
        "reps": reps, "ratio": summary(ratios),
        "scrub_MBps": summary([r["scrub"]["scrub_MBps"] for r in reps]),
        "machine": f"{info['nproc']} CPUs ({info['cpu']}), kernel {info['kernel']}, "
                   f"{info['fs_type']} on {info['fs_device']}, load {info['loadavg_start']}"}


def _commit() -> str:
    out = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def render(doc: dict[str, Any]) -> str:
    r, s = doc["ratio"], doc["scrub_MBps"]
    lines = [
        f"# Scrub cost to a concurrent get stream, at {doc['commit']}",
        "",
        f"`{doc['command']}` — {doc['machine']}; {doc['engine']}.",
        "",
        f"{doc['blocks']} blocks of {doc['block_bytes'] // MIB} MiB; {doc['callers']} caller(s) "
        f"getting batches of {doc['batch']} random blocks back to back for "
        f"{doc['seconds']} s, alone and beside `Store.scrub(rate_bytes_per_s="
        f"{doc['rate_bytes_per_s'] / MIB:.0f} MiB/s)` (the default), alternating order, "
        f"{len(doc['reps'])} repetitions in one process; read-first I/O scheduling "
        f"{'on (the default)' if doc['io_scheduling'] else 'off: the scrub reads at its rate'}.",
        "",
        f"**Get throughput with the scrub / without: min {r['min']:.3f}, median "
        f"{r['median']:.3f}, max {r['max']:.3f}** (cost = 1 - ratio; target <= 10%).",
        f"The scrub read meanwhile: min {s['min']:.1f}, median {s['median']:.1f}, max "
        f"{s['max']:.1f} MB/s" + (f" (gets first: under a saturating stream it goes one "
                                  f"batch per {doc['patience_s']} s)."
                                  if doc["io_scheduling"] else "."),
        "",
        "| rep | alone MB/s | with scrub MB/s | ratio | p50 ms alone / scrub | "
        "p99 ms alone / scrub | scrub MB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, rep in enumerate(doc["reps"]):
        a, b = rep["alone"], rep["scrub"]
        lines.append(f"| {i} | {a['get_MBps']:.0f} | {b['get_MBps']:.0f} | "
                     f"{rep['ratio']['get']:.3f} | {a['p50_ms']:.2f} / {b['p50_ms']:.2f} | "
                     f"{a['p99_ms']:.2f} / {b['p99_ms']:.2f} | {b['scrub_MBps']:.1f} |")
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="scrub-cost-", dir=args.dir)
    try:
        return await measure(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="scratch directory (on the disk to measure)")
    p.add_argument("--store", type=parse_size, default=2 << 30)
    p.add_argument("--block", type=parse_size, default=1 << 20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--callers", type=int, default=1)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--rate", type=parse_size, default=kvstore.core.scrub.DEFAULT_SCRUB_BYTES_PER_S)
    p.add_argument("--no-io-scheduling", dest="io_scheduling", action="store_false",
                   help="no read-first scheduler (the scrub reads at its full rate)")
    p.add_argument("--out-dir", default=None, help="write scrub_get_cost_at_<commit>.md/.json")
    args = p.parse_args()
    if args.dir is None:
        args.dir = os.path.join(HERE, ".bench-tmp")
        os.makedirs(args.dir, exist_ok=True)
    doc = anyio.run(main_async, args)
    text = render(doc)
    print(text)
    if args.out_dir:
        kind = "" if args.io_scheduling else "_unscheduled"
        base = os.path.join(args.out_dir, f"scrub_get_cost{kind}_at_{doc['commit']}")
        with open(base + ".md", "w", encoding="utf-8") as f:
            f.write(text)
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=str)
    print(f"median ratio {statistics.median(r['ratio']['get'] for r in doc['reps']):.3f}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
