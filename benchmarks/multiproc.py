"""Several processes on one store (issue 43): aggregate throughput and visibility latency.

``python -m benchmarks.multiproc [--processes 1,2,4] [--block-kib 1024] [--volume 512M]
[--reps 3] [--out DIR]``

**Throughput.**  For each process count ``P``, in an order that rotates between
repetitions, in one run:

* ``kvstore P processes``: ``P`` processes open one fresh store directory (the defaults:
  ``sync=True``, the engine the probe picks), each waits until all are open, then stores
  ``n / P`` blocks of its own as ``put_many`` batches of 32, one after another, one chain.
  Then every process closes; ``P`` new ones open the store again and, cold (reads are
  O_DIRECT), read their blocks back with ``get_many(out=)``.  Time is the first process's
  start to the last one's last acknowledgement (CLOCK_MONOTONIC, one clock for all).
* ``kvstore P stores`` (``P`` > 1): the same, but each process opens a store of its own
  (``PATH/rankI``): TP ranks with one store per rank, against one store shared by the
  ranks (issue 43: which should TP ranks use?).  Both record each ``put_many``'s latency
  (p50/p99 over every batch of every process: a TP step waits for its slowest rank).
* ``kvstore 1 process, P callers``: the same blocks, ``P`` tasks on one store in one
  process (:mod:`benchmarks.callers`' shape).
* ``fio P jobs``: io_uring, O_DIRECT, ``--numjobs=P``, writes with ``--end_fsync=1`` per
  job into fresh files, then read back; twice: ``--iodepth=64/P`` (the total queue depth
  of one kvstore process, which its ``P`` callers share) and ``--iodepth=64`` per job (as
  ``P`` kvstore processes have a ring of 64 each).

Every kvstore get is checked (the last batch of every process, bit-exact).

**Visibility.**  Process A puts one block at a time; process B, on its own event loop,
looks the key up with ``contains_many`` until it is a hit.  The latency is B's first hit
minus A's acknowledgement (``put_many`` returned), both CLOCK_MONOTONIC; negative when B
saw the commit before A's call returned.  Two modes: B spinning, and B looking once per
millisecond (an engine scheduler's step).  p50/p99 over ``--visibility-n`` blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch

from benchmarks import fio as fio_mod
from benchmarks.callers import concurrently, get_chain, put_chain, ranges
from benchmarks.common import (
    head_commit,
    human,
    in_scratch,
    loadavg,
    machine_info,
    parse_size,
    percentile,
    scratch_dir,
    summary,
    syncfs,
    write_results,
)
from benchmarks.data import block_key
from benchmarks.systems import Dataset, same_block

REPO = str(Path(__file__).resolve().parent.parent)
BATCH = 32
VIS_BLOCK = 64 << 10  # the smallest block benchmarks.data makes
QD = 64  # kvstore's default queue_depth, per process (one ring each)


# --------------------------------------------------------------------------- workers


def worker_main(argv: Sequence[str]) -> None:
    """``--worker put|get|watch|ack PATH BLOCK N LO HI [PACE_MS]``: one process's part;
    prints ``ready`` once open, waits for a line on stdin, runs, prints JSON."""
    op, path, block, n, lo, hi, *rest = argv
    ds = Dataset.make(int(block), int(n), seed=13)
    anyio.run(_worker, op, path, ds, int(lo), int(hi), float(rest[0]) if rest else 0.0)


async def _worker(op: str, path: str, ds: Dataset, lo: int, hi: int, pace_ms: float) -> None:
    import kvstore

    async with kvstore.open(path, sync=True) as store:
        outs = [torch.empty_like(ds.block(0)).zero_() for _ in range(BATCH)]
        if op == "put":  # an extent to write into, made outside the timing (as the
            # single-process benchmarks do): a small block of this process's own
            await store.put(block_key(os.getpid(), 0, -1), torch.zeros(16, dtype=torch.uint8))
        print("ready", flush=True)
        sys.stdin.readline()
        result: dict[str, Any] = {}
        if op == "put":
            t0, latencies = time.monotonic(), list[float]()
            result["written"] = await put_chain(store, ds, lo, hi, BATCH, latencies)
            result.update(start=t0, end=time.monotonic(), latencies=latencies)
        elif op == "get":
            t0 = time.monotonic()
            result["missing"] = await get_chain(store, ds, lo, hi, BATCH, outs)
            result.update(start=t0, end=time.monotonic())
            last = lo + (hi - lo - 1) // BATCH * BATCH
            result["wrong"] = sum(not same_block(outs[i - last], ds.block(i), False)
                                  for i in range(last, hi))
        elif op == "ack":  # visibility, A: one block per line read
            acks = []
            for i in range(lo, hi):
                await store.put_many([ds.keys[i]], [ds.block(i)])
                acks.append(time.monotonic())
                print(json.dumps({"acked": i}), flush=True)
                sys.stdin.readline()  # B saw it
            result["acks"] = acks
        else:  # "watch", visibility, B
            hits = []
            for i in range(lo, hi):
                while not (await store.contains_many([ds.keys[i]]))[0]:
                    if pace_ms:
                        await anyio.sleep(pace_ms / 1000)
                    else:
                        await anyio.lowlevel.checkpoint()
                hits.append(time.monotonic())
                print(json.dumps({"hit": i}), flush=True)
            result["hits"] = hits
    print(json.dumps(result), flush=True)


class Worker:
    def __init__(self, *args: object) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.multiproc", "--worker", *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        line = self.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"a worker did not open the store: {line!r}")

    def go(self) -> None:
        self.stdin.write("\n")
        self.stdin.flush()

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.stdout.readlines()[-1])
        if self.proc.wait() != 0:
            raise RuntimeError(f"a worker failed: exit code {self.proc.returncode}")
        return out


def in_processes(op: str, path: str, ds: Dataset, procs: int, *, separate: bool = False
                 ) -> dict[str, Any]:
    """``op`` over all of ``ds`` by ``procs`` processes started together; one sample.
    ``separate``: each process has a store of its own (``PATH/rankI``), as TP ranks
    with one store per rank."""
    workers = [Worker(op, os.path.join(path, f"rank{i}") if separate else path,
                      ds.block_bytes, ds.n, lo, hi)
               for i, (lo, hi) in enumerate(ranges(ds.n, procs))]  # opened: timing after
    for w in workers:
        w.go()
    results = [w.result() for w in workers]
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    bad = sum(r.get("missing", 0) + r.get("wrong", 0) for r in results)
    latencies = [t for r in results for t in r.get("latencies", [])]
    if op == "put" and sum(r["written"] for r in results) != ds.n:
        raise RuntimeError(f"{procs} processes wrote {sum(r['written'] for r in results)} "
                           f"of {ds.n} blocks")
    return {"seconds": seconds, "bad": bad, **({"batch_ms": {
        "p50": percentile(latencies, 50) * 1e3, "p99": percentile(latencies, 99) * 1e3}}
        if latencies else {})}


async def one_process(path: str, ds: Dataset, callers: int) -> dict[str, dict[str, Any]]:
    import kvstore

    slices = ranges(ds.n, callers)
    outs = [[torch.empty_like(ds.block(0)).zero_() for _ in range(BATCH)] for _ in slices]
    async with kvstore.open(path, sync=True) as store:
        await store.put(block_key(os.getpid(), 0, -1), torch.zeros(16, dtype=torch.uint8))
        t0 = time.monotonic()
        await concurrently([partial(put_chain, store, ds, lo, hi, BATCH) for lo, hi in slices])
        put_s = time.monotonic() - t0
    async with kvstore.open(path, sync=True) as store:
        t0 = time.monotonic()
        missing = await concurrently(
            [partial(get_chain, store, ds, lo, hi, BATCH, o) for (lo, hi), o in zip(slices, outs)])
        get_s = time.monotonic() - t0
    return {"put": {"seconds": put_s, "bad": 0}, "get": {"seconds": get_s, "bad": sum(missing)}}


# --------------------------------------------------------------------------- the run


def throughput(root: str, procs_list: list[int], block: int, volume: int, reps: int,
               fio: str | None, log: Any) -> list[dict[str, Any]]:
    n = max(max(procs_list), volume // block // max(procs_list) * max(procs_list))
    ds = Dataset.make(block, n, seed=13)
    samples: list[dict[str, Any]] = []
    runs = [(system, p) for p in procs_list
            for system in ("kvstore processes", "kvstore stores", "kvstore callers", "fio",
                           "fio qd64")
            if (fio or not system.startswith("fio")) and (p > 1 or system != "kvstore stores")]
    for rep in range(reps):
        k = rep % len(runs)
        for system, procs in runs[k:] + runs[:k]:
            path = os.path.join(root, f"s{rep}-{procs}-{system.replace(' ', '_')}")
            syncfs(root)
            got: dict[str, dict[str, Any]]
            if system in ("kvstore processes", "kvstore stores"):
                separate = system == "kvstore stores"
                got = {op: in_processes(op, path, ds, procs, separate=separate)
                       for op in ("put", "get")}
            elif system == "kvstore callers":
                got = anyio.run(one_process, path, ds, procs)
            else:
                assert fio is not None
                qd = QD if system == "fio qd64" or procs == 1 else QD // procs
                if system == "fio qd64" and procs == 1:
                    continue  # the same as "fio" at one job
                os.makedirs(path)
                filename = os.path.join(path, "fio.dat")
                got = {}
                for rw, op in (("write", "put"), ("read", "get")):
                    run = fio_mod.measure_fio(fio, filename, rw, block, n * block, qd,
                                              numjobs=procs)
                    got[op] = {"seconds": run.seconds, "bad": 0, "iodepth": qd}
                fio_mod.remove(filename, procs)
            for op, r in got.items():
                samples.append({"system": system, "processes": procs, "op": op, "rep": rep,
                                "block_bytes": block, "blocks": n,
                                "GB_s": n * block / r["seconds"] / 1e9, **r})
                log(f"rep {rep + 1} {system:18s} x{procs} {op}: "
                    f"{n * block / r['seconds'] / 1e9:.2f} GB/s (bad {r['bad']})")
            shutil.rmtree(path, ignore_errors=True)
    return samples


def visibility(root: str, n: int, pace_ms: float) -> list[float]:
    """Microseconds from A's ack to B's first hit, per block."""
    path = os.path.join(root, f"vis-{pace_ms}")
    a = Worker("ack", path, VIS_BLOCK, n, 0, n)
    b = Worker("watch", path, VIS_BLOCK, n, 0, n, pace_ms)
    a.go()
    b.go()
    for _ in range(n):  # A's next put waits until B saw this one
        json.loads(a.stdout.readline())
        json.loads(b.stdout.readline())
        a.go()
    acks, hits = a.result()["acks"], b.result()["hits"]
    return [(h - t) * 1e6 for t, h in zip(acks, hits)]


def report(doc: dict[str, Any]) -> str:
    lines = [f"# Several processes on one store, at {doc['commit']}", "",
             f"Load average at start: {doc['loadavg']}; block {human(doc['block_bytes'])}, "
             f"{doc['reps']} repetitions (min / median / max of GB/s).", "",
             "| processes | op | kvstore P processes, one store | kvstore P processes, a "
             "store each | kvstore 1 process P callers | fio P jobs (qd 64/P) | "
             "fio P jobs (qd 64 each) | one store / fio | one store / a store each |",
             "|---|---|---|---|---|---|---|---|---|"]

    def col(system: str, procs: int, op: str) -> tuple[str, float]:
        v = [s["GB_s"] for s in doc["samples"]
             if s["system"] == system and s["processes"] == procs and s["op"] == op]
        if not v:
            return "-", 0.0
        s = summary(v)
        return f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}", s["median"]

    for procs in doc["processes"]:
        for op in ("put", "get"):
            kp, kpm = col("kvstore processes", procs, op)
            ks, ksm = col("kvstore stores", procs, op)
            kc, _ = col("kvstore callers", procs, op)
            f1, f1m = col("fio", procs, op)
            f2, _ = col("fio qd64", procs, op)
            ratio = f"{kpm / f1m:.2f}x" if f1m else "-"
            shared = f"{kpm / ksm:.2f}x" if ksm else "-"
            lines.append(f"| {procs} | {op} | {kp} | {ks} | {kc} | {f1} | {f2} | {ratio} "
                         f"| {shared} |")
    lines += ["", "Latency of one `put_many` (32 blocks), ms, p50 / p99 over every batch of "
              "every process, median of the repetitions' values:", ""]
    for procs in doc["processes"]:
        for system, name in (("kvstore processes", "one store"),
                             ("kvstore stores", "a store each")):
            got = [s["batch_ms"] for s in doc["samples"] if s["system"] == system
                   and s["processes"] == procs and s["op"] == "put" and "batch_ms" in s]
            if got:
                p50 = summary([g["p50"] for g in got])["median"]
                p99 = summary([g["p99"] for g in got])["median"]
                lines.append(f"- {procs} processes, {name}: {p50:.1f} / {p99:.1f}")
    lines += ["", "Visibility: microseconds from A's acknowledgement to B's first hit "
              "(p50 / p99 / max)", ""]
    for mode, v in doc["visibility"].items():
        lines.append(f"- B {mode}: {percentile(v, 50):.0f} / {percentile(v, 99):.0f} / "
                     f"{max(v):.0f} us ({len(v)} blocks)")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        worker_main(argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", default="1,2,4")
    p.add_argument("--block-kib", type=int, default=1024)
    p.add_argument("--volume", default="512M")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--visibility-n", type=int, default=300)
    p.add_argument("--dir", default=None, help="where stores are made (default .bench-tmp)")
    p.add_argument("--out", default=None, help="write DIR/multiproc_at_<commit>.{md,json}")
    args = p.parse_args(argv)
    procs = [int(x) for x in args.processes.split(",")]
    fio = fio_mod.find_fio()
    commit = head_commit(REPO)
    directory = scratch_dir(args.dir, REPO)

    async def run(root: str) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "commit": commit, "loadavg": loadavg(), "machine": machine_info(root),
            "block_bytes": args.block_kib * 1024, "reps": args.reps, "processes": procs}
        doc["samples"] = await anyio.to_thread.run_sync(
            throughput, root, procs, args.block_kib * 1024, parse_size(args.volume),
            args.reps, fio, print)
        doc["visibility"] = {
            mode: await anyio.to_thread.run_sync(visibility, root, args.visibility_n, pace)
            for mode, pace in (("spinning", 0.0), ("every 1 ms", 1.0))}
        return doc

    doc = anyio.run(in_scratch, "multiproc-", directory, run)
    text = report(doc)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_results(os.path.join(args.out, f"multiproc_at_{commit}"), text, doc)


if __name__ == "__main__":
    main()
