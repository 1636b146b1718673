"""Where a durable put spends its time: the wall-clock split of ``put_many`` into its
phases, and (with ``--py-spy``) an on-CPU sampling profile summarised by what the code
was doing.

    python benchmarks/profile_put.py [TREE] [--block 2M] [--mib 256] [--batch 32] [--py-spy]
        [--ceiling]

``TREE`` is the kvstore tree to import (default: this one), so the same command
profiles an older commit's worktree.  One caller, a fresh store (``kvstore.open``
defaults: ``sync=True``, the engine the probe picks), batches of ``--batch`` blocks
chained one after another, as the bench's 1-caller run.

Phases (wall time inside ``put_many``, summed over the batches): ``stage+write``
(staging into the arena and the device writes, pipelined per chunk), ``fdatasync``
(the extent data made durable), ``commit`` (the LMDB transaction, fsynced), and
``other`` (the rest of ``put_many``: validation, dedup lookup, reservation).  They are
found by timing the store's own calls, so a tree lacking one (older layout) shows it
under ``other``.

With ``--ceiling`` fio runs before and after the workload (same directory, block size,
``--iodepth`` = batch, ``--end_fsync=1``), and the report adds what the commit protocol
alone allows one caller: per batch the device must write the batch (at fio's rate) and
then the store must fdatasync and commit (the two phases as measured), one after the
other, before the caller's next batch exists.  ``ceiling = t_fio / (t_fio + fdatasync +
commit)`` per batch, with staging and every other CPU cost taken as zero: no one-caller
put at this block size can reach more of fio than that without a different commit
protocol.

With ``--py-spy`` the same workload runs under ``py-spy record --format raw`` (every
thread, on-CPU samples only; Python frames only: ``--native`` unwinding slowed the run
several-fold and inflated torch-heavy frames; time in a GIL-free native call shows
under the Python frame that made it) and the samples are grouped by the innermost frame that
names a known activity: staging/CRC (native or Python), device I/O submission, LMDB,
the put path's Python, the event loop, other.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (category, substrings of a frame "function (file)" that identify it), innermost wins
CATEGORIES = [
    ("staging: copy + CRC32C + header (native kernels)", ("stage_all", "_stage_native",
                                                          "native_slots", "stage_slots")),
    ("staging: Python fallback / torch copies", ("copy_", "crc32c", "build_header",
                                                 "stage_slot", "host_bytes")),
    ("LMDB commit (writer thread)", ("commit_puts", "_commit (kvstore/index/index.py)",
                                     "IndexWriter", "add_block", "take_range")),
    ("device I/O submission / reaping", ("uring.py", "threads.py", "_submit", "_reap")),
    ("page faults / zeroing (arena)", ("arena.py",)),
    ("put path Python (store, allocator, transfers)", ("store.py", "allocator.py",
                                                       "transfers.py", "slots.py")),
    ("event loop / anyio", ("asyncio", "anyio", "selectors", "trio")),
]


SKIP_FRAMES = ("_find_and_load", "Store.__init__", "acquire_lock", "cond_wait",
               "cond_timedwait", "epoll_wait", "select (", "_queue_SimpleQueue_get",
               "sem_wait", "Event.wait", "Condition.wait")
# Innermost frames that are a wait in C with no Python frame below (py-spy without
# --native still counts them on-CPU): the index writer's queue.SimpleQueue.get().
# Counted, the idle writer thread showed as "LMDB commit", 40% of a 64 KiB put's samples.
IDLE_LEAVES = ("IndexWriter._run (",)


def run_workload(tree: str, block: int, volume: int, batch: int) -> dict[str, float]:
    sys.path.insert(0, tree)
    import anyio
    import torch

    import kvstore

    assert kvstore.__file__.startswith(tree), kvstore.__file__
    phases: dict[str, float] = collections.defaultdict(float)

    def timed(obj: object, name: str, label: str) -> None:
        orig = getattr(obj, name, None)
        if orig is None:
            return

        async def wrapper(*args: object, **kwargs: object) -> object:
            t = time.perf_counter()
            try:
                return await orig(*args, **kwargs)
            finally:
                phases[label] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    n = max(batch, volume // block)
    ns = kvstore.Namespace(model="profile-put", dtype="uint8", block_size=1)
    keys = ns.chain_keys(list(range(n)))
    values = [torch.randint(0, 255, (block,), dtype=torch.uint8) for _ in range(batch)]

    def _parts(store: Any) -> Any:
        """The store's parts: through kvstore.testing, or (a tree from before it) the
        store's own attributes."""
        try:
            from kvstore.testing import parts
        except ImportError:
            return store
        return parts(store)

    async def main() -> float:
        root = os.path.join(HERE, ".bench-tmp")
        os.makedirs(root, exist_ok=True)
        path = tempfile.mkdtemp(prefix="profile-put-", dir=root)
        try:
            async with kvstore.open(path, namespace=ns, create=True) as store:
                await store.put(ns.chain_keys([n + 1])[0], torch.zeros(16, dtype=torch.uint8))
                inner = _parts(store)
                timed(getattr(inner, "transfers", None) or store, "write", "stage+write")
                timed(getattr(inner, "syncs", None) or inner.engine, "datasync", "fdatasync")
                timed(inner.writer, "run", "commit")
                inside = 0.0
                t0 = time.perf_counter()
                for i in range(0, n, batch):
                    ks = keys[i:i + batch]
                    t = time.perf_counter()
                    await store.put_many(ks, values[:len(ks)], parents=kvstore.chain_parents(
                        ks, first_parent=keys[i - 1] if i else None))
                    inside += time.perf_counter() - t
                wall = time.perf_counter() - t0
        finally:
            shutil.rmtree(path, ignore_errors=True)
        phases["other"] = inside - sum(v for k, v in phases.items() if k != "other")
        phases["wall"] = wall
        return wall

    anyio.run(main)
    return dict(phases)


