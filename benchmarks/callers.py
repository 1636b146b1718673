"""One caller vs 4 concurrent callers, side by side with fio, with CPU cost and memory.

For each block size, ``reps`` repetitions; in each, in an order that rotates between
repetitions (so slow drifts of a shared disk hit everyone alike):

* ``kvstore``, 1 caller: a fresh store (``kvstore.open`` defaults: ``sync=True``, the
  engine the probe picks, raw codec); one task stores ``n`` blocks as ``put_many``
  batches of ``batch`` blocks, one after another, each chained to the one before; then a
  restart (close and open) and, cold, the same task reads them back with
  ``get_many(keys, out=...)`` batches into buffers it allocated beforehand;
* ``kvstore``, 4 callers: the same ``n`` blocks split into 4 chains, one task each, all
  on one store in one process (an engine's background saves of 4 requests): each task
  issues its own batches one after another;
* ``fio``, 1 job: io_uring, O_DIRECT, ``--iodepth=64`` (kvstore's ``queue_depth``),
  writes with ``--end_fsync=1``, then the file read back;
* ``fio``, 4 jobs: ``--numjobs=4 --iodepth=16``, a file of ``n / 4`` blocks each.  Four
  submitters with the *same total queue depth* (64) as the one io_uring ring that
  kvstore's 4 callers share: the device sees at most as many requests in flight as
  kvstore can give it, so the ratio measures kvstore's pipeline, not a deeper queue
  (``numjobs=4`` at iodepth 64 each would be 256 in flight, more than kvstore ever
  submits).  Each job ``--end_fsync``\\s its own file, as every kvstore batch waits for
  its own fdatasync.

Throughput is wall time from the first call to the last acknowledgement.  At 64 KiB the
ratio to fio is the IOPS ratio (same block size).  A block size whose ``n`` is small
gets smaller batches (``batch = min(32, n / callers)``: 256 MiB of 32 MiB blocks is 8
blocks, 2 per caller); the batch used is recorded.

CPU cost: this process's user + system CPU time (every thread) across the timed calls,
in core-seconds per GB moved; for fio the usr + sys CPU it reports for its jobs (and,
in the JSON, ``getrusage`` of the whole fio process).  Memory: VmRSS before and after
each kvstore measurement and the peak in between (VmHWM, reset first): the peak growth
is mostly the staging arena filling (at most ``staging_bytes``); ``rss_retained`` is
VmRSS after the store is closed minus before it was opened (what a store left behind).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import torch

from benchmarks import fio as fio_mod
from benchmarks.common import (
    Cold,
    CpuMeter,
    human,
    process_cpu_seconds,
    reset_peak_rss,
    rss_bytes,
    syncfs,
)
from benchmarks.systems import Dataset, KvstoreSystem, same_block

CALLERS = (1, 4)
BATCH = 32
FIO_QD = 64  # kvstore's default queue_depth: 1 fio job at 64, 4 jobs at 16 each
KVSTORE = "kvstore"
FIO = "fio"

Log = Callable[[str], None]


@dataclass
class Usage:
    """Wall time, this process's CPU time and resident memory across a ``with`` block."""

    seconds: float = 0.0
    cpu_s: float = 0.0
    rss_before: int = 0
    rss_after: int = 0
    rss_peak: int = 0

    def __enter__(self) -> Usage:
        reset_peak_rss()
        self.rss_before = rss_bytes()["rss"]
        self._cpu0 = process_cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_s = process_cpu_seconds() - self._cpu0
        rss = rss_bytes()
        self.rss_after, self.rss_peak = rss["rss"], max(rss["peak_rss"], rss["rss"])


