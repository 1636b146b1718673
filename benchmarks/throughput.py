"""Throughput of kvstore ``put_many`` / ``get_many`` against what the device can do (fio).

What is measured
----------------
For block sizes 64 KiB, 1 MiB and 32 MiB, and for both I/O engines (``engine="io_uring"``
and ``engine="threads"``), with durability on (``sync=True``, the default: every
``put_many`` returns only after the slots are written with O_DIRECT, fdatasync'ed and
the LMDB index committed with fsync):

* **put**: wall time of ``await store.put_many(keys, tensors, parents=...)`` for one
  batch of ``--volume-mib`` MiB of uint8 tensors (generated before timing) into a
  *fresh* store (a new directory per engine/size/repetition, so every put really
  writes).  One small warm-up put is done first, outside the timing, so the creation
  and fsync of the 1 GiB extent file is not part of the measurement.
* **get**: wall time of ``await store.get_many(keys)`` for the same keys on a freshly
  reopened store (one small warm-up get first).  kvstore opens extent files with
  O_DIRECT, so every get reads from the device, not from the page cache (note: on a
  virtual machine the "device" may itself be cached by the host).  The blocks read
  back are compared with what was written, outside the timing.
* **fio** (the physical limit): ``fio --ioengine=io_uring --direct=1 --bs=<block size>
  --iodepth=32 --size=<same volume>`` with ``--rw=write --end_fsync=1`` (the final
  fsync is inside fio's runtime, as kvstore's fdatasync + commit is inside put) and
  then ``--rw=read`` on the file just written, ``--output-format=json``.  kvstore's
  default queue depth is 64; fio uses 32.

Everything runs in one process, on one file system, interleaved per repetition (for
each repetition and block size: kvstore io_uring, kvstore threads and fio, in an order
that rotates between repetitions), so slow drifts of a shared or virtual disk hit all
candidates alike.  Throughput is *payload* bytes per second (the tensors' bytes; kvstore
also writes a 256-byte slot header and pads each slot to 4 KiB, i.e. +4 KiB per block,
which the JSON records as ``device_bytes``).  MB/s and GB/s are decimal (10^6, 10^9).
Ratios (kvstore/fio, io_uring/threads) are taken per repetition, between measurements
made back to back, and summarised as median [min-max].

Rerun
-----
::

    python benchmarks/throughput.py            # full: 256 MiB per measurement, 5 reps
    python benchmarks/throughput.py --quick    # ~16 MiB per measurement, 1 rep (< 30 s)
    python benchmarks/throughput.py --dir /mnt/nvme/scratch --reps 9 --volume-mib 512

Results go to stdout (markdown) and to ``--out`` (default ``benchmarks/results``):
``throughput.json`` (every sample, machine info) and ``throughput.md``.  The scratch
directory (default ``./.bench-tmp`` on the current directory's file system) is created
fresh and removed at the end; pass ``--keep`` to keep it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

import kvstore

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

BLOCK_SIZES: tuple[int, ...] = (64 * KiB, 1 * MiB, 32 * MiB)
ENGINES: tuple[str, ...] = ("io_uring", "threads")
FIO_IODEPTH = 32
STAGING_BYTES = 256 * MiB
EXTENT_BYTES = 1 * GiB
SLOT_OVERHEAD = 4 * KiB  # 256-byte header, slot rounded up to 4 KiB: +1 page per block
WARMUP_KEY_TOKENS = 16


@dataclass
class Sample:
    """One timed transfer."""

    system: str  # "kvstore-io_uring", "kvstore-threads" or "fio"
    op: str  # "put"/"get" (fio: "write"/"read")
    block: int
    rep: int
    blocks: int
    payload_bytes: int
    device_bytes: int
    seconds: float

    @property
    def mb_s(self) -> float:
        return self.payload_bytes / self.seconds / 1e6

    @property
    def blocks_s(self) -> float:
        return self.blocks / self.seconds


@dataclass
class Run:
    args: argparse.Namespace
    samples: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    engine_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    fio_missing: bool = False
    # CPU used by *other* processes while a (rep, block) group ran, in % of one CPU
    foreign_cpu: list[dict[str, Any]] = field(default_factory=list)


class CpuMeter:
    """How busy the rest of the machine is: CPU time spent by everything except this
    process and its waited-for children (fio), and hypervisor steal, from /proc/stat.
    Kernel threads working for our own I/O (kworkers, ext4 conversion) count as
    "other", so a quiet machine still shows a few percent."""

    def __init__(self) -> None:
        self._hz = os.sysconf("SC_CLK_TCK")
        self._t0, self._busy0, self._steal0, self._own0 = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        busy = steal = 0.0
        with suppress(OSError, ValueError, IndexError):
            with open("/proc/stat", encoding="ascii") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
            # user nice system idle iowait irq softirq steal guest guest_nice
            steal = vals[7] / self._hz
            busy = (sum(vals[:8]) - vals[3] - vals[4] - vals[7]) / self._hz
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return time.perf_counter(), busy, steal, own

    def lap(self) -> dict[str, float]:
        """Average since the last lap: other processes' CPU and steal, % of one CPU."""
        t, busy, steal, own = self._read()
        wall = max(t - self._t0, 1e-9)
        out = {"seconds": wall,
               "other_cpu_pct": max(0.0, (busy - self._busy0) - (own - self._own0)) / wall * 100,
               "steal_pct": (steal - self._steal0) / wall * 100}
        self._t0, self._busy0, self._steal0, self._own0 = t, busy, steal, own
        return out


