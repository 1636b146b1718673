"""The tiers' measurements in one run: the memory tier against memcpy, an engine-shaped
prefetch loop, and foreground get latency under a saturating put stream with read-first
scheduling on and off (and backpressure dropping whole background batches).

    python benchmarks/tiers.py [--dir DIR] [--reps 3] [--out FILE.md]

1. **memory tier vs memcpy** (2 MiB blocks, batches of 32, 256 MiB): ``get_many(out=)``
   served by the memory tier, against ``torch`` copies of the same bytes between the
   same kind of tensors in this process (what a hit is: one copy); and the cold disk get
   of the same blocks with the tier off and on (on: the first read also fills the tier).
2. **prefetch** (engine-shaped): ``requests`` requests in a row, each needs its own
   prefix (16 x 2 MiB, read cold from disk), then "computes" on the CPU (a worker
   thread spinning for ``compute`` ms, longer than a load) while, with prefetch, the
   next request's prefix is prefetched.  Reported: the time each request waits for its
   blocks, with and without prefetch.
3. **mixed**: the bench's mixed run (``benchmarks/mixed.py``: 24 gets of 8 x 2 MiB, one
   after another, against 2 writers of 8 x 2 MiB durable batches) on a store with
   ``io_scheduling`` off and on, one repetition of each in turn on fresh stores: loaded /
   idle p50 and p99 over the pooled gets, and what the writers wrote meanwhile.  Then a
   backpressure run: the writers put with ``background=True`` and ``backlog_bytes`` = 2
   batches; dropped batches are counted and checked to be wholly absent, written ones
   wholly present.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import anyio  # noqa: E402
import torch  # noqa: E402

import kvstore  # noqa: E402
from benchmarks.common import Cold, machine_info, percentile  # noqa: E402
from benchmarks.mixed import run_mixed  # noqa: E402
from benchmarks.systems import KvstoreSystem  # noqa: E402
from kvstore.testing import parts  # noqa: E402

MIB = 1 << 20
# Gets one after another per repetition: ~0.3 s of reading, longer than the bursts of an
# engine's loads, so that the put stream's flushes fall inside it (with 8 gets, ~0.1 s, a
# scheduler that held flushes back until the gets stopped looked good and was not).
FG_BATCHES = 24
NS = kvstore.Namespace(model="bench-tiers", dtype="uint8", block_size=1)


class ScheduledKvstore(KvstoreSystem):
    """The bench's kvstore system with ``io_scheduling`` chosen."""

    def __init__(self, scheduling: bool) -> None:
        super().__init__("auto", "raw")
        self.scheduling = scheduling
        self.name = f"kvstore scheduling {'on' if scheduling else 'off'}"

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), "io_scheduling": self.scheduling}


def blocks(n: int, size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


async def memory_vs_memcpy(root: str, reps: int, cold: Cold) -> dict[str, Any]:
    n, batch, size = 128, 32, 2 * MIB
    values = blocks(n, size, 1)
    keys = NS.chain_keys(list(range(n)))
    outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(batch)]
    rows: dict[str, list[float]] = {"memory tier get": [], "memcpy (torch copy_)": [],
                                    "disk get, tier off": [], "disk get, tier on (fills)": []}
    for _ in range(reps):
        path = tempfile.mkdtemp(dir=root)
        async with kvstore.open(path, namespace=NS, create=True, memory_bytes=320 * MIB) as s:
            for i in range(0, n, batch):
                await s.put_many(keys[i:i + batch], values[i:i + batch])
            t = time.perf_counter()
            for i in range(0, n, batch):
                got = await s.get_many(keys[i:i + batch], out=outs)
                assert all(g is not None for g in got)
            rows["memory tier get"].append(n * size / (time.perf_counter() - t) / 1e9)
            assert s.stats().memory_hits == n, s.stats().memory_hits
        t = time.perf_counter()
        for i in range(0, n, batch):
            for o, v in zip(outs, values[i:i + batch]):
                o.copy_(v)
        rows["memcpy (torch copy_)"].append(n * size / (time.perf_counter() - t) / 1e9)
        for label, memory in (("disk get, tier off", 0), ("disk get, tier on (fills)",
                                                          320 * MIB)):
            cold([])
            async with kvstore.open(path, namespace=NS, memory_bytes=memory) as s:
                t = time.perf_counter()
                for i in range(0, n, batch):  # into new tensors: the tier fills from them
                    got = await s.get_many(keys[i:i + batch])
                    assert all(g is not None for g in got)
                rows[label].append(n * size / (time.perf_counter() - t) / 1e9)
    return {name: {"GB_s": v, "median": statistics.median(v)} for name, v in rows.items()}


