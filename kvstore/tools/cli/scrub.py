"""``python -m kvstore scrub PATH [--rate R] [--restart] [--json]``: read every stored
block of a store again and verify it (slot header against its index entry, payload
CRC32C), read every quarantined block again, at a bounded rate (``Store.scrub``,
kvstore/core/scrub.py).  What fails is quarantined (a miss from then on, listed by fsck);
a quarantined block that verifies is put back.  It resumes where an earlier scrub of the
store stopped (interrupted, or the store's background scrub), ``--restart`` starts a
fresh pass.  The store must not be open elsewhere (it takes the store's lock, as fsck).

Exit codes: 0 every block checked verified, 1 blocks failed (now quarantined), 2 it
could not run, 130 interrupted (its place is saved: run it again to go on).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import anyio

from kvstore.tools.cli.paths import require_store
from kvstore.tools.cli.units import human_bytes

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_rate(text: str) -> float | None:
    """``64M`` -> 64 MiB/s (K, M, G, T: binary units; an optional ``i``, ``B`` and
    ``/s``); ``0`` -> None (no bound)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?(?:/s)?\s*", text, re.IGNORECASE)
    if found is None:
        raise argparse.ArgumentTypeError(
            f"rate {text!r}: give bytes per second, e.g. 64M, 500M, 1G (0: no bound)")
    rate = float(found.group(1)) * _UNITS[found.group(2).upper()]
    return rate or None


def add_parser(sub: Any) -> None:
    from kvstore.core.scrub import DEFAULT_SCRUB_BYTES_PER_S

    default = f"{DEFAULT_SCRUB_BYTES_PER_S >> 20}M"
    p = sub.add_parser("scrub", help="verify every stored block (resumes where it stopped)")
    p.add_argument("path")
    p.add_argument("--rate", type=parse_rate, default=parse_rate(default),
                   help=f"bytes read per second, e.g. 64M, 1G; 0: no bound (default {default})")
    p.add_argument("--restart", action="store_true",
                   help="start a fresh pass instead of resuming an interrupted one")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(fn=cmd_scrub)


def cmd_scrub(args: argparse.Namespace) -> int:
    import kvstore
    from kvstore.tools.cli.progress import Progress

    require_store(args.path)
    bars: list[Progress] = []

    def progress(done: int, total: int) -> None:
        if args.json:
            return
        if not bars:
            bars.append(Progress("scrub", total, " blocks"))
            bars[0].advance(done)  # a resumed pass starts part-way
            return
        bars[0].advance(done - bars[0].done)

    async def run() -> dict[str, Any]:
        async with kvstore.open(args.path, create=False) as store:
            report = await store.scrub(rate_bytes_per_s=args.rate, progress=progress,
                                       restart=args.restart)
            if bars:
                bars[0].close()
            stats = store.stats()
            return {**report.as_dict(), "quarantined": stats.quarantined,
                    "blocks": stats.blocks}

    try:
        doc = anyio.run(run)
    except KeyboardInterrupt:
        print(f"\ninterrupted; its place is saved: `python -m kvstore scrub {args.path}` "
              "goes on from there", file=sys.stderr)
        return 130
    code = 1 if doc["failed_blocks"] else 0
    if args.json:
        print(json.dumps({**doc, "path": args.path, "exit_code": code}, indent=2))
        return code
    print(f"scrubbed {args.path}: {doc['checked_blocks']} blocks "
          f"({human_bytes(doc['checked_bytes'])}) checked"
          f"{' (resumed)' if doc['resumed'] else ''}, {doc['failed_blocks']} failed, "
          f"{doc['rechecked_blocks']} quarantined read again, {doc['restored_blocks']} "
          f"restored, {doc['seconds']:.2f} s")
    print(f"now {doc['blocks']} blocks stored, {doc['quarantined']} quarantined"
          + (f"; `python -m kvstore fsck {args.path}` lists them" if doc["quarantined"] else ""))
    return code
