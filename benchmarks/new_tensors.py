"""Gets into new tensors (no ``out=``) with the result-buffer pool off and on, against
the same gets into tensors allocated once (``out=``), in one run and one store.

    python benchmarks/new_tensors.py [--dir DIR] [--blocks 96] [--block-mib 2]
                                     [--reps 6] [--out FILE.md]

Two reads of the same blocks: memory-tier hits (one copy per block: where the cost of
fresh memory shows most) and cold disk gets (page cache dropped, O_DIRECT reads).  Each
repetition runs the three kinds in a rotating order; a kind's results are dropped
before the next starts, as an engine drops a load's CPU tensors once it copied them on.
Reported: MB/s and this process's CPU seconds per GiB read, min / median / max, and
the pool's ratios to ``out=`` and to the pool off.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import anyio  # noqa: E402
import torch  # noqa: E402

import kvstore  # noqa: E402
from benchmarks.common import Cold, machine_info, summary, timed  # noqa: E402
from kvstore.codecs import result_buffers  # noqa: E402

NS = kvstore.Namespace(model="bench-new-tensors", dtype="uint8", block_size=1)
KINDS = ("out=", "new, pool off", "new, pool on")


async def measure(root: str, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    n, size = args.blocks, int(args.block_mib * (1 << 20))
    g = torch.Generator().manual_seed(0)
    values = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]
    keys = NS.chain_keys(list(range(n)))
    outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
    cold = Cold("auto", root)
    rows: dict[str, dict[str, list[float]]] = {
        f"{where}: {kind}": {"mbs": [], "cpu": []}
        for where in ("memory tier", "disk, cold") for kind in KINDS}
    configured = result_buffers._pool.max_bytes
    try:
        for where in ("memory tier", "disk, cold"):
            memory = n * size + (64 << 20) if where == "memory tier" else 0
            path = os.path.join(root, where.split(",")[0].replace(" ", "-"))
            async with kvstore.open(path, namespace=NS, extent_bytes=512 << 20,
                                    memory_bytes=memory) as store:
                await store.put_many(keys, values, parents=kvstore.chain_parents(keys))
                if memory:  # the puts filled the tier; check every block is there
                    assert store.stats().memory_blocks == n
                for rep in range(args.reps):
                    order = KINDS[rep % 3:] + KINDS[:rep % 3]
                    for kind in order:
                        result_buffers.configure(0 if kind == "new, pool off"
                                                 else max(configured, n * size))
                        if not memory:
                            cold([])
                        with timed() as took:
                            got = await store.get_many(keys, out=outs if kind == "out=" else None)
                        assert all(torch.equal(a, b) for a, b in zip(got, values))
                        del got
                        wall, cpu = took()
                        row = rows[f"{where}: {kind}"]
                        row["mbs"].append(n * size / wall / 1e6)
                        row["cpu"].append(cpu / (n * size / 2**30))
    finally:
        result_buffers.configure(configured)
    return rows


def report(rows: dict[str, dict[str, list[float]]], args: argparse.Namespace, root: str
           ) -> list[str]:
    info = machine_info(root)
    lines = [f"# Gets into new tensors: result-buffer pool off / on, against out= "
             f"({args.blocks} blocks of {args.block_mib:g} MiB, {args.reps} repetitions)", "",
             f"Machine: {info.get('cpu', '?')}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}; {info['fs_type']} on {info['fs_device']}; kvstore "
             f"{info['kvstore_source']}; load {info['loadavg_start']}.",
             f"Command: `python benchmarks/new_tensors.py --blocks {args.blocks} --block-mib "
             f"{args.block_mib:g} --reps {args.reps}`, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
             "| read | MB/s min / median / max | CPU core-s/GiB min / median / max |",
             "|---|---|---|"]
    for name, row in rows.items():
        m, c = summary(row["mbs"]), summary(row["cpu"])
        lines.append(f"| {name} | {m['min']:.0f} / {m['median']:.0f} / {m['max']:.0f} | "
                     f"{c['min']:.2f} / {c['median']:.2f} / {c['max']:.2f} |")
    lines.append("")
    for where in ("memory tier", "disk, cold"):
        on, off, out = (rows[f"{where}: {k}"] for k in ("new, pool on", "new, pool off", "out="))
        ratio_off = [a / b for a, b in zip(on["mbs"], off["mbs"])]
        ratio_out = [a / b for a, b in zip(on["mbs"], out["mbs"])]
        cpu_off = [a / b for a, b in zip(on["cpu"], off["cpu"])]
        lines.append(f"- {where}: pool on / off throughput "
                     f"{_spread(ratio_off)}, CPU {_spread(cpu_off)}; pool on / out= "
                     f"throughput {_spread(ratio_out)} (min / median / max of the per-"
                     f"repetition ratios)")
    lines.append("\nThe first repetition with the pool on fills it (new slabs); later ones "
                 "reuse them.  'out=' = into tensors allocated once and written before.")
    return lines


def _spread(ratios: list[float]) -> str:
    s = summary(ratios)
    return f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvstore-new-tensors-", dir=args.dir)
    try:
        t = time.perf_counter()
        rows = anyio.run(measure, root, args)
        lines = report(rows, args, root)
        lines.append(f"\n({time.perf_counter() - t:.0f} s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