# Into new tensors each load pays their allocation and page faults (32 MiB: ~10 ms
# here, as much as the copy from the memory tier); into the engine's own memory (out=)
# only the copy remains.
PREFETCH_MODES = ("without prefetch", "with prefetch", "without prefetch, into out=",
                  "with prefetch, into out=")


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


async def prefetch_loop(root: str, requests: int, compute_ms: float) -> dict[str, Any]:
    per, size = 16, 2 * MIB
    values = blocks(per, size, 2)
    prefixes = [NS.chain_keys(list(range(10_000 * r, 10_000 * r + per)))
                for r in range(requests)]
    path = tempfile.mkdtemp(dir=root)
    async with kvstore.open(path, namespace=NS, create=True) as s:
        for keys in prefixes:
            await s.put_many(keys, values)
    out: dict[str, Any] = {}
    # What an engine loads into: its own KV memory, allocated once (vLLM's paged blocks).
    engine_kv = [torch.empty_like(v) for v in values]
    for mode in PREFETCH_MODES:
        prefetching = mode.startswith("with prefetch")
        into = engine_kv if mode.endswith("out=") else None
        # a fresh open: the tier is empty, reads are cold (O_DIRECT)
        async with kvstore.open(path, namespace=NS, memory_bytes=per * size * 3) as s:
            waits = []
            handle = s.prefetch(prefixes[0]) if prefetching else None
            for r in range(requests):
                t = time.perf_counter()
                got = await s.get_many(prefixes[r], out=into)
                waits.append((time.perf_counter() - t) * 1e3)
                assert all(g is not None for g in got)
                parts(s).memory.discard(prefixes[r])  # type: ignore[union-attr]  # used: make room
                if prefetching and r + 1 < requests:
                    handle = s.prefetch(prefixes[r + 1])
                await anyio.to_thread.run_sync(spin, compute_ms)
            if handle is not None:
                await handle
            out[mode] = {"wait_ms": waits, "median_ms": statistics.median(waits),
                         "max_ms": max(waits)}
    return {"requests": requests, "prefix": f"{per} x 2 MiB", "compute_ms": compute_ms, **out}


