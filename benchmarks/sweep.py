"""The timed runs: throughput sweep, the store run beyond the dirty limit, batch latency.

Sweep.  For each block size, ``reps`` repetitions; in each, every system (and fio) stores
the same ``volume`` of blocks into a fresh directory, then reads them back cold; the
order of systems rotates between repetitions so that slow drifts of a shared disk hit
everyone alike.  Before every timed store the file system is synced (untimed); before
every timed read the page cache is emptied (:class:`benchmarks.common.Cold`); what was
read is checked against what was stored, outside the timing.  Throughput is counted in
input bytes (the bf16 bytes the caller hands over or gets back), so FP8 gains what it
saves.

Beyond the dirty limit.  The sweep's volume fits in the page cache's dirty limit, so a
peer's writes land in memory and its final sync does all the device work.  One extra
store run at 2 MiB writes more than the kernel's ``nr_dirty_threshold`` (writers are
throttled and write back while they write, the steady state of a busy server) for
kvstore, the peers and fio.

Latency.  A realistic engine batch (32 blocks of 2 MiB by default): the systems take
turns batch by batch (so drifts hit all), each store durable per batch (kvstore:
``put_many``; peers: writes + ``syncfs``), then after a restart and an empty page cache
each batch is read back; per-batch p50/p99/max.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks import fio as fio_mod
from benchmarks.common import Cold, CpuMeter, dirty_limit_bytes, human, percentile, syncfs
from benchmarks.systems import Dataset, System

FIO = "fio"
FIO_BUFFERED = "fio buffered"  # reads through the page cache: a reference, not the limit


@dataclass
class Results:
    samples: list[dict[str, Any]] = field(default_factory=list)
    big: list[dict[str, Any]] = field(default_factory=list)
    latency: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    other_cpu: list[dict[str, Any]] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)


Log = Callable[[str], None]


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sample(system: str, op: str, block: int, rep: int, n: int, seconds: float,
            **extra: Any) -> dict[str, Any]:
    return {"system": system, "op": op, "block_bytes": block, "rep": rep, "blocks": n,
            "bytes": n * block, "seconds": seconds, "MB_s": n * block / seconds / 1e6,
            "blocks_s": n / seconds, **extra}


async def _measure_system(res: Results, sysm: System, ds: Dataset, rep: int, root: str,
                          cold: Cold) -> None:
    n = ds.n
    try:
        await sysm.open(root, ds)
        syncfs(root)
        t_put = await sysm.put(0, n)
        res.samples.append(_sample(sysm.name, "put", ds.block_bytes, rep, n, t_put))
        await sysm.reopen()
        cold(sysm.files())
        t_get = await sysm.get(0, n)
        bad = sysm.verify()
        sysm.drop_results()
        res.samples.append(_sample(sysm.name, "get", ds.block_bytes, rep, n, t_get, bad=bad))
        if bad:
            res.notes.append(f"{sysm.name} {human(ds.block_bytes)} rep {rep + 1}: {bad} of {n} "
                             "blocks read back missing or different")
    except Exception as e:  # noqa: BLE001 - one system failing must not lose the others
        res.failed.add(sysm.name)
        res.notes.append(f"{sysm.name} failed at {human(ds.block_bytes)} (rep {rep + 1}) and "
                         f"was dropped from the run: {e!r}")
        traceback.print_exc()
    finally:
        try:
            await sysm.close()
        except Exception as e:  # noqa: BLE001
            res.notes.append(f"{sysm.name}: close failed: {e!r}")


def _measure_fio(res: Results, fio: str, block: int, n: int, rep: int, root: str,
                 cold: Cold, iodepth: int, read: bool = True) -> None:
    filename = os.path.join(root, f"fio-{block}.dat")
    try:
        syncfs(root)
        t = fio_mod.run_fio(fio, filename, "write", block, n * block, iodepth)
        res.samples.append(_sample(FIO, "put", block, rep, n, t))
        if read:
            cold([filename])
            t = fio_mod.run_fio(fio, filename, "read", block, n * block, iodepth)
            res.samples.append(_sample(FIO, "get", block, rep, n, t))
            cold([filename])
            t = fio_mod.run_fio(fio, filename, "read", block, n * block, iodepth, direct=False)
            res.samples.append(_sample(FIO_BUFFERED, "get", block, rep, n, t))
    except Exception as e:  # noqa: BLE001
        res.failed.add(FIO)
        res.notes.append(f"fio failed at {human(block)}: {e}")
    finally:
        fio_mod.remove(filename)


async def sweep(res: Results, systems: list[System], fio: str | None, block_sizes: list[int],
                volume: int, reps: int, root: str, cold: Cold, iodepth: int,
                log: Log = _log_stderr) -> None:
    meter = CpuMeter()
    names: list[str] = [s.name for s in systems] + ([FIO] if fio else [])
    by_name = {s.name: s for s in systems}
    for bi, block in enumerate(block_sizes):
        n = max(1, volume // block)
        t0 = time.perf_counter()
        ds = Dataset.make(block, n)
        log(f"[{human(block)}] {n} blocks of data made in {time.perf_counter() - t0:.1f} s")
        for rep in range(reps):
            meter.lap()
            k = (rep + bi) % len(names)
            for name in names[k:] + names[:k]:
                if name in res.failed:
                    continue
                if name == FIO:
                    assert fio is not None
                    _measure_fio(res, fio, block, n, rep, root, cold, iodepth)
                else:
                    await _measure_system(res, by_name[name], ds, rep, root, cold)
            busy = meter.lap()
            res.other_cpu.append({"block_bytes": block, "rep": rep, **busy})
            line = "  ".join(f"{s['system']}/{s['op']} {s['MB_s']:.0f}" for s in res.samples
                             if s["rep"] == rep and s["block_bytes"] == block)
            log(f"[{human(block)} rep {rep + 1}/{reps}] MB/s: {line} (other CPU "
                f"{busy['other_cpu_pct']:.0f}%)")
        del ds


async def beyond_dirty_limit(res: Results, systems: list[System], fio: str | None,
                             block: int, volume: int, root: str, iodepth: int,
                             log: Log = _log_stderr) -> None:
    """One durable store of ``volume`` bytes per system (more than the dirty limit)."""
    n = max(1, volume // block)
    ds = Dataset.make(block, n)
    limits = dirty_limit_bytes()
    log(f"[beyond dirty limit] {n} x {human(block)} = {n * block / 2**30:.1f} GiB per system "
        f"(dirty threshold {limits['dirty'] / 2**30:.1f} GiB)")
    order: list[System | str] = [*systems, *([FIO] if fio else [])]
    for sysm in order:
        if isinstance(sysm, str):
            assert fio is not None
            filename = os.path.join(root, "fio-big.dat")
            try:
                syncfs(root)
                t = fio_mod.run_fio(fio, filename, "write", block, n * block, iodepth)
                res.big.append(_sample(FIO, "put", block, 0, n, t))
            except Exception as e:  # noqa: BLE001
                res.notes.append(f"fio (beyond dirty limit) failed: {e}")
            finally:
                fio_mod.remove(filename)
            continue
        if sysm.name in res.failed:
            continue
        try:
            await sysm.open(root, ds)
            syncfs(root)
            t = await sysm.put(0, n)
            res.big.append(_sample(sysm.name, "put", block, 0, n, t))
        except Exception as e:  # noqa: BLE001
            res.notes.append(f"{sysm.name} (beyond dirty limit) failed: {e!r}")
            traceback.print_exc()
        finally:
            await sysm.close()
        log(f"[beyond dirty limit] {res.big[-1]['system']}: {res.big[-1]['MB_s']:.0f} MB/s"
            if res.big else "[beyond dirty limit] nothing measured")


async def latency(res: Results, systems: list[System], block: int, batch: int, batches: int,
                  root: str, cold: Cold, log: Log = _log_stderr) -> None:
    live = [s for s in systems if s.name not in res.failed]
    n = batch * batches
    ds = Dataset.make(block, n)
    times: dict[tuple[str, str], list[float]] = {}
    opened: list[System] = []
    try:
        for s in live:
            await s.open(root, ds)
            opened.append(s)
        syncfs(root)
        for b in range(batches):
            k = b % len(opened)
            for s in opened[k:] + opened[:k]:
                times.setdefault((s.name, "put"), []).append(
                    await s.put(b * batch, (b + 1) * batch))
        for s in reversed(opened):  # an engine restart: stop all, then start all
            await s.stop()
        for s in opened:
            await s.restart()
        cold([f for s in opened for f in s.files()])
        for b in range(batches):
            k = b % len(opened)
            for s in opened[k:] + opened[:k]:
                keep = b == batches - 1  # check the last batch's bytes
                times.setdefault((s.name, "get"), []).append(
                    await s.get(b * batch, (b + 1) * batch, keep=keep))
        for s in opened:
            bad = s.verify()
            s.drop_results()
            if bad:
                res.notes.append(f"latency: {s.name}: {bad} blocks of the last batch wrong")
    finally:
        for s in reversed(opened):
            await s.close()
    for (name, op), ts in times.items():
        ms = [t * 1e3 for t in ts]
        res.latency.append({"system": name, "op": op, "block_bytes": block, "batch": batch,
                            "batches": len(ms), "p50_ms": percentile(ms, 50),
                            "p99_ms": percentile(ms, 99), "max_ms": max(ms),
                            "MB_s_median": batch * block / (percentile(ms, 50) / 1e3) / 1e6,
                            "samples_ms": ms})
        log(f"[latency {batch} x {human(block)}] {name} {op}: p50 {percentile(ms, 50):.0f} ms, "
            f"p99 {percentile(ms, 99):.0f} ms")
