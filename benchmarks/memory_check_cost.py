"""What the memory tier's index check costs a get (issue 43, DESIGN 13): a memory hit is
served only if the index names the same block (``seq``), and a copy of a key the index
no longer holds is dropped by the get that finds it gone.  Measured before/after, two
kvstore trees interleaved, each in a subprocess that imports its own ``kvstore``:

    python benchmarks/memory_check_cost.py BASE_TREE [--new-tree .] [--reps 6]

Per tree and repetition: a store with a memory tier holding ``blocks`` 64 KiB blocks
(threads engine, ``sync=False``: only gets are timed); ``get_many`` of batches of 32
memory hits (blocks/s), then of 32 keys that are not stored (calls/s: the lookup and
the memory tier's pass over the misses, no disk read); then ``MemoryTier.take`` alone
over 32 hits and over 32 absent keys (us per call, best of 7 x 2000 calls: the check
itself, least disturbed by other load).  Prints the medians and ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = textwrap.dedent("""
    import json, sys, tempfile, time
    sys.path.insert(0, sys.argv[1])
    import torch, kvstore
    from kvstore.testing import parts
    from tests.conformance import NS, keys
    blocks, rounds = int(sys.argv[2]), int(sys.argv[3])
    with tempfile.TemporaryDirectory(dir=sys.argv[4]) as d:
        with kvstore.open_blocking(d, namespace=NS, engine="threads", sync=False,
                                   memory_bytes=2 * blocks * (64 << 10)) as s:
            ks = keys(blocks)
            for i in range(0, blocks, 32):
                s.put_many(ks[i:i + 32], [torch.full((64 << 10,), j % 251, dtype=torch.uint8)
                                           for j in range(i, i + 32)])
            absent = keys(32, 1 << 20)
            t = time.perf_counter()
            for r in range(rounds):
                for i in range(0, blocks, 32):
                    s.get_many(ks[i:i + 32])
            hit_s = time.perf_counter() - t
            t = time.perf_counter()
            for r in range(rounds * blocks // 32):
                s.get_many(absent)
            miss_s = time.perf_counter() - t
            assert s.stats().memory_hits == rounds * blocks, kvstore.__file__
            # the check alone: MemoryTier.take over 32 keys (best of 7 x 2000 calls; no
            # call of the store is in flight meanwhile)
            tier, index = parts(s).memory_tier, parts(s).index
            micro = {}
            for name, ks32 in (("take_hits_us", ks[:32]), ("take_absent_us", absent)):
                entries, best = index.get_entries(ks32), float("inf")
                for _ in range(7):
                    t = time.perf_counter()
                    for _ in range(2000):
                        tier.release(tier.take(ks32, entries)[0])
                    best = min(best, time.perf_counter() - t)
                micro[name] = best / 2000 * 1e6
    print(json.dumps({"hits_per_s": rounds * blocks / hit_s,
                      "miss_calls_per_s": rounds * blocks / 32 / miss_s,
                      **micro, "kvstore": kvstore.__file__}))
""")


def measure(tree: str, blocks: int, rounds: int, where: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", RUN, os.path.abspath(tree), str(blocks),
                          str(rounds), where], cwd=os.path.abspath(tree), check=True,
                         capture_output=True, text=True).stdout
    got: dict[str, float] = json.loads(out)
    assert str(got["kvstore"]).startswith(os.path.abspath(tree)), got
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base_tree")
    p.add_argument("--new-tree", default=HERE)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for rep in range(args.reps):  # the order alternates: a drift hits both alike
        order = ["base", "new"] if rep % 2 == 0 else ["new", "base"]
        for name in order:
            tree = args.base_tree if name == "base" else args.new_tree
            runs[name].append(measure(tree, args.blocks, args.rounds, args.dir))
    for metric in ("hits_per_s", "miss_calls_per_s", "take_hits_us", "take_absent_us"):
        row = []
        for name in ("base", "new"):
            vals = [r[metric] for r in runs[name]]
            fmt = ",.2f" if metric.endswith("_us") else ",.0f"
            row.append(f"{name} {statistics.median(vals):{fmt}} [{min(vals):{fmt}}-"
                       f"{max(vals):{fmt}}]")
        ratio = statistics.median(r[metric] for r in runs["new"]) / \
            statistics.median(r[metric] for r in runs["base"])
        print(f"{metric:18} " + "  ".join(row) + f"  new/base {ratio:.3f}")


if __name__ == "__main__":
    main()
