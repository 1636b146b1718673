"""python -m kvstore COMMAND: a thin layer over the library.

commands:
  fsck PATH [--repair] [--deep] [--json] [--rebuild-index]
      Check a store, beside processes that have it open (the check shares its lock and
      writes nothing; --repair and --rebuild-index need it closed everywhere and name the
      pids using it) (the numbered steps are in kvstore/tools/fsck.py): format, extent
      files, allocation map vs index, every slot header, every quarantined block read
      again whole (--repair puts back what verifies, never erases it); with --deep also
      every payload's CRC32C and free space. --repair fixes what it finds (a second run finds nothing);
      --rebuild-index recreates the index from the self-describing extent files.
      What cannot be read (an I/O error: an extent header, a slot, free space) is a
      finding with its errno, never written over by --repair. Exit 0 clean, 1 problems
      found (or fixed with --repair; the output says which were not), 2 cannot run (no
      store there, store open elsewhere for --repair/--rebuild-index, unreadable index,
      unknown format version).
  scrub PATH [--rate R] [--restart] [--json]
      Read every stored block again and verify it (header, payload CRC32C), and every
      quarantined one, at a bounded rate (default 64M bytes/s; 0: none), with a progress
      bar; quarantines what fails, puts back what verifies (kvstore/tools/cli/scrub.py).
      Resumes where an earlier scrub stopped (--restart: a fresh pass). Exit 0 all
      verified, 1 blocks failed (now quarantined), 2 cannot run, 130 interrupted.
  stats PATH [--json]
      Print what the store holds, its totals since it was created (puts, dedup,
      evictions, corruption) and the processes that have it open (read from the index
      beside them: nothing written, no owner registered). --json: exact numbers.
  demo [--path PATH] [--quick] [--remove]
      The main job: an engine-like workload (sessions sharing system prompts) is
      offloaded, the "engine" restarts (a new process), and every session's prefix is
      found, loaded and verified. Prints throughput, where the data is and how to
      remove it.
  bench [--smoke] [--install-peers] [--out DIR] [ARGS...]
      From a source checkout: kvstore against fio (the physical limit) and the peers
      (LMCache local disk, file-per-block, torch.save, numpy) in one interleaved run, plus
      batch latency, open()/match_prefix scaling, one vs 4 concurrent callers with CPU
      cost, and get latency under a put stream; writes bench.md/.json/.png
      (benchmarks/bench.py; bench --help lists every option).
  remote check PATH --bucket B [--endpoint URL] [--prefix P] [--hmac-key-file F]
               [--sample N | --all] [--json]
      Verify remote-tier objects of the store's namespaces in the S3 bucket (a random
      sample, or all): CRC32C, key, and the HMAC tag with --hmac-key-file
      (kvstore/tiers/remote/check.py). Credentials from the AWS environment. fsck never
      looks at the remote. Exit 0 all good, 1 bad objects listed, 2 cannot run.
  cuda build [--out PATH] [--archs 80;90] / cuda status [--json]
      Compile the CUDA library with nvcc (kvstore/cuda/build.py); say whether the GPU
      path is used and why.

Exit codes: 0 success, 1 the command found a problem, 2 it could not run,
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvstore.tools.cli.paths import CliError, require_store
from kvstore.tools.cli.stats import cmd_stats

# fsck's progress stages the CLI draws, and how: --deep's one bar is over payload bytes
# (the slow part); the free-space scan that follows has no bar of its own.
_BARS = {"payloads": ("fsck --deep: payloads", "bytes", 256 << 20),
         "slots": ("fsck: slot headers", " slots", 1000),
         "extents": ("rebuild-index: extents", "bytes", 256 << 20)}


def _cmd_fsck(args: argparse.Namespace) -> int:
    from kvstore.tools import fsck
    from kvstore.tools.cli.progress import Progress

    bars: dict[str, Progress] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if args.json or stage not in _BARS:
            return
        label, unit, least = _BARS[stage]
        if total < least:
            return
        bar = bars.get(stage) or bars.setdefault(stage, Progress(label, total, unit))
        bar.advance(done - bar.done)
        if done >= total:
            bar.close()

    if args.rebuild_index:
        if not os.path.exists(args.path):
            raise CliError(f"{args.path} does not exist (no such directory)")
        if not os.path.isdir(args.path):
            raise CliError(f"{args.path} is a file, not a store directory")
        report = fsck.rebuild_index(args.path, progress=progress)
    else:
        require_store(args.path)
        report = fsck.check(args.path, repair=args.repair, deep=args.deep, progress=progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return report.exit_code
    verb = "rebuilt index of" if args.rebuild_index else "checked"
    print(f"{verb} {report.path}: {report.blocks} blocks, {report.quarantined} quarantined, "
          f"{report.extents} extents, {report.payloads_verified} payloads verified, "
          f"{report.seconds:.2f} s")
    if report.slots_changed:
        print(f"  {report.slots_changed} slot(s) failed after live processes changed their "
              "keys since the index was read: not damage")
    for f in report.findings:
        state = "FIXED" if f.fixed else "found"
        print(f"  [{state}] {f.severity:<11} {f.kind:<20} {f.detail}")
    if not report.problems:
        print("clean" if not report.findings else "clean (notes only)")
    elif report.repair:
        left = sum(not f.fixed for f in report.problems)  # unreadable, foreign, failed
        print(f"{len(report.problems) - left} problem(s) fixed"
              + (f", {left} left as it was" if left else "")
              + f" ({len(report.damage)} damage, {len(report.reclaimable)} reclaimable)")
    else:
        print(f"{len(report.problems)} problem(s) found ({len(report.damage)} damage, "
              f"{len(report.reclaimable)} reclaimable); run with --repair to fix")
    return report.exit_code


def _cmd_bench(args: argparse.Namespace) -> int:
    # benchmarks/ lives next to the package in a source checkout (an editable install,
    # as the README's install line makes); it is not shipped in a wheel.
    root = str(Path(__file__).resolve().parents[3])  # kvstore/tools/cli/main.py -> the checkout
    if not os.path.exists(os.path.join(root, "benchmarks", "bench.py")):
        print("benchmarks/ is not installed with the package; run from a source checkout "
              "(pip install -e .)", file=sys.stderr)
        return 2
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import bench  # type: ignore[import-not-found, unused-ignore]

    return int(bench.main(args.rest))


def _cmd_cuda(args: argparse.Namespace) -> int:
    if args.action == "build":
        from pathlib import Path

        from kvstore.cuda.build import BuildError, build

        archs = tuple(a for a in args.archs.replace(",", ";").split(";") if a) if args.archs \
            else None
        try:
            res = build(Path(args.out) if args.out else None, archs)
        except BuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"built {res.path} for sm_{', sm_'.join(res.archs)} (+ PTX) in {res.seconds:.1f} s")
        print("kvstore finds it there; elsewhere set KVSTORE_CUDA_LIB to its path")
        return 0
    from kvstore import cuda

    info = cuda.stats()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{info['path']}: {info['reason']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from kvstore import __version__
    from kvstore.disk.format import FORMAT_VERSION

    parser.add_argument("--version", action="version",
                        version=f"kvstore {__version__} (on-disk format {FORMAT_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fsck", help="check a store (beside live processes), repair a closed one")
    p.add_argument("path")
    p.add_argument("--repair", action="store_true", help="fix what is found")
    p.add_argument("--deep", action="store_true", help="verify every payload and scan free space")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--rebuild-index", action="store_true",
                   help="recreate the index from the extent files")
    p.set_defaults(fn=_cmd_fsck)
    p = sub.add_parser("stats", help="print a store's statistics")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_stats)
    from kvstore.tools.cli.scrub import add_parser as add_scrub

    add_scrub(sub)
    from kvstore.tools.cli.demo import add_parser as add_demo

    add_demo(sub)
    p = sub.add_parser("bench", help="benchmark against fio and the peers (source checkout)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=_cmd_bench)
    from kvstore.tools.cli.remote import add_parser as add_remote

    add_remote(sub)
    p = sub.add_parser("cuda", help="build the CUDA library / show whether it is used")
    p.add_argument("action", choices=["build", "status"])
    p.add_argument("--out", help="where to write libkvcuda.so (default: see kvstore.cuda.build)")
    p.add_argument("--archs", help="compute capabilities, e.g. '80;89;90'")
    p.add_argument("--json", action="store_true", help="machine-readable status")
    p.set_defaults(fn=_cmd_cuda)
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw[:1] == ["bench"]:  # every option belongs to benchmarks/bench.py (argparse's
        # REMAINDER would refuse a leading "--smoke")
        return _run(_cmd_bench, argparse.Namespace(rest=raw[1:]))
    args = parser.parse_args(argv)
    return _run(args.fn, args)


def _run(fn: Any, args: argparse.Namespace) -> int:
    """Run a command; errors become one line (JSON with --json), Ctrl-C exit 130."""
    try:
        return int(fn(args))
    except BaseException as e:  # noqa: BLE001 - a CLI reports, it does not dump traces
        from kvstore.errors import KVStoreError

        if _interrupted(e):
            if getattr(args, "reload_only", False):
                return 130  # the demo's reload process: its parent says it once
            path = getattr(args, "path", None)
            print("\ninterrupted" + (f"; the store is consistent: run `python -m kvstore fsck "
                                     f"{path}` to check" if path else ""), file=sys.stderr)
            return 130
        if isinstance(e, BrokenPipeError):  # `... | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if not isinstance(e, (CliError, KVStoreError, OSError)):
            raise
        message = _describe(e)
        if getattr(args, "json", False):
            print(json.dumps({"error": message, "exit_code": 2}, indent=2))
        else:
            print(f"error: {message}", file=sys.stderr)
        return 2


def _interrupted(e: BaseException) -> bool:
    """Ctrl-C, possibly wrapped in the exception group of a task group."""
    inner = getattr(e, "exceptions", None)
    if inner is not None and not isinstance(e, KeyboardInterrupt):
        return bool(inner) and all(_interrupted(x) for x in inner)
    return isinstance(e, KeyboardInterrupt)


def _describe(e: BaseException) -> str:
    """The message of an error, without Python's ``[Errno N]`` prefix."""
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if isinstance(e.filename, str) else None
        return f"{where}: {e.strerror}" if where else e.strerror
    return str(e)
