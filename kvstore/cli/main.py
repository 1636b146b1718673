"""``python -m kvstore COMMAND``: a thin layer over the library.

Commands:

``fsck PATH [--repair] [--deep] [--json] [--rebuild-index]``
    Check a closed store (see :mod:`kvstore.fsck` for the numbered steps): format, extent
    files, allocation map vs index, every slot header, with ``--deep`` every payload CRC
    and free space.  ``--repair`` fixes what it finds (a second run finds nothing);
    ``--rebuild-index`` recreates the index from the self-describing extents.
    Exit 0 clean, 1 problems found (or fixed with --repair; the output says which),
    2 cannot run (store open elsewhere, unreadable index, unknown format version).
``stats PATH [--json]``
    Open the store read-mostly and print its counters, engine and space use.
``demo [--path PATH] [--quick]``
    The main job: an engine-like workload (sessions sharing system prompts) is offloaded,
    the "engine" restarts (a new process), and every session's prefix is found, loaded and
    verified.  Prints throughput and a summary table.
``bench [--smoke] [--install-peers] [--out DIR] [ARGS...]``
    From a source checkout: kvstore against fio (the physical limit) and the peers
    (LMCache local disk, file-per-block, torch.save, numpy) in one interleaved run, plus
    batch latency and open()/match_prefix scaling; writes bench.md/.json/.png
    (``benchmarks/bench.py``; ``bench --help`` lists every option).
``cuda build [--out PATH] [--archs 80;90]`` / ``cuda status [--json]``
    Compile the CUDA library with nvcc (see :mod:`kvstore.cuda.build`); say whether the
    GPU path is used and why (:func:`kvstore.cuda.stats`).

Exit codes: 0 success, 1 the command found a problem, 2 it could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import anyio


def _cmd_stats(args: argparse.Namespace) -> int:
    import kvstore

    async def run() -> int:
        async with kvstore.open(args.path, create=False) as store:
            stats = store.stats().as_dict()
        if args.json:
            print(json.dumps(stats, indent=2))
        else:
            width = max(len(k) for k in stats)
            for k, v in stats.items():
                print(f"{k:<{width}}  {v}")
        return 0

    return anyio.run(run)


def _cmd_fsck(args: argparse.Namespace) -> int:
    from kvstore import fsck
    from kvstore.cli.progress import Progress

    bars: dict[str, Progress] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if args.json or total < 1000:
            return
        bar = bars.get(stage) or bars.setdefault(stage, Progress(f"fsck: {stage}", total))
        bar.advance(done - bar.done)
        if done >= total:
            bar.close()

    if args.rebuild_index:
        report = fsck.rebuild_index(args.path, progress=progress)
    else:
        report = fsck.check(args.path, repair=args.repair, deep=args.deep, progress=progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return report.exit_code
    verb = "rebuilt index of" if args.rebuild_index else "checked"
    print(f"{verb} {report.path}: {report.blocks} blocks, {report.quarantined} quarantined, "
          f"{report.extents} extents, {report.payloads_verified} payloads verified, "
          f"{report.seconds:.2f} s")
    for f in report.findings:
        state = "FIXED" if f.fixed else "found"
        print(f"  [{state}] {f.severity:<11} {f.kind:<20} {f.detail}")
    if not report.problems:
        print("clean" if not report.findings else "clean (notes only)")
    elif report.repair:
        print(f"{len(report.problems)} problem(s) fixed "
              f"({len(report.damage)} damage, {len(report.reclaimable)} reclaimable)")
    else:
        print(f"{len(report.problems)} problem(s) found ({len(report.damage)} damage, "
              f"{len(report.reclaimable)} reclaimable); run with --repair to fix")
    return report.exit_code


def _cmd_bench(args: argparse.Namespace) -> int:
    # benchmarks/ lives next to the package in a source checkout (an editable install,
    # as the README's install line makes); it is not shipped in a wheel.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fsck", help="check (and repair) a closed store")
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
    p.set_defaults(fn=_cmd_stats)
    from kvstore.cli.demo import add_parser as add_demo

    add_demo(sub)
    p = sub.add_parser("bench", help="benchmark against fio and the peers (source checkout)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=_cmd_bench)
    p = sub.add_parser("cuda", help="build the CUDA library / show whether it is used")
    p.add_argument("action", choices=["build", "status"])
    p.add_argument("--out", help="where to write libkvcuda.so (default: see kvstore.cuda.build)")
    p.add_argument("--archs", help="compute capabilities, e.g. '80;89;90'")
    p.add_argument("--json", action="store_true", help="machine-readable status")
    p.set_defaults(fn=_cmd_cuda)
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw[:1] == ["bench"]:  # every option belongs to benchmarks/bench.py (argparse's
        # REMAINDER would refuse a leading "--smoke")
        return _cmd_bench(argparse.Namespace(rest=raw[1:]))
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except Exception as e:  # noqa: BLE001 - a CLI reports, it does not dump traces
        from kvstore.errors import KVStoreError

        if isinstance(e, (KVStoreError, OSError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
