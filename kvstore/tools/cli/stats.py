"""``python -m kvstore stats PATH [--json]``: what a store holds, in human units, its
totals since creation (persisted in the index), and the per-process counters, labelled."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio

from kvstore.tools.cli.paths import require_store
from kvstore.tools.cli.units import human_bytes

# Per-process counters: what the Store object opened by this command did (a stats
# command opens the store afresh, so they are 0 there; a library caller's stats() has
# its own). The store's history is in StoreStats.totals.
_THIS_PROCESS = ("puts", "put_blocks", "put_bytes", "put_payload_bytes", "dedup_blocks",
                 "dedup_bytes", "dedup_ratio", "compression_ratio", "gets", "hits", "misses",
                 "read_bytes", "corrupt_blocks", "read_errors", "deletes", "evicted_blocks",
                 "evicted_bytes", "commits", "peak_used_bytes", "read_retries",
                 "quarantined_blocks", "restored_blocks", "scrubbed_blocks", "scrubbed_bytes",
                 "scrub_failed_blocks", "scrub_passes")


def stats_document(stats: dict[str, Any]) -> dict[str, Any]:
    """``StoreStats.as_dict()`` for --json: exact numbers, namespaces as objects, the
    per-process counters under ``this_process``."""
    doc = {k: v for k, v in stats.items() if k not in _THIS_PROCESS}
    doc["namespaces"] = [json.loads(n) for n in stats["namespaces"]]
    doc["this_process"] = {k: stats[k] for k in _THIS_PROCESS}
    return doc


def _ratio(offered: int, written: int) -> str:
    return f"{offered / written:.2f}x" if written else "-"


def format_stats(s: dict[str, Any]) -> list[str]:
    t = s["totals"]
    lines = [
        f"store        {s['path']}",
        f"engine       {s['engine']}{' + O_DIRECT' if s['o_direct'] else ''} "
        f"({s['engine_reason']})",
        f"blocks       {s['blocks']} stored, {s['quarantined']} quarantined, "
        f"{s['pinned_blocks']} pinned",
        _scrub_line(s),
        f"space        {human_bytes(s['stored_bytes'])} in slots, "
        f"{human_bytes(s['free_bytes'])} free, {human_bytes(s['disk_bytes'])} on disk in "
        f"{s['extents']} extent file(s) of {human_bytes(s['extent_bytes'])}",
        f"capacity     {human_bytes(s['capacity_bytes'])} "
        f"({human_bytes(s['used_bytes'])} used)",
        f"state        {'read-only: ' + str(s['read_only_reason']) if s['read_only'] else 'writable'}"
        f", {'durable (fdatasync + LMDB fsync)' if s['durable'] else 'sync=False'}",
        "namespaces" + ("   none recorded" if not s["namespaces"] else ""),
        *[f"  {n}" for n in s["namespaces"]],
        "",
        "since the store was created (all processes; kept in the index):",
        f"  puts       {t['puts']} batches, {t['put_blocks']} blocks written "
        f"({human_bytes(t['put_bytes'])})",
        f"  dedup      {t['dedup_blocks']} blocks ({human_bytes(t['dedup_bytes'])}) not written "
        f"again; offered / written {_ratio(t['put_bytes'] + t['dedup_bytes'], t['put_bytes'])}",
        f"  evicted    {t['evicted_blocks']} blocks ({human_bytes(t['evicted_bytes'])})",
        f"  corrupt    {t['corrupt_blocks']} blocks failed verification when read",
        "",
        "this process (the store as opened by this command, so mostly 0):",
        f"  gets {s['gets']}, hits {s['hits']}, misses {s['misses']}, "
        f"read {human_bytes(s['read_bytes'])}, puts {s['puts']}, commits {s['commits']}",
    ]
    return lines


def _scrub_line(s: dict[str, Any]) -> str:
    """When the scrub last checked every block, and how far the pass in progress is."""
    last = s["scrub_last_complete"]
    when = "never" if last is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last))
    going = f"; the pass in progress is {s['scrub_progress']:.0%} through" \
        if s["scrub_progress"] else ""
    return f"scrub        last complete pass: {when}{going}"


def cmd_stats(args: argparse.Namespace) -> int:
    import kvstore

    require_store(args.path)

    async def run() -> dict[str, Any]:
        async with kvstore.open(args.path, create=False) as store:
            return store.stats().as_dict()

    stats = anyio.run(run)
    if args.json:
        print(json.dumps(stats_document(stats), indent=2))
    else:
        print("\n".join(format_stats(stats)))
    return 0