# --------------------------------------------------------------------------- helpers


def human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def mount_of(path: str) -> dict[str, str]:
    """File system type, device and mount point holding ``path`` (from mountinfo)."""
    real = os.path.realpath(path)
    best: dict[str, str] = {"fstype": "unknown", "device": "unknown", "mount": "/"}
    best_len = -1
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4].replace("\\040", " ")
                fstype, device = right.split()[:2]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= best_len:
                    best, best_len = {"fstype": fstype, "device": device, "mount": mnt}, len(mnt)
    except OSError:
        pass
    return best


def kvstore_source() -> str:
    """Where kvstore was imported from, and its git commit (``+dirty`` if kvstore/ has
    uncommitted changes), so a result can be tied to the code it measured."""
    pkg = os.path.dirname(os.path.abspath(kvstore.__file__))
    try:
        head = subprocess.run(["git", "-C", pkg, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", pkg, "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return pkg
    if head.returncode != 0:
        return pkg
    return f"{pkg} @ {head.stdout.strip()}{'+dirty' if dirty.stdout.strip() else ''}"


def machine_info(directory: str, fio: str | None) -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = 0.0
    with suppress(ValueError, OSError):
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    mnt = mount_of(directory)
    sched = "unknown"
    sysdev = os.path.realpath(f"/sys/class/block/{os.path.basename(mnt['device'])}")
    for cand in (sysdev, os.path.dirname(sysdev)):  # a partition's queue is its disk's
        try:
            with open(os.path.join(cand, "queue", "scheduler"), encoding="utf-8") as f:
                sched = f.read().strip()
            break
        except OSError:
            pass
    fio_version = None
    if fio:
        try:
            fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True,
                                         timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            fio_version = "unknown"
    return {
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kvstore": kvstore.__version__,
        "kvstore_source": kvstore_source(),
        "fio": fio_version,
        "dir": os.path.abspath(directory),
        "fs_type": mnt["fstype"],
        "fs_device": mnt["device"],
        "fs_mount": mnt["mount"],
        "io_scheduler": sched,
        "loadavg_start": loadavg(),
    }


def loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


# --------------------------------------------------------------------------- kvstore


async def bench_kvstore(run: Run, engine: str, block: int, rep: int, data: torch.Tensor,
                        root: str) -> None:
    n = data.numel() // block
    tensors = [data[i * block:(i + 1) * block] for i in range(n)]
    ns = kvstore.Namespace(model="bench", dtype="uint8", block_size=16)
    tokens = torch.randint(0, 1 << 30, ((n + 1) * 16,), dtype=torch.int64).numpy()
    all_keys = ns.chain_keys(tokens)
    warm_key, keys = all_keys[0], all_keys[1:]
    parents = kvstore.chain_parents(keys, first_parent=warm_key)
    warm = torch.zeros(WARMUP_KEY_TOKENS, dtype=torch.uint8)
    path = os.path.join(root, f"kv-{engine}-{block}-r{rep}")
    opts: dict[str, Any] = dict(namespace=ns, engine=engine, sync=True,
                                staging_bytes=STAGING_BYTES, extent_bytes=EXTENT_BYTES)
    system = f"kvstore-{engine}"
    try:
        async with kvstore.open(path, **opts) as store:
            await store.put(warm_key, warm)  # creates the extent file; not timed
            t0 = time.perf_counter()
            res = await store.put_many(keys, tensors, parents=parents)
            dt = time.perf_counter() - t0
            if res.written != n:
                raise RuntimeError(f"put wrote {res.written} of {n} blocks")
            st = store.stats()
            run.engine_info.setdefault(engine, {
                "engine": st.engine, "o_direct": st.o_direct, "reason": st.engine_reason,
                "durable": st.durable})
            if st.engine != engine or not st.o_direct:
                run.notes.append(f"{engine}: store reports engine={st.engine} "
                                 f"o_direct={st.o_direct} ({st.engine_reason})")
        run.samples.append(Sample(system, "put", block, rep, n, n * block,
                                  n * (block + SLOT_OVERHEAD), dt))

        async with kvstore.open(path, **opts, create=False) as store:
            await store.get(warm_key)  # warm-up, not timed
            t0 = time.perf_counter()
            got = await store.get_many(keys)
            dt = time.perf_counter() - t0
            bad = sum(g is None or not torch.equal(g, t) for g, t in zip(got, tensors, strict=True))
            if bad:
                raise RuntimeError(f"{engine} {human(block)}: {bad} of {n} blocks read back "
                                   "missing or different")
            del got
        run.samples.append(Sample(system, "get", block, rep, n, n * block,
                                  n * (block + SLOT_OVERHEAD), dt))
    finally:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))


