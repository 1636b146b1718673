"""Before/after in one run: the bench's ``callers`` measurement (1 and 4 callers, durable
put then cold ``get_many(out=)``) for two kvstore trees, beside fio, interleaved.

    python benchmarks/compare_trees.py BASE_TREE [--new-tree .] [--blocks 64K,1M,2M,32M]
        [--volume-mib 256] [--reps 4] [--dir DIR] [--cold fadvise] [--out FILE.md]

Each kvstore measurement runs in its own subprocess whose ``kvstore`` is imported from
the tree measured (the measuring code is always this tree's ``benchmarks.callers``, so
both trees do exactly the same calls); fio runs in this process.  In every repetition
the order of {base, new, fio} x {1, 4 callers} rotates and base and new trade places
every other repetition (use an even ``--reps``), so a drift of a shared disk, or what the
run before leaves behind, hits both alike.  Prints (and with ``--out`` writes) one row
per target: fio MB/s, base and new ratios to fio (IOPS at 64 KiB), median [min-max], and
new/base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, sys
tree, here, block, n, callers, batch, rep, root, cold, engine, codec = sys.argv[1:12]
sys.path.insert(0, tree)
import kvstore  # the measured tree's package, before the measuring code is imported
assert kvstore.__file__.startswith(tree), kvstore.__file__
sys.path.remove(tree)
sys.path.insert(0, here)
import anyio, torch
torch.set_num_threads(2)
from benchmarks.callers import measure_kvstore
from benchmarks.common import Cold
from benchmarks.systems import Dataset, KvstoreSystem
ds = Dataset.make(int(block), int(n), seed=13)
samples = anyio.run(measure_kvstore, KvstoreSystem(engine, codec), ds, int(callers),
                    int(batch), int(rep), root, Cold(cold, root))
print("RESULT " + json.dumps(samples))
'''


def kvstore_run(tree: str, block: int, n: int, callers: int, batch: int, rep: int,
                root: str, cold: str, engine: str, codec: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, tree, HERE, str(block), str(n), str(callers),
         str(batch), str(rep), root, cold, engine, codec],
        capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return list(json.loads(line[len("RESULT "):]))


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, HERE)
    from benchmarks import fio as fio_mod
    from benchmarks.callers import BATCH, CALLERS, blocks_for, measure_fio
    from benchmarks.common import Cold, human, machine_info, parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base_tree")
    p.add_argument("--new-tree", default=HERE)
    p.add_argument("--blocks", default="64K,1M,2M,32M")
    p.add_argument("--volume-mib", type=float, default=256)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--dir", default=None, help="where stores and fio files go (default: "
                   "a temporary directory under the new tree)")
    p.add_argument("--cold", default="fadvise", choices=("drop", "fadvise", "none"))
    p.add_argument("--engine", default="io_uring")
    p.add_argument("--codec", default="raw", choices=("raw", "fp8"),
                   help="the codec both trees put with (input bytes are compared)")
    p.add_argument("--base-codec", default=None, choices=("raw", "fp8"),
                   help="the base's codec, if not --codec: with the same tree as base "
                   "and new, `--codec fp8 --base-codec raw` measures FP8 against raw")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    codecs = {"base": args.base_codec or args.codec, "new": args.codec}
    trees = {"base": os.path.abspath(args.base_tree), "new": os.path.abspath(args.new_tree)}
    fio = fio_mod.find_fio(None)
    if fio is None:
        p.error("fio is not installed (apt-get install fio): the ratios need it")
    blocks = [parse_size(b) for b in args.blocks.split(",")]
    volume = int(args.volume_mib * (1 << 20))
    if args.dir is None:
        args.dir = os.path.join(HERE, ".bench-tmp")
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="compare-", dir=args.dir)
    cold = Cold(args.cold, root)
    started = time.time()
    samples: list[dict[str, Any]] = []
    for bi, block in enumerate(blocks):
        n = blocks_for(volume, block)
        for rep in range(args.reps):
            # base and new trade places every other repetition, then the order rotates:
            # with one fixed order "new, 1 caller" always came right after a kvstore run
            # had removed its store and "base, 1 caller" after fio, and with the same tree
            # as both, "new" measured 0.91x "base" at 1 MiB one-caller puts.
            trees_first = ("base", "new") if rep % 2 == 0 else ("new", "base")
            runs = [(who, c) for who in (*trees_first, "fio") for c in CALLERS]
            k = (rep // 2 + bi) % len(runs)
            for who, callers in runs[k:] + runs[:k]:
                batch = min(BATCH, n // callers)
                if who == "fio":
                    got = measure_fio(fio, block, n, callers, rep, root, cold)
                else:
                    got = kvstore_run(trees[who], block, n, callers, batch, rep, root,
                                      args.cold, args.engine, codecs[who])
                for s in got:
                    s["who"] = who
                samples += got
            print(f"[{human(block)} rep {rep + 1}/{args.reps}] " + "  ".join(
                f"{s['who']}x{s['callers']}/{s['op']} {s['MB_s']:.0f}" for s in samples
                if (s["block_bytes"], s["rep"]) == (block, rep)), flush=True)
    report = render(samples, blocks, trees, machine_info(root), time.time() - started, args)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)
        with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
            json.dump({"trees": trees, "samples": samples}, f, indent=1)
    return 0


def _fmt(values: list[float]) -> str:
    return f"**{statistics.median(values):.2f}** [{min(values):.2f}-{max(values):.2f}]"


def render(samples: list[dict[str, Any]], blocks: list[int], trees: dict[str, str],
           machine: dict[str, Any], seconds: float, args: argparse.Namespace) -> str:
    from benchmarks.callers import CALLERS
    from benchmarks.common import human

    lines = [
        "# kvstore before/after, one run (benchmarks/compare_trees.py)", "",
        f"`python benchmarks/compare_trees.py {trees['base']} --blocks {args.blocks} "
        f"--volume-mib {args.volume_mib:g} --reps {args.reps} --cold {args.cold} "
        f"--codec {args.codec}" + (f" --base-codec {args.base_codec}" if args.base_codec
                                   else "") + f"`, {seconds:.0f} s", "",
        f"- base: {trees['base']} ({args.base_codec or args.codec}); new: {trees['new']} "
        f"({args.codec}); MB/s of input bytes (before the codec)",
        f"- machine: {machine['nproc']} CPUs ({machine['cpu']}), {machine['mem_gib']} GiB, "
        f"kernel {machine['kernel']}, Python {machine['python']}, torch {machine['torch']}; "
        f"load average at the end {os.getloadavg()}",
        "- ratios per repetition to fio in the same repetition (IOPS at 64 KiB: same block "
        "size), median [min-max]; fio io_uring O_DIRECT, writes `--end_fsync=1`, 1 job QD 64"
        " / 4 jobs QD 16", "",
        "| op | block | callers | fio MB/s | base / fio | new / fio | new / base | "
        "base core-s/GB | new core-s/GB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for op in ("put", "get"):
        for block in blocks:
            for callers in CALLERS:
                by: dict[str, dict[int, dict[str, Any]]] = {"base": {}, "new": {}, "fio": {}}
                for s in samples:
                    if (s["op"], s["block_bytes"], s["callers"]) == (op, block, callers):
                        by[s["who"]][s["rep"]] = s
                reps = sorted(set(by["base"]) & set(by["new"]) & set(by["fio"]))
                if not reps:
                    continue
                fio_mb = [by["fio"][r]["MB_s"] for r in reps]
                base = [by["base"][r]["MB_s"] / by["fio"][r]["MB_s"] for r in reps]
                new = [by["new"][r]["MB_s"] / by["fio"][r]["MB_s"] for r in reps]
                gain = [by["new"][r]["MB_s"] / by["base"][r]["MB_s"] for r in reps]
                cpu = {w: statistics.median(by[w][r]["cpu_s_per_GB"] for r in reps)
                       for w in ("base", "new")}
                lines.append(
                    f"| {op} | {human(block)} | {callers} | {statistics.median(fio_mb):.0f} | "
                    f"{_fmt(base)} | {_fmt(new)} | {_fmt(gain)} | {cpu['base']:.2f} | "
                    f"{cpu['new']:.2f} |")
    bad = [s for s in samples if s.get("bad")]
    lines += ["", f"blocks missing or different: {sum(s['bad'] for s in bad)}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
