"""What a read mark costs (``PATH/owners/marks``, kvstore/io/marks.py and
kvstore/_native/marks.c; issue 43).

    python benchmarks/marks_cost.py [--dir /dev/shm] [--rounds 21] [--calls 200000]
                                    [--out-dir benchmarks/results]

A disk read of a shared store publishes its mark before its lookup and withdraws it
after its copy (two publishes: a store and a full fence each, through ctypes); a
ripener takes the minimum over every slot (a fence and 1024 loads) once per write
transaction; the mark itself is the newest LMDB snapshot id, read from the
environment's meta page (``env.info()``).  Each is timed as the Python call an owner
makes, ``--calls`` calls per round, the modes interleaved round by round (order
reversed every other round so that drift favours none); reported: the median and the
p10 over rounds of the nanoseconds per call.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import lmdb  # noqa: E402

from benchmarks.common import head_commit, machine_info, write_results  # noqa: E402
from kvstore.io.marks import MarksFile, native  # noqa: E402


def _time(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        call()
    return (time.perf_counter_ns() - start) / calls


def measure(root: str, rounds: int, calls: int) -> dict[str, Any]:
    os.makedirs(os.path.join(root, "owners"))
    marks = MarksFile.open(root)
    env = lmdb.open(os.path.join(root, "index"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    modes: dict[str, Callable[[], Any]] = {
        "publish (store + fence)": lambda: marks.publish(1, 12345),
        "minimum of 1024 slots (fence + loads)": marks.minimum,
        "newest snapshot id (env.info)": lambda: env.info()["last_txnid"],
        "empty Python call (baseline)": lambda: None,
    }
    runs: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for r in range(rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for name in order:
                runs[name].append(_time(modes[name], calls))
    finally:
        marks.close()
        env.close()
    info = machine_info(root)
    return {
        "command": " ".join(["python benchmarks/marks_cost.py", *sys.argv[1:]]),
        "commit": head_commit(HERE), "rounds": rounds, "calls": calls,
        "machine": f"{info['nproc']} CPUs ({info['cpu']}), kernel {info['kernel']}, "
                   f"load {info['loadavg_start']}",
        "ns_per_call": {name: {"median": statistics.median(v),
                               "p10": sorted(v)[len(v) // 10]} for name, v in runs.items()},
    }


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"# What a read mark costs, at {doc['commit']}",
        "",
        f"`{doc['command']}` — {doc['machine']}.",
        "",
        f"{doc['rounds']} rounds of {doc['calls']} calls per mode, interleaved; "
        "nanoseconds per Python call (ctypes into kvstore/_native/marks.c).",
        "",
        "| call | median ns | p10 ns |",
        "|---|---:|---:|",
    ]
    for name, v in doc["ns_per_call"].items():
        lines.append(f"| {name} | {v['median']:.0f} | {v['p10']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dir", default=None, help="scratch directory (default: /dev/shm or /tmp)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--out-dir", default=None, help="write marks_cost_at_<commit>.md/.json")
    args = p.parse_args(argv)
    ok, why = native()
    if not ok:
        print(f"the native marks helper is not loaded: {why}", file=sys.stderr)
        return 1
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="marks-cost-", dir=base)
    try:
        doc = measure(root, args.rounds, args.calls)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = render(doc)
    print(text)
    if args.out_dir:
        write_results(os.path.join(args.out_dir, f"marks_cost_at_{doc['commit']}"), text, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