# --------------------------------------------------------------------------- fio


async def fio_job(fio: str, filename: str, rw: str, block: int, volume: int) -> dict[str, Any]:
    cmd = [fio, "--name=bench", f"--filename={filename}", "--ioengine=io_uring", "--direct=1",
           f"--bs={block}", f"--iodepth={FIO_IODEPTH}", f"--rw={rw}", f"--size={volume}",
           "--numjobs=1", "--thread", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    proc = await anyio.run_process(cmd, check=False)
    out = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stderr.decode(errors='replace')}")
    # fio may print warnings before the JSON document
    doc: dict[str, Any] = json.loads(out[out.index("{"):])
    job: dict[str, Any] = doc["jobs"][0][rw]
    job["_cmd"] = " ".join(cmd)
    return job


async def bench_fio(run: Run, fio: str, block: int, rep: int, volume: int, root: str) -> None:
    filename = os.path.join(root, f"fio-{block}-r{rep}.dat")
    n = volume // block
    try:
        for rw, op in (("write", "write"), ("read", "read")):
            job = await fio_job(fio, filename, rw, block, volume)
            runtime_ms = job["runtime"]
            if job["io_bytes"] != volume or runtime_ms <= 0:
                raise RuntimeError(f"fio {rw}: moved {job['io_bytes']} of {volume} bytes "
                                   f"in {runtime_ms} ms")
            run.samples.append(Sample("fio", op, block, rep, n, volume, volume,
                                      runtime_ms / 1000.0))
            run.engine_info.setdefault("fio", {"cmd": job["_cmd"]})
    finally:
        with suppress(FileNotFoundError):
            os.unlink(filename)


