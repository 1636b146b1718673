"""``python -m kvstore bench``: kvstore against the physical limit and the peers, in one run.

Usage::

    python -m kvstore bench                  # full run (~15 min here), results in benchmarks/results
    python -m kvstore bench --smoke          # seconds; what CI runs (tests/benchmarks)
    python -m kvstore bench --install-peers  # first create LMCache's virtual environment
    python -m kvstore bench --out DIR --dir /mnt/nvme/scratch

What one run does (details in each module's docstring):

1. sweep (:mod:`benchmarks.sweep`): block sizes 64 KiB, 256 KiB, 1 MiB, 2 MiB, 32 MiB;
   fio (io_uring, O_DIRECT), kvstore (io_uring and threads engines, raw and FP8), and the
   peers (LMCache local disk, file-per-block with tmp + rename, ``torch.save``, numpy),
   durable stores and cold gets, repeated and interleaved;
2. one store per system of more data than the page cache's dirty limit (2 MiB blocks);
3. per-batch latency, 32 blocks of 2 MiB;
4. scale (:mod:`benchmarks.scale`): open() and match_prefix at 1k .. 1M blocks, memory;
5. callers (:mod:`benchmarks.callers`): one caller vs 4 concurrent callers on one store,
   put (durable) and cold get at 64 KiB, 1 MiB, 2 MiB, 32 MiB, each beside fio (1 job at
   QD 64; 4 jobs at QD 16), with CPU core-seconds per GB and RSS growth;
6. mixed (:mod:`benchmarks.mixed`): foreground get latency while 2 tasks stream puts,
   vs the same gets on an idle store;
7. report (:mod:`benchmarks.report`): ``bench.md`` (absolute numbers, ratios, targets),
   ``bench.json`` (every sample), ``bench.png`` (throughput vs block size).

Peers that are not installed are skipped with a note.  LMCache runs in its own virtual
environment (``--install-peers`` creates it; ``--lmcache-python`` points at another);
fio is skipped with a note when it is not on PATH.  The scratch directory (default
``./.bench-tmp`` on the current directory's file system) is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import anyio

from benchmarks import fio as fio_mod
from benchmarks import report, report_concurrency
from benchmarks.callers import run_callers
from benchmarks.common import (
    Cold,
    GiB,
    KiB,
    MiB,
    dirty_limit_bytes,
    loadavg,
    machine_info,
    summary,
)
from benchmarks.mixed import run_mixed
from benchmarks.scale import run_scale
from benchmarks.sweep import FIO, FIO_BUFFERED, Results, beyond_dirty_limit, latency, sweep
from benchmarks.systems import (
    FilePerBlock,
    KvstoreSystem,
    LMCacheSystem,
    NumpyFiles,
    PeerUnavailable,
    System,
    TorchSave,
    default_lmcache_python,
    python_of,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_BLOCKS = (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 32 * MiB)
SMOKE_BLOCKS = (64 * KiB, 1 * MiB)
FULL_SCALE = (1_000, 10_000, 100_000, 1_000_000)
SMOKE_SCALE = (500,)
FULL_CALLER_BLOCKS = (64 * KiB, 1 * MiB, 2 * MiB, 32 * MiB)
SMOKE_CALLER_BLOCKS = (64 * KiB, 1 * MiB)
PARTS = ("sweep", "big", "latency", "scale", "callers", "mixed")
LMCACHE_VERSION = "0.5.6"
# LMCache's wheel requires CUDA packages (cupy-cuda13x, cuda-python, cufile-python and,
# through an unpinned torch, the CUDA build of torch).  Its local disk backend needs
# none of them on a CPU host: install LMCache without dependencies, then these.
LMCACHE_CPU_DEPS = (
    "numpy<=2.2.6", "aiofile", "aiofiles", "aiohttp", "awscrt", "blake3", "cachetools",
    "cryptography", "fastapi", "httptools", "httpx", "msgspec", "numba", "nvtx",
    "opentelemetry-api>=1.20,<=1.40.0", "opentelemetry-sdk>=1.20",
    "opentelemetry-exporter-otlp<=1.40.0", "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0",
    "prometheus_client>=0.18,<=0.24.1", "protobuf>=6.31.1,<7", "psutil", "py-cpuinfo",
    "pyyaml", "pyzmq>=25", "redis", "safetensors", "setuptools>=77.0.3,<81",
    "setuptools_scm>=8", "sortedcontainers", "transformers>=5.4", "uvicorn",
)


def install_peers(python: str) -> int:
    """Create LMCache's virtual environment (CPU-only) so that ``python`` runs it."""
    import torch

    venv = os.path.dirname(os.path.dirname(python))
    torch_version = torch.__version__.split("+")[0]
    print(f"installing LMCache {LMCACHE_VERSION} (CPU only, torch {torch_version}) into {venv}",
          file=sys.stderr)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [[sys.executable, "-m", "venv", venv]]
    if not os.path.exists(python):
        subprocess.run(steps[0], check=True)
    constraints = os.path.join(venv, "bench-constraints.txt")
    with open(constraints, "w", encoding="ascii") as f:
        f.write(f"torch=={torch_version}\n")
    # the CPU build of torch first (the default wheel pulls several GB of CUDA libraries)
    cpu = subprocess.run([*pip, f"torch=={torch_version}", "--index-url",
                          "https://download.pytorch.org/whl/cpu", "--timeout", "20",
                          "--retries", "1"])
    if cpu.returncode != 0:
        subprocess.run([*pip, f"torch=={torch_version}"], check=True)
    subprocess.run([*pip, "--no-deps", f"lmcache=={LMCACHE_VERSION}"], check=True)
    subprocess.run([*pip, "-c", constraints, *LMCACHE_CPU_DEPS], check=True)
    check = subprocess.run(
        [python, "-c", "from lmcache.v1.storage_backend.local_disk_backend import "
                       "LocalDiskBackend"], capture_output=True, text=True)
    if check.returncode != 0:
        print(f"LMCache installed but does not import:\n{check.stderr[-3000:]}", file=sys.stderr)
        return 2
    print(f"LMCache ready: {python}", file=sys.stderr)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvstore bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="seconds: 64 KiB and 1 MiB blocks, 2 MiB per measurement, 1 "
                        "repetition, small stores, no page-cache drop, no beyond-dirty run")
    p.add_argument("--install-peers", action="store_true",
                   help="create LMCache's CPU-only virtual environment first "
                        f"(at {os.path.dirname(os.path.dirname(default_lmcache_python()))}, "
                        "or $KVSTORE_BENCH_PEERS/lmcache-venv)")
    p.add_argument("--out", default=None,
                   help="where bench.md/.json/.png go (default benchmarks/results; "
                        "--smoke: .bench-tmp/smoke-results)")
    p.add_argument("--dir", default=None,
                   help="scratch directory on the file system to test (default ./.bench-tmp)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; smoke 1)")
    p.add_argument("--volume-mib", type=float, default=None,
                   help="bytes per sweep measurement, MiB (default 128; smoke 2)")
    p.add_argument("--blocks", default=None,
                   help="comma-separated block sizes in KiB (default 64,256,1024,2048,32768)")
    p.add_argument("--lmcache-python", default=None,
                   help="interpreter (or venv) with LMCache installed "
                        "(default: the --install-peers location)")
    p.add_argument("--no-lmcache", action="store_true", help="skip the LMCache peer")
    p.add_argument("--fio", default=None, help="fio binary (default: fio on PATH)")
    p.add_argument("--cold", default=None, choices=("auto", "drop", "fadvise", "none"),
                   help="how reads are made cold (default auto: drop_caches if permitted, "
                        "else fadvise; smoke: none)")
    p.add_argument("--scale", default=None,
                   help="comma-separated store sizes in blocks (default 1000,...,1000000; "
                        "'' skips)")
    p.add_argument("--latency-batches", type=int, default=None,
                   help="batches in the latency run (default 32; smoke 2; 0 skips)")
    p.add_argument("--no-beyond-dirty", action="store_true",
                   help="skip the store run beyond the dirty limit")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"which parts to run (comma-separated: {', '.join(PARTS)}; "
                        "default all)")
    p.add_argument("--caller-blocks", default=None,
                   help="block sizes in KiB for the callers part (default 64,1024,2048,32768;"
                        " smoke 64,1024); --volume-mib applies to it too")
    p.add_argument("--scale-from", default=None,
                   help="take the scale rows from an earlier bench.json instead of measuring "
                        "them (the report says so)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads(N) first (FP8 codec work; default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.reps = args.reps or (1 if smoke else 3)
    args.volume = int((args.volume_mib or (2 if smoke else 128)) * MiB)
    args.block_sizes = [int(x) * KiB for x in args.blocks.split(",")] if args.blocks else \
        list(SMOKE_BLOCKS if smoke else FULL_BLOCKS)
    if args.scale is None:
        args.scale_sizes = list(SMOKE_SCALE if smoke else FULL_SCALE)
    else:
        args.scale_sizes = [int(x) for x in args.scale.split(",") if x.strip()]
    if args.latency_batches is None:
        args.latency_batches = 2 if smoke else 32
    args.cold = args.cold or ("none" if smoke else "auto")
    args.caller_block_sizes = [int(x) * KiB for x in args.caller_blocks.split(",")] if \
        args.caller_blocks else list(SMOKE_CALLER_BLOCKS if smoke else FULL_CALLER_BLOCKS)
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    unknown = args.parts - set(PARTS)
    if unknown:
        p.error(f"unknown --parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    args.out = args.out or (os.path.join(".bench-tmp", "smoke-results") if smoke else
                            os.path.join(REPO, "benchmarks", "results"))
    if args.reps < 1 or args.volume <= 0 or not args.block_sizes:
        p.error("--reps, --volume-mib and --blocks must be positive")
    return args


def make_systems(args: argparse.Namespace, skipped: list[str], root: str
                 ) -> tuple[list[System], LMCacheSystem | None]:
    from kvstore.io.probe import probe

    # Smoke stores use small extents and arenas: a 1 GiB extent is really fallocated.
    extent = (64 * MiB) if args.smoke else (1 << 30)
    staging = (16 * MiB) if args.smoke else (256 * MiB)
    engines = ["io_uring", "threads"]
    found = probe(root, "auto")
    if found.engine != "io_uring":  # e.g. seccomp refuses io_uring_setup in containers
        engines.remove("io_uring")
        skipped.append(f"kvstore io_uring: not usable here ({found.reason}); the thread-pool "
                       "engine (kvstore's fallback) is measured instead")
    systems: list[System] = [KvstoreSystem(e, c, extent_bytes=extent, staging_bytes=staging)
                             for e in engines for c in ("raw", "fp8")]
    lm: LMCacheSystem | None = None
    if args.no_lmcache:
        skipped.append("lmcache: --no-lmcache")
    else:
        python = python_of(args.lmcache_python or default_lmcache_python())
        try:
            lm = LMCacheSystem(python, REPO)
            systems.append(lm)
        except PeerUnavailable as e:
            skipped.append(f"lmcache: not installed ({e}); `python -m kvstore bench "
                           "--install-peers` sets it up")
    systems += [FilePerBlock(), TorchSave(), NumpyFiles()]
    return systems, lm


async def _run_concurrency(args: argparse.Namespace, res: Results, kv: KvstoreSystem,
                           fio: str | None, root: str, cold: Cold, doc: dict[str, Any],
                           log: Callable[[str], None]) -> None:
    """The callers and mixed parts, on the headline kvstore configuration."""
    if "callers" in args.parts:
        part = await run_callers(kv, fio, args.caller_block_sizes, args.volume, args.reps,
                                 root, cold, log)
        part["summary"] = report_concurrency.summarise(part)
        res.notes += part["notes"]
        res.other_cpu += part["other_cpu"]
        doc["callers"] = part
    else:
        doc["skipped"].append("one caller vs 4 callers: not in --parts")
    if "mixed" in args.parts:
        block = 64 * KiB if args.smoke else 2 * MiB
        doc["mixed"] = await run_mixed(kv, root, block, fg_batch=8,
                                       fg_batches=2 if args.smoke else 16, writers=2,
                                       reps=args.reps,
                                       max_bg_bytes=16 * MiB if args.smoke else 4 * GiB,
                                       log=log)
        res.other_cpu += doc["mixed"]["other_cpu"]
        if doc["mixed"]["bad"]:
            res.notes.append(f"mixed: {doc['mixed']['bad']} foreground blocks read back wrong")
    else:
        doc["skipped"].append("mixed load latency: not in --parts")


async def _run(args: argparse.Namespace, res: Results, systems: list[System], fio: str | None,
               root: str, cold: Cold, doc: dict[str, Any]) -> None:
    log = (lambda _m: None) if args.quiet else \
        (lambda m: print(m, file=sys.stderr, flush=True))
    iodepth = 64  # kvstore's default queue_depth
    try:
        if "sweep" in args.parts:
            await sweep(res, systems, fio, args.block_sizes, args.volume, args.reps, root,
                        cold, iodepth, log)
        else:
            doc["skipped"].append("throughput sweep: not in --parts")
        by_name = {s.name: s for s in systems}
        big_names = [doc["headline"], "lmcache", "file-per-block"]
        big_block = 2 * MiB
        if "big" not in args.parts:
            doc["skipped"].append("store beyond the dirty limit: not in --parts")
        elif args.smoke or args.no_beyond_dirty:
            doc["skipped"].append("store beyond the dirty limit: "
                                  f"{'smoke run' if args.smoke else '--no-beyond-dirty'}")
        else:
            limit = dirty_limit_bytes()["dirty"]
            free = shutil.disk_usage(root).free
            volume = (int(limit * 1.25) // big_block + 1) * big_block
            if volume > free // 3:
                doc["skipped"].append(f"store beyond the dirty limit: {volume / 2**30:.1f} GiB "
                                      f"would not fit comfortably in {free / 2**30:.1f} GiB "
                                      "free")
            else:
                await beyond_dirty_limit(res, [by_name[n] for n in big_names if n in by_name],
                                         fio, big_block, volume, root, iodepth, log)
        if "latency" not in args.parts:
            doc["skipped"].append("latency: not in --parts")
        elif args.latency_batches > 0:
            lat_block = 64 * KiB if args.smoke else 2 * MiB
            lat_names = ["kvstore io_uring raw", "kvstore threads raw", "lmcache",
                         "file-per-block"]
            await latency(res, [by_name[n] for n in lat_names if n in by_name], lat_block, 32,
                          args.latency_batches, root, cold, log)
        else:
            doc["skipped"].append("latency: --latency-batches 0")
        head = by_name[doc["headline"]]
        assert isinstance(head, KvstoreSystem)
        await _run_concurrency(args, res, head, fio, root, cold, doc, log)
        if args.scale_from:
            with open(args.scale_from, encoding="utf-8") as f:
                earlier = json.load(f)
            doc["scale"] = earlier["scale"]
            doc["scale_from"] = {"file": args.scale_from,
                                 "timestamp_utc": earlier["machine"]["timestamp_utc"],
                                 "command": earlier["command"],
                                 "loadavg": [earlier["machine"]["loadavg_start"],
                                             earlier["machine"]["loadavg_end"]]}
        elif "scale" not in args.parts:
            doc["skipped"].append("scale: not in --parts")
        elif args.scale_sizes:
            path = os.path.join(root, "scale")
            doc["scale"] = await run_scale(path, args.scale_sizes, cold,
                                           (64 * MiB) if args.smoke else (1 << 30), log)
            shutil.rmtree(path, ignore_errors=True)
        else:
            doc["skipped"].append("scale: --scale ''")
    finally:
        for s in systems:
            with suppress(Exception):
                await s.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.install_peers:
        rc = install_peers(python_of(args.lmcache_python or default_lmcache_python()))
        if rc:
            return rc
    base = os.path.abspath(args.dir or ".bench-tmp")
    os.makedirs(base, exist_ok=True)
    root = os.path.join(base, f"bench-{os.getpid()}-{int(time.time())}")
    os.makedirs(root)
    skipped: list[str] = []
    fio = fio_mod.find_fio(args.fio)
    if fio is None:
        skipped.append("fio: not found on PATH (apt install fio): no physical-limit "
                       "columns or kvstore/fio ratios")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    cold = Cold(args.cold, root)
    info = machine_info(root)  # after set_num_threads: records the threads in use
    info["fio"] = fio_mod.fio_version(fio) if fio else None
    res = Results()
    systems, _ = make_systems(args, skipped, root)
    # the configuration the targets are judged on: kvstore's default (engine="auto")
    headline = next(s.name for s in systems if isinstance(s, KvstoreSystem))
    doc: dict[str, Any] = {"skipped": skipped, "headline": headline}
    try:
        anyio.run(_run, args, res, systems, fio, root, cold, doc, backend="asyncio")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        with suppress(OSError):
            os.rmdir(base)  # only if empty
    info["loadavg_end"] = loadavg()
    other = [g["other_cpu_pct"] for g in res.other_cpu] or [0.0]
    doc.update({
        "command": " ".join(["python -m kvstore bench", shlex.join(list(
            argv if argv is not None else sys.argv[1:]))]).rstrip(),
        "machine": info,
        "config": {"mode": "smoke" if args.smoke else "full", "reps": args.reps,
                   "volume_bytes": args.volume, "block_sizes": args.block_sizes,
                   "iodepth": 64, "cold": cold.describe(), "cold_mode": cold.mode,
                   "extent_bytes": (64 * MiB) if args.smoke else (1 << 30),
                   "staging_bytes": (16 * MiB) if args.smoke else (256 * MiB),
                   "latency_batches": args.latency_batches, "scale_sizes": args.scale_sizes,
                   "caller_block_sizes": args.caller_block_sizes,
                   "parts": sorted(args.parts), "torch_threads": info["torch_threads"]},
        "total_seconds": time.perf_counter() - start,
        "system_order": [FIO, FIO_BUFFERED] + [s.name for s in systems],
        "systems": [s.describe() for s in systems],
        "samples": res.samples,
        "summary": report.summarise(res.samples),
        "beyond_dirty_limit": res.big,
        "latency": res.latency,
        "scale": doc.get("scale", []),
        "callers": doc.get("callers"),
        "mixed": doc.get("mixed"),
        "scale_from": doc.get("scale_from"),
        "notes": res.notes,
        "other_cpu": res.other_cpu,
        "other_cpu_pct": summary(other),
    })
    doc["targets"] = report.targets(doc)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "bench.png")
    doc["plot"] = report.plot(doc, png)
    text = report.markdown(doc)
    with open(os.path.join(args.out, "bench.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "bench.md"), "w", encoding="utf-8") as f:
        f.write(text)
    if not args.quiet:
        print(text)
        print(f"wrote {args.out}/bench.md, bench.json{', bench.png' if doc['plot'] else ''} "
              f"({doc['total_seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
