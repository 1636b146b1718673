"""A long-lived store, before/after: one caller's durable puts and ``get_many(out=)`` on a
store that has already moved data (its staging arena faulted in), for two kvstore trees.

    python benchmarks/steady.py BASE_TREE [--new-tree .] [--blocks 1M,32M] [--mib 512]
        [--rounds 2] [--callers 1] [--out FILE.md]

``benchmarks/compare_trees.py`` opens a fresh store for every measurement, as the bench
does: its numbers include what a store pays once (arena pages faulted in on first use).
An engine opens its store once and moves data for hours; this measures that state.  Each
(tree, block) runs in its own subprocess importing the tree measured: a store is opened,
``--mib`` is put and got untimed (warm-up), then three timed rounds of put ``--mib`` (new
keys, batches of 32; 4 at >= 32 MiB; ``--callers`` tasks at once, each its share of the
keys), get them back into preallocated tensors, delete
them.  Trees alternate within every round of the outer loop, and base and new trade
places every other round.  Prints GB/s and process CPU core-seconds per GB, median of
the timed rounds, and new/base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, os, resource, shutil, sys, tempfile, time
tree, block, mib, root, callers = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                   sys.argv[4], int(sys.argv[5]))
sys.path.insert(0, tree)
import kvstore  # the measured tree's package
assert kvstore.__file__.startswith(tree), kvstore.__file__
import anyio, torch
torch.set_num_threads(2)
n = max(1, (mib << 20) // block)
batch = 32 if block < (32 << 20) else 4
gen = torch.Generator().manual_seed(13)
values = [torch.randint(0, 255, (block,), dtype=torch.uint8, generator=gen)
          for _ in range(min(n, 16))]
outs = [[torch.empty(block, dtype=torch.uint8) for _ in range(batch)]
        for _ in range(callers)]

def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def each_caller(fn, keys):
    """``fn(caller, its keys)`` for ``callers`` concurrent tasks, the keys split evenly."""
    per = -(-len(keys) // callers)
    async with anyio.create_task_group() as tg:
        for c in range(callers):
            tg.start_soon(fn, c, keys[c * per:(c + 1) * per])

async def put_all(store, c, keys):
    for i in range(0, len(keys), batch):
        chunk = keys[i:i + batch]
        await store.put_many(chunk, [values[j % len(values)] for j in range(len(chunk))])

async def get_all(store, c, keys):
    for i in range(0, len(keys), batch):
        chunk = keys[i:i + batch]
        got = await store.get_many(chunk, out=outs[c][:len(chunk)])
        assert all(g is not None for g in got)

async def one_round(store, samples):
    keys = [os.urandom(16) for _ in range(n)]
    c, t = cpu(), time.perf_counter()
    await each_caller(lambda i, ks: put_all(store, i, ks), keys)
    put_s, put_cpu = time.perf_counter() - t, cpu() - c
    c, t = cpu(), time.perf_counter()
    await each_caller(lambda i, ks: get_all(store, i, ks), keys)
    get_s, get_cpu = time.perf_counter() - t, cpu() - c
    await store.delete_many(keys)
    gb = n * block / 1e9
    if samples is not None:
        samples.append({"put_gbps": gb / put_s, "put_cpu": put_cpu / gb,
                        "get_gbps": gb / get_s, "get_cpu": get_cpu / gb})

async def main():
    path = tempfile.mkdtemp(dir=root)
    samples = []
    try:
        async with kvstore.open(path) as store:
            await one_round(store, None)  # warm-up: the arena faulted in, extents made
            for _ in range(3):
                await one_round(store, samples)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    print("RESULT " + json.dumps(samples))

anyio.run(main)
'''


def run_tree(tree: str, block: int, mib: int, root: str, callers: int
             ) -> list[dict[str, float]]:
    out = subprocess.run([sys.executable, "-c", CHILD, tree, str(block), str(mib), root,
                          str(callers)],
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return list(json.loads(line[len("RESULT "):]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base_tree")
    p.add_argument("--new-tree", default=HERE)
    p.add_argument("--blocks", default="1M,32M")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--callers", type=int, default=1, help="concurrent callers per store")
    p.add_argument("--dir", default=None, help="where stores go (default: .bench-tmp here)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from benchmarks.common import parse_size

    trees = {"base": os.path.abspath(args.base_tree), "new": os.path.abspath(args.new_tree)}
    root = args.dir or os.path.join(HERE, ".bench-tmp")
    os.makedirs(root, exist_ok=True)
    blocks = [parse_size(b) for b in args.blocks.split(",")]
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
        for block in blocks:
            for name in order:
                with tempfile.TemporaryDirectory(dir=root) as scratch:
                    samples.setdefault((name, block), []).extend(
                        run_tree(trees[name], block, args.mib, scratch, args.callers))
    cmd = "python benchmarks/steady.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"`{cmd}`", "", f"- base: {trees['base']}; new: {trees['new']}",
             f"- {args.callers} caller(s); {args.mib} MiB per round, {args.rounds} x 3 timed rounds per tree and block "
             "size, one store per tree and block (warmed by an untimed round); median "
             "[min-max]", "",
             "| op | block | base GB/s | new GB/s | new / base | base core-s/GB | "
             "new core-s/GB |", "|---|---|---:|---:|---:|---:|---:|"]
    for block in blocks:
        for op in ("put", "get"):
            base = [s[f"{op}_gbps"] for s in samples[("base", block)]]
            new = [s[f"{op}_gbps"] for s in samples[("new", block)]]
            cpu = {k: statistics.median(s[f"{op}_cpu"] for s in samples[(k, block)])
                   for k in ("base", "new")}
            lines.append(
                f"| {op} | {block >> 10} KiB | {_span(base)} | {_span(new)} | "
                f"**{statistics.median(new) / statistics.median(base):.2f}** | "
                f"{cpu['base']:.2f} | {cpu['new']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def _span(values: list[float]) -> str:
    return f"**{statistics.median(values):.2f}** [{min(values):.2f}-{max(values):.2f}]"


if __name__ == "__main__":
    sys.exit(main())