def blocks_for(volume: int, block: int, callers: int = max(CALLERS)) -> int:
    """Blocks per measurement: ``volume`` worth, a multiple of ``callers``, at least one
    per caller (so the 1- and 4-caller runs move the same bytes)."""
    return max(callers, volume // block // callers * callers)


def ranges(n: int, callers: int) -> list[tuple[int, int]]:
    """``callers`` disjoint, equal slices of ``0..n`` (``n`` a multiple of ``callers``)."""
    per = n // callers
    return [(c * per, (c + 1) * per) for c in range(callers)]


def sample(system: str, callers: int, op: str, block: int, rep: int, n: int,
           batch: int | None, seconds: float, cpu_s: float, **extra: Any) -> dict[str, Any]:
    moved = n * block
    return {"system": system, "callers": callers, "op": op, "block_bytes": block, "rep": rep,
            "blocks": n, "batch": batch, "bytes": moved, "seconds": seconds,
            "MB_s": moved / seconds / 1e6, "blocks_s": n / seconds, "cpu_s": cpu_s,
            "cpu_s_per_GB": cpu_s / (moved / 1e9), **extra}


# --------------------------------------------------------------------------- kvstore


async def put_chain(store: Any, ds: Dataset, lo: int, hi: int, batch: int,
                    latencies: list[float] | None = None) -> int:
    """One caller: blocks ``lo..hi-1`` as ``put_many`` batches, one after another, one
    chain (a request's blocks); how many were written.  ``latencies``: each batch's
    seconds appended."""
    import kvstore

    written, prev = 0, None
    for start in range(lo, hi, batch):
        keys = ds.keys[start:min(start + batch, hi)]
        values = [ds.block(i) for i in range(start, start + len(keys))]
        t0 = time.monotonic()
        res = await store.put_many(keys, values,
                                   parents=kvstore.chain_parents(keys, first_parent=prev))
        if latencies is not None:
            latencies.append(time.monotonic() - t0)
        written += res.written
        prev = keys[-1]
    return int(written)


async def get_chain(store: Any, ds: Dataset, lo: int, hi: int, batch: int,
                    outs: list[torch.Tensor]) -> int:
    """One caller: blocks ``lo..hi-1`` as ``get_many(out=)`` batches into ``outs`` (the
    last batch stays there for :func:`wrong_in_last_batch`); how many were missing."""
    missing = 0
    for start in range(lo, hi, batch):
        keys = ds.keys[start:min(start + batch, hi)]
        got = await store.get_many(keys, out=outs[:len(keys)])
        missing += sum(t is None for t in got)
    return missing


def wrong_in_last_batch(ds: Dataset, lo: int, hi: int, batch: int,
                        outs: list[torch.Tensor], *, lossy: bool = False) -> int:
    """Blocks of the last batch read back that differ from what was put (``same_block``)."""
    last = lo + (hi - lo - 1) // batch * batch
    return sum(not same_block(outs[i - last], ds.block(i), lossy) for i in range(last, hi))


async def concurrently(calls: list[Callable[[], Awaitable[int]]]) -> list[int]:
    """Run the async ``calls`` as concurrent tasks; their results in order."""
    results = [0] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return results


async def measure_kvstore(sysm: KvstoreSystem, ds: Dataset, callers: int, batch: int,
                          rep: int, root: str, cold: Cold) -> list[dict[str, Any]]:
    """Put then cold get of all of ``ds`` by ``callers`` concurrent tasks; two samples."""
    slices = ranges(ds.n, callers)
    outs = [[torch.empty_like(ds.block(0)) for _ in range(batch)] for _ in slices]
    for group in outs:  # fault the pages in now, not inside the timing
        for t in group:
            t.zero_()
    rss_idle = rss_bytes()["rss"]
    await sysm.open(root, ds)
    try:
        syncfs(root)
        with Usage() as put:
            written = await concurrently(
                [partial(put_chain, sysm.store, ds, lo, hi, batch) for lo, hi in slices])
        if sum(written) != ds.n:
            raise RuntimeError(f"{callers} callers wrote {sum(written)} of {ds.n} blocks")
        await sysm.reopen()
        cold(sysm.files())
        with Usage() as get:
            missing = await concurrently(
                [partial(get_chain, sysm.store, ds, lo, hi, batch, o)
                 for (lo, hi), o in zip(slices, outs)])
        wrong = sum(wrong_in_last_batch(ds, lo, hi, batch, o, lossy=sysm.lossy)
                    for (lo, hi), o in zip(slices, outs))
    finally:
        await sysm.close()
    retained = rss_bytes()["rss"] - rss_idle  # left behind once the store is closed
    return [_kvstore_sample(callers, op, ds, rep, batch, u, rss_retained=retained, **extra)
            for op, u, extra in (("put", put, {}), ("get", get, {"bad": sum(missing) + wrong}))]


def _kvstore_sample(callers: int, op: str, ds: Dataset, rep: int, batch: int, u: Usage,
                    **extra: Any) -> dict[str, Any]:
    return sample(KVSTORE, callers, op, ds.block_bytes, rep, ds.n, batch, u.seconds,
                  u.cpu_s, rss_before=u.rss_before, rss_after=u.rss_after,
                  rss_peak=u.rss_peak, **extra)


# --------------------------------------------------------------------------- fio


def measure_fio(fio: str, block: int, n: int, callers: int, rep: int, root: str,
                cold: Cold) -> list[dict[str, Any]]:
    """fio write (``--end_fsync=1``) then O_DIRECT read, ``callers`` jobs; two samples."""
    filename = os.path.join(root, f"fio{callers}-{block}.dat")
    iodepth = FIO_QD // callers
    files = [filename] if callers == 1 else [f"{filename}.{j}" for j in range(callers)]
    out = []
    try:
        for rw, op in (("write", "put"), ("read", "get")):
            if rw == "write":
                syncfs(root)
            else:
                cold(files)
            run = fio_mod.measure_fio(fio, filename, rw, block, n * block, iodepth,
                                      numjobs=callers)
            out.append(sample(FIO, callers, op, block, rep, n, None, run.seconds,
                              run.cpu_s, child_cpu_s=run.child_cpu_s, iodepth=iodepth))
    finally:
        fio_mod.remove(filename, callers)
    return out


# --------------------------------------------------------------------------- the run


async def run_callers(sysm: KvstoreSystem, fio: str | None, block_sizes: list[int],
                      volume: int, reps: int, root: str, cold: Cold, log: Log
                      ) -> dict[str, Any]:
    """Every block size x repetition x {kvstore, fio} x {1, 4 callers}; the JSON part.
    ``sysm``: the kvstore configuration measured (a raw-codec :class:`KvstoreSystem`)."""
    samples: list[dict[str, Any]] = []
    notes: list[str] = []
    rss_start = rss_bytes()["rss"]
    meter, busy = CpuMeter(), []
    runs = [(KVSTORE, c) for c in CALLERS] + ([(FIO, c) for c in CALLERS] if fio else [])
    for bi, block in enumerate(block_sizes):
        n = blocks_for(volume, block)
        ds = Dataset.make(block, n, seed=13)
        for rep in range(reps):
            meter.lap()
            k = (rep + bi) % len(runs)
            for system, callers in runs[k:] + runs[:k]:
                batch = min(BATCH, n // callers)
                try:
                    if system == FIO:
                        assert fio is not None
                        got = measure_fio(fio, block, n, callers, rep, root, cold)
                    else:
                        got = await measure_kvstore(sysm, ds, callers, batch, rep, root, cold)
                except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
                    notes.append(f"callers: {system} x{callers} failed at {human(block)} "
                                 f"(rep {rep + 1}): {e!r}")
                    traceback.print_exc()
                    continue
                samples += got
                notes += [f"callers: {system} x{callers} {human(block)} rep {rep + 1}: "
                          f"{s['bad']} blocks missing or different" for s in got
                          if s.get("bad")]
            busy.append({"part": "callers", "block_bytes": block, "rep": rep, **meter.lap()})
            log(f"[callers {human(block)} rep {rep + 1}/{reps}] MB/s: " + "  ".join(
                f"{s['system']}x{s['callers']}/{s['op']} {s['MB_s']:.0f}" for s in samples
                if (s["block_bytes"], s["rep"]) == (block, rep)) +
                f" (other CPU {busy[-1]['other_cpu_pct']:.0f}%)")
        del ds
    return {"config": {"block_sizes": block_sizes, "volume_bytes": volume, "reps": reps,
                       "batch": BATCH, "callers": list(CALLERS), "fio_total_iodepth": FIO_QD,
                       "kvstore": sysm.describe()},
            "samples": samples, "notes": notes, "other_cpu": busy,
            "rss": {"start": rss_start, "end": rss_bytes()["rss"]}}
