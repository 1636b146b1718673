"""2 MiB put/get throughput of two kvstore trees in one run, as a ratio (a change's
"throughput unchanged" check).

    python benchmarks/ratio_2mib.py BASE_TREE NEW_TREE [--rounds 3] [--mib 256]

Each round runs each tree in its own subprocess (the tree first on ``sys.path``, so its
``kvstore`` is the one imported), alternating which goes first; every measurement uses a
fresh store on the same file system (io_uring, O_DIRECT, sync=True), puts ``--mib`` MiB
in 2 MiB blocks (batches of 16, one caller) until acknowledged, then reads them all back
cold.  Prints the median GB/s of each and new/base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r'''
import json, os, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import anyio, torch, kvstore
assert kvstore.__file__.startswith(sys.argv[1]), kvstore.__file__
MIB, DIR = int(sys.argv[2]), sys.argv[3]
NS = kvstore.Namespace(model="ratio", dtype="uint8", block_size=1)
n = MIB // 2
keys = NS.chain_keys(list(range(n)))
vals = [torch.randint(0, 255, (2 << 20,), dtype=torch.uint8) for _ in range(16)]

async def main():
    path = tempfile.mkdtemp(dir=DIR)
    async with kvstore.open(path, namespace=NS, engine="io_uring", extent_bytes=1 << 30) as s:
        t = time.perf_counter()
        for i in range(0, n, 16):
            ks = keys[i:i + 16]
            await s.put_many(ks, vals[:len(ks)])
        put = time.perf_counter() - t
    os.system(f"sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null")
    async with kvstore.open(path, namespace=NS, engine="io_uring") as s:
        t = time.perf_counter()
        for i in range(0, n, 16):
            got = await s.get_many(keys[i:i + 16])
            assert all(g is not None for g in got)
        get = time.perf_counter() - t
    print(json.dumps({"put_gbs": MIB / 1024 / put, "get_gbs": MIB / 1024 / get}))
    import shutil; shutil.rmtree(path)

anyio.run(main)
'''


def run(tree: str, mib: int, directory: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree), str(mib), directory],
                         capture_output=True, text=True, check=True, cwd=directory)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--dir", default=None, help="where the test stores go (default: a temp dir)")
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="kvstore-ratio-")
    results: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for r in range(args.rounds):
        order = [("base", args.base), ("new", args.new)]
        for name, tree in order if r % 2 == 0 else order[::-1]:
            results[name].append(run(tree, args.mib, directory))
            print(name, r, results[name][-1], flush=True)
    for metric in ("put_gbs", "get_gbs"):
        base = statistics.median(x[metric] for x in results["base"])
        new = statistics.median(x[metric] for x in results["new"])
        print(f"{metric}: base {base:.3f}  new {new:.3f}  new/base {new / base:.3f}")


if __name__ == "__main__":
    main()
