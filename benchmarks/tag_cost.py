"""What per-block tags cost the index writer (``put_many(tags=)``, kvstore/index/tags.py).

    python benchmarks/tag_cost.py [--dir /dev/shm] [--rounds 400] [--tag 256]
                                  [--out-dir benchmarks/results]

The tags table is touched inside the writer's transactions: a row written with each
block's index entry, looked up (and deleted) when a block leaves, read for the events
while a subscriber listens.  This measures that work alone, without I/O: one LMDB index
(``sync=False``) beside 20 000 stored blocks, and rounds of one write transaction that
indexes a chain of 16 blocks and removes them again (``add_block`` then ``remove_block``
as an eviction does; aborted, so the index stays the same size), timed with the thread's
CPU clock.  Four modes, interleaved round by round (order reversed every other round so
that drift favours none): no tags / ``--tag``-byte tags, each with the event journal off
and on.  Reported: the median and p10 of the writer's CPU microseconds per block.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from benchmarks.common import head_commit, machine_info, write_results  # noqa: E402
from kvstore.disk.format import IndexEntry  # noqa: E402
from kvstore.index.index import Index  # noqa: E402
from kvstore.index.journal import Journal  # noqa: E402

BATCH = 16
BESIDE = 20_000


def _entry(i: int, parent: bytes | None) -> IndexEntry:
    return IndexEntry(extent=1, offset=4096 * (i + 1), slot_len=4096, payload_len=64,
                      raw_len=64, codec=0, dtype=0, payload_crc=0, seq=i, last_use=i,
                      parent=parent)


class _Rounds:
    def __init__(self, index: Index) -> None:
        self.index, self.next_key = index, 0

    def run(self, tag: bytes | None, journal: bool) -> float:
        """One round; the writer's CPU seconds per block."""
        index = self.index
        keys = [(self.next_key + i).to_bytes(16, "big") for i in range(BATCH)]
        self.next_key += BATCH
        entries = [_entry(i, keys[i - 1] if i else None) for i in range(BATCH)]
        index.journal = Journal() if journal else None
        started = time.thread_time()
        with index.env.begin(write=True) as txn:
            for key, entry in zip(keys, entries):
                index.add_block(txn, key, entry, tag=tag)
            for key, entry in zip(reversed(keys), reversed(entries)):
                index.remove_block(txn, key, entry, quarantine=False, evicted=True)
            txn.abort()
        index.journal = None
        return (time.thread_time() - started) / BATCH


def measure(root: str, rounds: int, tag_bytes: int) -> dict[str, Any]:
    index = Index(os.path.join(root, "index"), map_size=1 << 30, sync=False)
    try:
        with index.env.begin(write=True) as txn:
            for i in range(BESIDE):
                index.add_block(txn, (1 << 64 | i).to_bytes(16, "big"), _entry(i, None))
        modes = {"none": None, "tagged": b"t" * tag_bytes}
        runs: dict[str, list[float]] = {}
        work = _Rounds(index)
        plan = [(name, journal) for name in modes for journal in (False, True)]
        for r in range(rounds):
            for name, journal in plan if r % 2 else plan[::-1]:
                runs.setdefault(f"{name} journal={'on' if journal else 'off'}", []).append(
                    work.run(modes[name], journal))
    finally:
        index.close()
    info = machine_info(root)
    return {
        "command": " ".join(["python benchmarks/tag_cost.py", *sys.argv[1:]]),
        "commit": head_commit(HERE), "rounds": rounds,
        "machine": f"{info['nproc']} CPUs ({info['cpu']}), kernel {info['kernel']}, "
                   f"{info['fs_type']} on {info['fs_device']}, load {info['loadavg_start']}",
        "batch": BATCH, "beside": BESIDE, "tag_bytes": tag_bytes,
        "us_per_block": {mode: {"median": 1e6 * statistics.median(v),
                                "p10": 1e6 * sorted(v)[len(v) // 10]}
                         for mode, v in runs.items()},
    }


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"# What per-block tags cost the index writer, at {doc['commit']}",
        "",
        f"`{doc['command']}` — {doc['machine']}.",
        "",
        f"{doc['rounds']} rounds per mode, each one write transaction indexing a chain of "
        f"{doc['batch']} blocks and removing them (as eviction does) beside "
        f"{doc['beside']} stored blocks; tags of {doc['tag_bytes']} bytes; the writer "
        "thread's CPU time per block (index calls only, no I/O, no commit).",
        "",
        "| mode | median µs/block | p10 µs/block |",
        "|---|---:|---:|",
    ]
    for mode, v in doc["us_per_block"].items():
        lines.append(f"| {mode} | {v['median']:.2f} | {v['p10']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dir", default=None, help="scratch directory (default: /dev/shm or /tmp)")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--tag", type=int, default=256, help="bytes of each tag")
    p.add_argument("--out-dir", default=None, help="write tag_cost_at_<commit>.md/.json")
    args = p.parse_args(argv)
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="tag-cost-", dir=base)
    try:
        doc = measure(root, args.rounds, args.tag)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = render(doc)
    print(text)
    if args.out_dir:
        write_results(os.path.join(args.out_dir, f"tag_cost_at_{doc['commit']}"), text, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
