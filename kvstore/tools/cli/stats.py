"""``python -m kvstore stats PATH [--json]``: what a store holds, in human units, its
totals since creation (persisted in the index) and the processes that have it open.
Read from the index alone, beside those processes: nothing is written and no owner
registered (kvstore/tools/index_stats.py)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvstore.tools.cli.paths import require_store
from kvstore.tools.cli.units import human_bytes


def stats_document(stats: dict[str, Any]) -> dict[str, Any]:
    """What ``index_stats`` read, for --json: exact numbers, namespaces as objects."""
    doc = dict(stats)
    doc["namespaces"] = [json.loads(n) for n in stats["namespaces"]]
    return doc


def _ratio(offered: int, written: int) -> str:
    return f"{offered / written:.2f}x" if written else "-"


def format_stats(s: dict[str, Any]) -> list[str]:
    t = s["totals"]
    capacity = "not recorded (the next open applies the default rule)" \
        if s["capacity_bytes"] is None else human_bytes(s["capacity_bytes"])
    owners = s["live_owners"]
    lines = [
        f"store        {s['path']} (on-disk format {s['format_version']})",
        f"blocks       {s['blocks']} stored, {s['quarantined']} quarantined, "
        f"{s['pinned_blocks']} pinned",
        _scrub_line(s),
        f"space        {human_bytes(s['stored_bytes'])} in slots, "
        f"{human_bytes(s['free_bytes'])} free, {human_bytes(s['disk_bytes'])} on disk in "
        f"{s['extents']} extent file(s) of {human_bytes(s['extent_bytes'])}",
        f"capacity     {capacity} ({human_bytes(s['used_bytes'])} used; "
        f"{human_bytes(s['claimed_bytes'])} claimed, {human_bytes(s['pending_free_bytes'])}"
        " freed, waiting for readers)",
        "open in      " + (", ".join(f"pid {o['pid']} (owner {o['owner_id']}, "
                                     f"sync={o['sync']})" for o in owners)
                           if owners else "no process"),
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
    from kvstore.tools.index_stats import index_stats

    require_store(args.path)
    stats = index_stats(args.path)
    if args.json:
        print(json.dumps(stats_document(stats), indent=2))
    else:
        print("\n".join(format_stats(stats)))
    return 0
