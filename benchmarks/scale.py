"""How ``open()``, ``match_prefix`` and memory scale with the number of stored blocks.

One store grows through the sizes asked for (default 1k, 10k, 100k, 1M blocks) by
``put_many`` through the public API, in batches, with small blocks (64 bytes of payload:
one 4 KiB slot each; the index does not care how big a block is).  The first 8,192
blocks are one chain (an engine's long prompt), the rest are chains of one batch each.
Puts during the build use ``sync=False`` (the build is not what is measured).

At every size a *fresh process* (``python -m benchmarks.scale probe``; an engine restart)
imports kvstore, then times:

* ``open()`` cold: the page cache emptied first where permitted (the LMDB index and
  everything else is read from disk), then ``open()`` warm (closed and opened again);
* ``match_prefix`` over the 8,192-block chain (all present: the longest walk), the
  median and max of 20 calls;
* the process's resident memory before ``open()``, after it, and after the lookups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
import torch

from benchmarks.common import Cold, rss_bytes

CHAIN = 8192
BATCH = 8192
PAYLOAD = 64


def key_for(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"kvbench\x00"


async def grow(path: str, have: int, want: int, extent_bytes: int) -> float:
    """Add blocks ``have..want-1``; seconds taken."""
    import kvstore

    value = torch.zeros(PAYLOAD, dtype=torch.uint8)
    t0 = time.perf_counter()
    async with kvstore.open(path, sync=False, extent_bytes=extent_bytes) as store:
        for lo in range(have, want, BATCH):
            hi = min(want, lo + BATCH)
            keys = [key_for(i) for i in range(lo, hi)]
            first = key_for(lo - 1) if 0 < lo < CHAIN else None
            parents = kvstore.chain_parents(keys, first_parent=first)
            res = await store.put_many(keys, [value] * len(keys), parents=parents)
            if res.written != len(keys):
                raise RuntimeError(f"scale build wrote {res.written} of {len(keys)}")
    return time.perf_counter() - t0


async def _probe(path: str, chain: int, calls: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rss_before_open": rss_bytes()["rss"]}
    import kvstore

    keys = [key_for(i) for i in range(chain)]
    for label in ("open_cold_s", "open_warm_s"):
        async with AsyncExitStack() as stack:
            t0 = time.perf_counter()
            store = await stack.enter_async_context(kvstore.open(path, create=False))
            out[label] = time.perf_counter() - t0
            if label == "open_cold_s":
                out["rss_after_open"] = rss_bytes()["rss"]
                continue
            out["blocks"] = store.stats().blocks
            ms = []
            for _ in range(calls):
                t0 = time.perf_counter()
                found = await store.match_prefix(keys)
                ms.append((time.perf_counter() - t0) * 1e3)
                if found != chain:
                    raise RuntimeError(f"match_prefix found {found} of {chain}")
            out["match_prefix_ms"] = {"median": statistics.median(ms), "max": max(ms),
                                      "min": min(ms)}
            out["rss_after_match"] = rss_bytes()["rss"]
    out["peak_rss"] = rss_bytes()["peak_rss"]
    return out


def probe(path: str, cold: Cold, chain: int, calls: int = 20) -> dict[str, Any]:
    """Run the probe in a fresh interpreter (cache emptied first) and return its report."""
    cold([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs])
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "probe", path,
                           "--chain", str(chain), "--calls", str(calls)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"scale probe failed: {proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["process_s"] = time.perf_counter() - t0
    return doc


async def run_scale(path: str, sizes: list[int], cold: Cold, extent_bytes: int,
                    log: Any) -> list[dict[str, Any]]:
    rows = []
    have = 0
    for size in sorted(sizes):
        build_s = await grow(path, have, size, extent_bytes)
        have = size
        row = {"blocks": size, "build_s": build_s, **probe(path, cold, min(CHAIN, size))}
        row["chain"] = min(CHAIN, size)
        du = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        row["disk_bytes"] = du
        rows.append(row)
        log(f"[scale {size:>8} blocks] built in {build_s:.1f} s; open cold "
            f"{row['open_cold_s'] * 1e3:.0f} ms, warm {row['open_warm_s'] * 1e3:.0f} ms; "
            f"match_prefix({row['chain']}) {row['match_prefix_ms']['median']:.2f} ms; "
            f"RSS +{(row['rss_after_open'] - row['rss_before_open']) / 2**20:.0f} MiB")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe", help="(internal) time open/match_prefix in this process")
    pr.add_argument("path")
    pr.add_argument("--chain", type=int, default=CHAIN)
    pr.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    doc = anyio.run(_probe, args.path, args.chain, args.calls)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