# --------------------------------------------------------------------------- driver


async def run_all(run: Run, root: str, fio: str | None) -> None:
    args = run.args
    volume_target = int(args.volume_mib * MiB)
    volumes = {b: max(1, volume_target // b) * b for b in BLOCK_SIZES}
    gen = torch.Generator().manual_seed(0)
    # random payload, made once before any timing; each measurement uses a prefix of it
    source = torch.randint(0, 256, (max(volumes.values()),), dtype=torch.uint8, generator=gen)
    meter = CpuMeter()
    for rep in range(args.reps):
        for block in BLOCK_SIZES:
            meter.lap()
            volume = volumes[block]
            data = source[:volume]
            systems: list[str] = [*ENGINES, "fio"]
            k = (rep + BLOCK_SIZES.index(block)) % len(systems)
            order = systems[k:] + systems[:k]  # rotate so no one always goes first
            for system in order:
                if system == "fio":
                    if fio is not None:
                        await bench_fio(run, fio, block, rep, volume, root)
                else:
                    await bench_kvstore(run, system, block, rep, data, root)
            del data
            busy = meter.lap()
            run.foreign_cpu.append({"rep": rep, "block_bytes": block, **busy})
            if not args.quiet:
                done = [s for s in run.samples if s.rep == rep and s.block == block]
                line = "  ".join(f"{s.system}/{s.op} {s.mb_s:5.0f}" for s in done)
                print(f"[rep {rep + 1}/{args.reps} {human(block):>6}] MB/s: {line}  "
                      f"(other CPU {busy['other_cpu_pct']:.0f}%, steal {busy['steal_pct']:.0f}%)",
                      file=sys.stderr, flush=True)


def _values(run: Run, system: str, op: str, block: int) -> dict[int, Sample]:
    return {s.rep: s for s in run.samples if (s.system, s.op, s.block) == (system, op, block)}


def _ratios(a: dict[int, Sample], b: dict[int, Sample]) -> list[float]:
    return [a[r].mb_s / b[r].mb_s for r in sorted(a) if r in b]


def _fmt3(vals: Sequence[float], digits: int = 0) -> str:
    if not vals:
        return "n/a"
    lo, med, hi = summary(vals)
    return f"{lo:.{digits}f} / **{med:.{digits}f}** / {hi:.{digits}f}"


def _fmt_ratio(vals: Sequence[float]) -> str:
    if not vals:
        return "n/a"
    lo, med, hi = summary(vals)
    return f"**{med:.2f}** [{lo:.2f}-{hi:.2f}]" if len(vals) > 1 else f"**{med:.2f}**"


def build_results(run: Run, info: dict[str, Any], elapsed: float) -> tuple[dict[str, Any], str]:
    args = run.args
    fio_op = {"put": "write", "get": "read"}
    rows: list[dict[str, Any]] = []
    md: list[str] = []
    md.append("# kvstore throughput vs fio\n")
    md.append(f"- timestamp (UTC): {info['timestamp_utc']}; total runtime {elapsed:.1f} s; "
              f"mode: {'quick' if args.quick else 'full'}")
    md.append(f"- machine: {info['nproc']} CPUs ({info['cpu']}), {info['mem_gib']} GiB RAM, "
              f"kernel {info['kernel']}, Python {info['python']}, torch {info['torch']} "
              f"({info['torch_threads']} intra-op threads), "
              f"kvstore {info['kvstore']} ({info['kvstore_source']}), "
              f"{info['fio'] or 'fio: not found'}")
    md.append(f"- directory: `{info['dir']}` on **{info['fs_type']}** ({info['fs_device']}, "
              f"mounted at {info['fs_mount']}, I/O scheduler: {info['io_scheduler']})")
    md.append(f"- load average (1/5/15 min) at start: {info['loadavg_start']}, at end: "
              f"{info['loadavg_end']} (other work on the machine skews the numbers)")
    if run.foreign_cpu:
        other = [g["other_cpu_pct"] for g in run.foreign_cpu]
        steal = [g["steal_pct"] for g in run.foreign_cpu]
        md.append(f"- CPU used by other processes and kernel threads while measuring, % of one "
                  f"CPU per (repetition, block size) group: median {statistics.median(other):.0f}"
                  f"%, max {max(other):.0f}% (a quiet machine shows a few %: kernel I/O "
                  f"workers); hypervisor steal median {statistics.median(steal):.0f}%, "
                  f"max {max(steal):.0f}%")
    md.append(f"- per measurement: ~{args.volume_mib:g} MiB of payload in one `put_many` / "
              f"`get_many` call (at least one block); {args.reps} repetition(s), interleaved; "
              f"sync=True, staging_bytes={human(STAGING_BYTES)}, "
              f"extent_bytes={human(EXTENT_BYTES)}, queue_depth=64 (default)")
    md.append("- get reads a freshly reopened store; kvstore uses O_DIRECT, so reads come "
              "from the device (not the guest page cache)")
    if run.fio_missing:
        md.append("- **fio not found: the fio columns and kvstore/fio ratios are skipped**")
    else:
        md.append(f"- fio: `--ioengine=io_uring --direct=1 --iodepth={FIO_IODEPTH}`, bs = "
                  "block size, size = same volume; write with `--end_fsync=1` (inside its "
                  "runtime), then read of the file just written")
    md.append("- MB/s = 10^6 payload bytes/s, shown as min / **median** / max; ratios are "
              "per-repetition (back-to-back pairs), shown as **median** [min-max]\n")
    md.append("| op | block | kvstore io_uring MB/s | kvstore threads MB/s | fio MB/s "
              "| io_uring / fio | threads / fio | io_uring / threads |")
    md.append("|---|---|---|---|---|---|---|---|")
    for op in ("put", "get"):
        for block in BLOCK_SIZES:
            uring = _values(run, "kvstore-io_uring", op, block)
            threads = _values(run, "kvstore-threads", op, block)
            fio = _values(run, "fio", fio_op[op], block)
            mb = {name: [s.mb_s for s in d.values()] for name, d in
                  (("io_uring", uring), ("threads", threads), ("fio", fio))}
            r_uf, r_tf, r_ut = _ratios(uring, fio), _ratios(threads, fio), _ratios(uring, threads)
            label = f"{op} (vs fio {fio_op[op]})"
            md.append(f"| {label} | {human(block)} | {_fmt3(mb['io_uring'])} | "
                      f"{_fmt3(mb['threads'])} | {_fmt3(mb['fio'])} | {_fmt_ratio(r_uf)} | "
                      f"{_fmt_ratio(r_tf)} | {_fmt_ratio(r_ut)} |")
            row: dict[str, Any] = {"op": op, "block_bytes": block}
            for name, d in (("io_uring", uring), ("threads", threads), ("fio", fio)):
                vals = [s.mb_s for s in d.values()]
                bps = [s.blocks_s for s in d.values()]
                if vals:
                    lo, med, hi = summary(vals)
                    row[name] = {"MB_s": {"min": lo, "median": med, "max": hi},
                                 "GB_s_median": med / 1e3,
                                 "blocks_s": dict(zip(("min", "median", "max"), summary(bps), strict=True))}
            for name, r in (("io_uring_over_fio", r_uf), ("threads_over_fio", r_tf),
                            ("io_uring_over_threads", r_ut)):
                if r:
                    row[name] = dict(zip(("min", "median", "max"), summary(r), strict=True))
            rows.append(row)
    md.append("")
    md.append("Median blocks/s and GB/s:\n")
    md.append("| op | block | io_uring blocks/s | threads blocks/s | fio blocks/s "
              "| io_uring GB/s | threads GB/s | fio GB/s |")
    md.append("|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells_b, cells_g = [], []
        for name in ("io_uring", "threads", "fio"):
            if name in row:
                cells_b.append(f"{row[name]['blocks_s']['median']:.0f}")
                cells_g.append(f"{row[name]['GB_s_median']:.3f}")
            else:
                cells_b.append("n/a")
                cells_g.append("n/a")
        md.append(f"| {row['op']} | {human(row['block_bytes'])} | " + " | ".join(cells_b + cells_g)
                  + " |")
    if run.engine_info:
        md.append("")
        for name, meta in run.engine_info.items():
            if name != "fio":
                md.append(f"- kvstore engine `{name}`: {meta}")
    if run.notes:
        md.append("")
        md.extend(f"- note: {n}" for n in run.notes)
    markdown = "\n".join(md) + "\n"
    doc = {
        "machine": info,
        "config": {"quick": args.quick, "reps": args.reps, "volume_mib": args.volume_mib,
                   "block_sizes": list(BLOCK_SIZES), "engines": list(ENGINES),
                   "sync": True, "staging_bytes": STAGING_BYTES, "extent_bytes": EXTENT_BYTES,
                   "fio_iodepth": FIO_IODEPTH, "fio_missing": run.fio_missing},
        "total_seconds": elapsed,
        "engines": run.engine_info,
        "other_cpu": run.foreign_cpu,
        "summary": rows,
        "samples": [{"system": s.system, "op": s.op, "block_bytes": s.block, "rep": s.rep,
                     "blocks": s.blocks, "payload_bytes": s.payload_bytes,
                     "device_bytes": s.device_bytes, "seconds": s.seconds,
                     "MB_s": s.mb_s, "blocks_s": s.blocks_s} for s in run.samples],
        "notes": run.notes,
    }
    return doc, markdown


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="throughput", description="kvstore put/get throughput vs fio (see module docstring)")
    p.add_argument("--quick", action="store_true",
                   help="~16 MiB per measurement and 1 repetition (smoke test, < 30 s)")
    p.add_argument("--dir", default=None,
                   help="scratch directory on the file system to test (default ./.bench-tmp; "
                        "a fresh subdirectory is created inside and removed at the end)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"),
                   help="where throughput.json and throughput.md go (default benchmarks/results)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; quick: 1)")
    p.add_argument("--volume-mib", type=float, default=None,
                   help="payload per measurement in MiB (default 256; quick: 16)")
    p.add_argument("--fio", default=None, help="fio binary (default: fio on PATH)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads(N) before measuring (default: torch's default; "
                        "kvstore's staging/verify copies are torch ops and use these threads)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.quick else 5
    if args.volume_mib is None:
        args.volume_mib = 16.0 if args.quick else 256.0
    if args.reps < 1 or args.volume_mib <= 0:
        p.error("--reps and --volume-mib must be positive")
    return args


async def _amain(run: Run, root: str, fio: str | None) -> None:
    await run_all(run, root, fio)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    base = os.path.abspath(args.dir or ".bench-tmp")
    base_existed = os.path.isdir(base)
    os.makedirs(base, exist_ok=True)
    root = os.path.join(base, f"run-{os.getpid()}-{int(time.time())}")
    os.makedirs(root)
    fio = shutil.which(args.fio or "fio")
    run = Run(args=args)
    if fio is None:
        run.fio_missing = True
        run.notes.append("fio not found on PATH: physical-limit measurements skipped")
        print("note: fio not found; skipping the fio measurements", file=sys.stderr)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    info = machine_info(root, fio)
    try:
        anyio.run(_amain, run, root, fio, backend="asyncio")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
            if not base_existed:
                with suppress(OSError):
                    os.rmdir(base)  # only if empty
    elapsed = time.perf_counter() - start
    info["loadavg_end"] = loadavg()
    doc, markdown = build_results(run, info, elapsed)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "throughput.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "throughput.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    print(markdown)
    print(f"wrote {os.path.join(args.out, 'throughput.json')} and "
          f"{os.path.join(args.out, 'throughput.md')} ({elapsed:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
