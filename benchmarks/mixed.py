"""Foreground get latency under a saturating background put stream.

One store (``kvstore.open`` defaults, raw codec).  First, untimed, ``fg_batches`` batches
of ``fg_batch`` blocks are stored: what the foreground will read.  Then, per repetition:

1. **idle**: one task reads them back, ``get_many(keys, out=...)`` one batch after
   another, timing each batch;
2. **loaded**: ``writers`` tasks put fresh blocks continuously (``put_many`` batches of
   ``fg_batch`` blocks, durable, new keys so nothing is deduplicated); once every writer
   has had a first batch acknowledged (the stream is running) the foreground reads the
   same batches again, timing each; the writers stop at their next batch boundary after
   the last foreground batch (a flag, not a cancellation: only gets are timed).

kvstore reads with O_DIRECT and has no memory tier, so the second read of a block is as
cold as the first.  The background stream is bounded (``max_bg_bytes`` per repetition);
``stream_ran_throughout`` says whether it was still writing when the foreground finished
(if not, the loaded numbers are partly idle ones).  Reported: p50 / p99 (nearest rank)
per phase, pooled over repetitions, their loaded / idle ratios, and the writers'
throughput while the foreground read.  The design's target is p99 <= 1.5x idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from benchmarks.callers import get_chain, put_chain
from benchmarks.common import CpuMeter, MiB, human, percentile
from benchmarks.data import block_key
from benchmarks.systems import Dataset, KvstoreSystem

Log = Callable[[str], None]
IDLE, LOADED = "idle", "loaded"


@dataclass
class Stream:
    """The background writers' shared state."""

    ds: Dataset  # source bytes; keys are made fresh for every batch
    batch: int
    max_bytes: int
    stop: bool = False
    written: int = 0  # bytes acknowledged
    started: int = 0  # writers with a first batch acknowledged
    running: anyio.Event = field(default_factory=anyio.Event)
    next_key: int = 0

    def take_keys(self) -> list[bytes]:
        lo, self.next_key = self.next_key, self.next_key + self.batch
        return [block_key(7, self.ds.block_bytes, i) for i in range(lo, lo + self.batch)]


async def writer(store: Any, s: Stream, writers: int) -> None:
    """Put fresh batches until told to stop or the byte budget is spent."""
    import kvstore

    first = True
    while not s.stop and s.written < s.max_bytes:
        keys = s.take_keys()
        values = [s.ds.block(i) for i in range(len(keys))]
        res = await store.put_many(keys, values, parents=kvstore.chain_parents(keys))
        s.written += int(res.written) * s.ds.block_bytes
        if first:
            first, s.started = False, s.started + 1
            if s.started == writers:
                s.running.set()


async def timed_gets(store: Any, ds: Dataset, batch: int, outs: list[torch.Tensor]
                     ) -> list[float]:
    """Every foreground batch once, one after another; milliseconds each."""
    times = []
    for lo in range(0, ds.n, batch):
        t0 = time.perf_counter()
        missing = await get_chain(store, ds, lo, lo + batch, batch, outs)
        times.append((time.perf_counter() - t0) * 1e3)
        if missing:
            raise RuntimeError(f"mixed: {missing} foreground blocks missing")
    return times


async def loaded_gets(store: Any, ds: Dataset, batch: int, outs: list[torch.Tensor],
                      stream: Stream, writers: int) -> tuple[list[float], dict[str, Any]]:
    """The foreground batches while ``writers`` tasks stream puts; their latencies and
    what the stream did meanwhile."""
    result: list[float] = []
    info: dict[str, Any] = {}

    async def foreground() -> None:
        await stream.running.wait()
        w0, t0 = stream.written, time.perf_counter()
        result.extend(await timed_gets(store, ds, batch, outs))
        info.update(bg_MB_s=(stream.written - w0) / (time.perf_counter() - t0) / 1e6,
                    stream_ran_throughout=stream.written < stream.max_bytes)
        stream.stop = True

    async with anyio.create_task_group() as tg:
        for _ in range(writers):
            tg.start_soon(writer, store, stream, writers)
        tg.start_soon(foreground)
    info["bg_bytes"] = stream.written
    return result, info


def _latency(ms: list[float]) -> dict[str, Any]:
    return {"batches": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms), "samples_ms": ms}


async def run_mixed(sysm: KvstoreSystem, root: str, block: int, fg_batch: int,
                    fg_batches: int, writers: int, reps: int, max_bg_bytes: int,
                    log: Log) -> dict[str, Any]:
    """The idle and loaded phases, ``reps`` times on one store; the JSON part."""
    ds = Dataset.make(block, fg_batch * fg_batches, seed=5, max_distinct_bytes=64 * MiB)
    outs = [torch.zeros_like(ds.block(0)) for _ in range(fg_batch)]
    phases: dict[str, list[float]] = {IDLE: [], LOADED: []}
    streams: list[dict[str, Any]] = []
    meter, busy = CpuMeter(), []
    await sysm.open(root, ds)
    try:
        await put_chain(sysm.store, ds, 0, ds.n, fg_batch)
        for rep in range(reps):
            meter.lap()
            phases[IDLE] += await timed_gets(sysm.store, ds, fg_batch, outs)
            stream = Stream(ds, fg_batch, max_bg_bytes, next_key=rep << 32)
            ms, info = await loaded_gets(sysm.store, ds, fg_batch, outs, stream, writers)
            phases[LOADED] += ms
            streams.append(info)
            busy.append({"part": "mixed", "block_bytes": block, "rep": rep, **meter.lap()})
            log(f"[mixed rep {rep + 1}/{reps}] get p99 idle {percentile(phases[IDLE], 99):.0f}"
                f" ms, loaded {percentile(phases[LOADED], 99):.0f} ms; background "
                f"{info['bg_MB_s']:.0f} MB/s")
        wrong = sum(not torch.equal(outs[i], ds.block(ds.n - fg_batch + i))
                    for i in range(fg_batch))
    finally:
        await sysm.close()
    idle, loaded = _latency(phases[IDLE]), _latency(phases[LOADED])
    return {"config": {"block_bytes": block, "fg_batch": fg_batch, "fg_batches": fg_batches,
                       "writers": writers, "bg_batch": fg_batch, "reps": reps,
                       "max_bg_bytes": max_bg_bytes, "kvstore": sysm.describe()},
            IDLE: idle, LOADED: loaded, "streams": streams, "bad": wrong, "other_cpu": busy,
            "p50_ratio": loaded["p50_ms"] / idle["p50_ms"],
            "p99_ratio": loaded["p99_ms"] / idle["p99_ms"],
            "title": f"{fg_batch} x {human(block)} gets vs {writers} writers of "
                     f"{fg_batch} x {human(block)} batches"}
