"""Single-block get rate of one store, and the same measured across source trees
(what a change to the read path costs; used for the read marks of issue 43).

    python benchmarks/get_rate.py [--dir /dev/shm] [--calls 3000] [--block 65536]
    python benchmarks/get_rate.py --trees OLD_TREE NEW_TREE [--rounds 9]
                                  [--out-dir benchmarks/results]

One store (thread-pool engine, memory tier off) holding 256 blocks; ``--calls`` gets of
one block each, keys in a fixed shuffled order, on one asyncio loop; reported: gets per
second.  On tmpfs (the default directory) reads come from memory, so the number is the
per-call CPU cost of the read path, where a fixed cost per get shows most.  With
``--trees`` the measurement runs in a fresh interpreter inside each tree (its
``kvstore`` first on the path), the trees alternating round by round (order reversed
every other round); reported: the median, min and max per tree.
"""

from __future__ import annotations

import argparse
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
TREE = os.environ.get("GET_RATE_TREE", HERE)  # whose kvstore is measured
sys.path.insert(0, TREE)


def one_run(base: str, calls: int, block: int) -> float:
    import anyio
    import torch

    import kvstore

    root = tempfile.mkdtemp(prefix="get-rate-", dir=base)
    ns = kvstore.Namespace(model="get-rate", dtype="float32", block_size=4)

    async def run() -> float:
        async with kvstore.open(root, namespace=ns, engine="threads",
                                memory_bytes=0) as store:
            ks = ns.chain_keys(list(range(256 * 4)))  # 256 keys
            await store.put_many(ks, [torch.full((block // 4,), float(i)) for i in range(256)])
            order = [ks[i % 256] for i in range(calls)]
            random.Random(0).shuffle(order)
            for k in order[:200]:  # warm up
                await store.get(k)
            start = time.perf_counter()
            for k in order:
                await store.get(k)
            return calls / (time.perf_counter() - start)

    assert kvstore.__file__.startswith(TREE), kvstore.__file__
    try:
        return float(anyio.run(run))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def across(trees: list[str], rounds: int, args: argparse.Namespace) -> dict[str, Any]:
    rates: dict[str, list[float]] = {t: [] for t in trees}
    for r in range(rounds):
        for tree in (trees if r % 2 == 0 else list(reversed(trees))):
            out = subprocess.run(
                [sys.executable, os.path.join(HERE, "benchmarks", "get_rate.py"), "--dir",
                 args.dir, "--calls", str(args.calls), "--block", str(args.block)],
                cwd=tree, env={**os.environ, "GET_RATE_TREE": tree}, check=True,
                capture_output=True, text=True).stdout
            rates[tree].append(float(out.split()[0]))
    return {t: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
            for t, v in rates.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                   else tempfile.gettempdir())
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--block", type=int, default=65536)
    p.add_argument("--trees", nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out-dir", default=None, help="with --trees: get_rate_<labels>.md/.json")
    args = p.parse_args(argv)
    if not args.trees:
        print(f"{one_run(args.dir, args.calls, args.block):.1f} gets/s")
        return 0
    doc = {"command": " ".join(["python benchmarks/get_rate.py", *sys.argv[1:]]),
           "calls": args.calls, "block": args.block, "rounds": args.rounds,
           "trees": across(args.trees, args.rounds, args)}
    lines = [f"# Single-block get rate, {args.rounds} interleaved rounds", "",
             f"`{doc['command']}`; {args.calls} gets of {args.block}-byte blocks per run.", "",
             "| tree | median gets/s | min | max |", "|---|---:|---:|---:|"]
    for tree, v in doc["trees"].items():
        lines.append(f"| {tree} | {v['median']:.0f} | {v['min']:.0f} | {v['max']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out_dir:
        sys.path.insert(0, HERE)
        from benchmarks.common import write_results
        write_results(os.path.join(args.out_dir, "get_rate_" + "_vs_".join(
            os.path.basename(t.rstrip("/")) for t in args.trees)), text, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