def fio_seconds(block: int, volume: int, iodepth: int) -> float:
    """fio's durable write of ``volume`` in ``block`` requests, in the bench's directory."""
    from benchmarks.fio import find_fio, remove, run_fio

    fio = find_fio()
    if fio is None:
        raise SystemExit("--ceiling needs fio (apt-get install fio)")
    root = os.path.join(HERE, ".bench-tmp")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "profile-put-fio")
    try:
        return run_fio(fio, path, "write", block, volume, iodepth)
    finally:
        remove(path)


def summarise_raw(path: str) -> list[tuple[str, int]]:
    counts: collections.Counter[str] = collections.Counter()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, num = line.rstrip("\n").rpartition(" ")
            if not num.isdigit():
                continue
            frames = stack.split(";")
            # only the workload, on CPU: stacks through kvstore's code, not imports or the
            # store's opening, not a thread waiting (py-spy --native keeps some of those)
            if not any("kvstore/" in fr for fr in frames) or \
                    any(m in fr for fr in frames for m in SKIP_FRAMES) or \
                    any(frames[-1].startswith(m) for m in IDLE_LEAVES):
                continue
            label = "other"
            for frame in reversed(frames):  # innermost first
                hit = next((cat for cat, keys in CATEGORIES if any(k in frame for k in keys)),
                           None)
                if hit is not None:
                    label = hit
                    break
            counts[label] += int(num)
    return counts.most_common()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree", nargs="?", default=HERE)
    p.add_argument("--block", default="2M")
    p.add_argument("--mib", type=float, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--py-spy", action="store_true", help="also sample on-CPU stacks")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--ceiling", action="store_true",
                   help="also time fio and report the commit protocol's one-caller ceiling")
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from benchmarks.common import parse_size

    tree, block = os.path.abspath(args.tree), parse_size(args.block)
    volume = int(args.mib * (1 << 20))
    fio_s = [fio_seconds(block, volume, args.batch)] if args.ceiling else []
    phases = run_workload(tree, block, volume, args.batch)
    if args.ceiling:
        fio_s.append(fio_seconds(block, volume, args.batch))
    wall = phases.pop("wall")
    print(f"tree {tree}: {block >> 10} KiB blocks, {volume >> 20} MiB, batches of "
          f"{args.batch}: {volume / wall / 1e6:.0f} MB/s")
    for name, secs in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {name:12s} {secs * 1e3:8.0f} ms  {100 * secs / wall:5.1f}% of wall")
    if fio_s:
        batches = max(1, volume // (block * args.batch))
        device = sum(fio_s) / len(fio_s) / batches
        protocol = (phases.get("fdatasync", 0.0) + phases.get("commit", 0.0)) / batches
        print(f"  fio write (--end_fsync=1, iodepth {args.batch}): "
              + ", ".join(f"{volume / t / 1e6:.0f}" for t in fio_s) + " MB/s; "
              f"kvstore / fio {device * batches / wall:.2f}")
        print(f"  per batch: device {device * 1e3:.2f} ms at fio's rate, fdatasync + commit "
              f"{protocol * 1e3:.2f} ms -> one-caller ceiling "
              f"{device / (device + protocol):.2f}x fio (staging and Python free)")
    if args.py_spy and not os.environ.get("PROFILE_PUT_CHILD"):
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        out = tempfile.mktemp(suffix=".txt")
        cmd = [spy, "record", "--format", "raw", "--rate", str(args.rate), "--threads",
               "-o", out, "--", sys.executable, os.path.abspath(__file__), tree,
               "--block", args.block, "--mib", str(args.mib), "--batch", str(args.batch)]
        subprocess.run(cmd, check=True, env={**os.environ, "PROFILE_PUT_CHILD": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = summarise_raw(out)
        total = sum(c for _, c in rows) or 1
        print(f"  on-CPU samples ({total}, every thread):")
        for label, c in rows:
            print(f"    {100 * c / total:5.1f}%  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