async def mixed_on_off(root: str, reps: int) -> dict[str, Any]:
    """The mixed run with scheduling off and on, one repetition of each in turn (which
    goes first alternates), each on a fresh store: this disk's speed drifts over minutes,
    and two back-to-back blocks of repetitions compared one period with another."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for rep in range(reps):
        for scheduling in ((False, True) if rep % 2 == 0 else (True, False)):
            where = tempfile.mkdtemp(dir=root)  # each store written ~1 GB: removed after
            try:
                runs["on" if scheduling else "off"].append(await run_mixed(
                    ScheduledKvstore(scheduling), where, 2 * MIB, fg_batch=8,
                    fg_batches=FG_BATCHES, writers=2, reps=1, max_bg_bytes=2 << 30,
                    log=lambda m: None))
            finally:
                shutil.rmtree(where, ignore_errors=True)
    out = {}
    for mode, results in runs.items():
        idle = [ms for r in results for ms in r["idle"]["samples_ms"]]
        loaded = [ms for r in results for ms in r["loaded"]["samples_ms"]]
        streams = [st for r in results for st in r["streams"]]
        out[mode] = {"idle_p99_ms": percentile(idle, 99), "loaded_p99_ms": percentile(loaded, 99),
                     "p99_ratio": percentile(loaded, 99) / percentile(idle, 99),
                     "p50_ratio": percentile(loaded, 50) / percentile(idle, 50),
                     "samples": len(loaded), "streams": streams,
                     "bad": sum(r["bad"] for r in results),
                     "bg_MB_s": statistics.median(st["bg_MB_s"] for st in streams)}
    return out


async def backpressure(root: str) -> dict[str, Any]:
    size, batch, writers, rounds = 2 * MIB, 8, 4, 6
    values = blocks(batch, size, 3)
    path = tempfile.mkdtemp(dir=root)
    outcome: list[tuple[list[bytes], int]] = []
    async with kvstore.open(path, namespace=NS, create=True,
                            backlog_bytes=2 * batch * size) as s:
        async def writer(w: int) -> None:
            for r in range(rounds):
                keys = NS.chain_keys(list(range(100_000 * w + 100 * r, 100_000 * w + 100 * r
                                                + batch)))
                res = await s.put_many(keys, values, background=True)
                outcome.append((keys, res.dropped))

        async with anyio.create_task_group() as tg:
            for w in range(writers):
                tg.start_soon(writer, w)
        partial = 0
        for keys, dropped in outcome:
            present = sum(await s.contains_many(keys))
            partial += present not in ((0,) if dropped else (batch,))
        st = s.stats()
    return {"batches": len(outcome), "dropped_batches": st.dropped_puts,
            "dropped_blocks": st.dropped_blocks, "partial_batches": partial,
            "backlog_bytes": 2 * batch * size}


def render(doc: dict[str, Any]) -> str:
    m, p, x, b = doc["memory"], doc["prefetch"], doc["mixed"], doc["backpressure"]
    mem, cp = m["memory tier get"]["median"], m["memcpy (torch copy_)"]["median"]
    lines = ["# Tiers, prefetch, scheduling (benchmarks/tiers.py)", "",
             f"`{doc['command']}`, {doc['seconds']:.0f} s; {doc['machine']}", "",
             "## Memory tier vs memcpy (2 MiB blocks, batches of 32, 256 MiB)", "",
             "| path | GB/s median [min-max] |", "|---|---:|"]
    for name, row in m.items():
        lines.append(f"| {name} | **{row['median']:.2f}** [{min(row['GB_s']):.2f}-"
                     f"{max(row['GB_s']):.2f}] |")
    off, on = m["disk get, tier off"]["median"], m["disk get, tier on (fills)"]["median"]
    lines += ["", f"- memory tier get / memcpy: **{mem / cp:.2f}** (target >= 0.5)",
              f"- cold disk get, tier on (filling) / tier off: **{on / off:.2f}**", "",
              f"## Prefetch: {p['requests']} requests, prefix {p['prefix']}, compute "
              f"{p['compute_ms']:.0f} ms each", "",
              "| mode | wait for blocks, median ms | max ms |", "|---|---:|---:|"]
    for mode in PREFETCH_MODES:
        lines.append(f"| {mode} | **{p[mode]['median_ms']:.1f}** | {p[mode]['max_ms']:.1f} |")
    lines += ["", f"## Foreground get latency under a put stream ({FG_BATCHES} gets of 8 x "
              "2 MiB one after another vs 2 writers of 8 x 2 MiB durable batches)",
              "", "| io_scheduling | gets | idle p99 ms | loaded p99 ms | p99 loaded/idle | "
              "p50 loaded/idle | writers MB/s while the gets ran (median) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for k in ("off", "on"):
        r = x[k]
        lines.append(f"| {k} | {r['samples']} | {r['idle_p99_ms']:.1f} | "
                     f"{r['loaded_p99_ms']:.1f} | **{r['p99_ratio']:.2f}** | "
                     f"{r['p50_ratio']:.2f} | {r['bg_MB_s']:.0f} |")
    lines += ["", f"Backpressure: {b['batches']} background batches of 8 x 2 MiB from 4 "
              f"writers, backlog_bytes {b['backlog_bytes'] >> 20} MiB: {b['dropped_batches']} "
              f"dropped ({b['dropped_blocks']} blocks), partially stored batches: "
              f"**{b['partial_batches']}**."]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="tiers-", dir=args.dir)
    try:  # the stores written here add up to several GB: never left behind
        return await measure(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def measure(root: str, args: argparse.Namespace) -> dict[str, Any]:
    cold = Cold("fadvise", root)
    t0 = time.perf_counter()
    doc: dict[str, Any] = {"command": " ".join(["python benchmarks/tiers.py", *sys.argv[1:]])}
    doc["memory"] = await memory_vs_memcpy(root, args.reps, cold)
    doc["prefetch"] = await prefetch_loop(root, requests=8, compute_ms=args.compute_ms)
    doc["mixed"] = await mixed_on_off(root, args.reps)
    doc["backpressure"] = await backpressure(root)
    info = machine_info(root)
    doc["machine"] = (f"{info['nproc']} CPUs ({info['cpu']}), kernel {info['kernel']}, "
                      f"load {os.getloadavg()[0]:.2f}")
    doc["seconds"] = time.perf_counter() - t0
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compute-ms", type=float, default=300.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.dir is None:
        args.dir = os.path.join(HERE, ".bench-tmp")
        os.makedirs(args.dir, exist_ok=True)
    doc = anyio.run(main_async, args)
    text = render(doc)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
