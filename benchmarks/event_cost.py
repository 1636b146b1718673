"""What one event subscriber costs durable puts (DESIGN target: <= 2%).

    python benchmarks/event_cost.py [--dir DIR] [--block 1M] [--batch 16] [--callers 2]
                                    [--capacity 1G] [--seconds 3] [--reps 10]
                                    [--no-sync] [--tags BYTES]
                                    [--out-dir benchmarks/results]

One store of ``--capacity`` bytes (the default engine: io_uring and O_DIRECT where they
work; ``sync=True``, so every put is fdatasynced and committed before it returns).  Each
repetition runs the same put stream twice for ``--seconds``, in the same process, once
with no subscriber (the baseline) and once with one ``Store.subscribe()`` whose consumer
task, on the same event loop, reads every event as it comes (its cost is counted too), in
alternating order (A B, B A, ...) so that drift favours neither.  The stream:
``--callers`` tasks, each putting batches of ``--batch`` new ``--block`` blocks (chained)
back to back; the store is filled to capacity first, so the puts also evict, and the
subscriber sees evicted events beside stored ones.

Reported per repetition: put throughput with the subscriber / without (the cost is
1 - that ratio), the process's CPU time per GB put both ways (what the events add in
work, which the disk's own variance does not blur), the share of the stream's time the
index writer's thread spent (its CPU clock) handing events to the subscription (``EventHub.publish``: the part
of the cost on every put's path; the journal's appends inside the index's own calls are
not in it), and the events the subscriber read;
then min / median / max of the ratios.  Results go to ``--out-dir/event_put_cost_<block>_at_<commit>.md`` and ``.json``.

``--tags BYTES`` gives every block put in the stream a tag of that many bytes
(``put_many(tags=)``: a row of the index's ``tags`` table, written in the put's commit,
dropped when the block is evicted, carried by its events).

``--no-sync --dir /dev/shm`` takes the disk out: puts then cost only CPU (staging, CRC32C,
the index commit), the case where the events' own CPU shows most.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import anyio  # noqa: E402
import torch  # noqa: E402

import kvstore  # noqa: E402
from benchmarks.common import (  # noqa: E402
    head_commit,
    in_scratch,
    machine_info,
    parse_size,
    scratch_dir,
    summary,
    write_results,
)
from kvstore.testing import parts  # noqa: E402

MIB = 1 << 20
_serial = itertools.count()


def _batch_keys(n: int) -> list[bytes]:
    base = next(_serial)
    return [base.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(n)]


async def _stream(store: kvstore.Store, args: argparse.Namespace, value: torch.Tensor,
                  subscribed: bool) -> dict[str, float]:
    """The put stream for ``args.seconds``, with one consuming subscriber if asked."""
    put = [0]
    seen = [0]
    deadline = time.perf_counter() + args.seconds
    tag = b"t" * args.tags

    async def caller() -> None:
        while time.perf_counter() < deadline:
            keys = _batch_keys(args.batch)
            await store.put_many(keys, [value] * len(keys), parents=kvstore.chain_parents(keys),
                                 tags=[tag] * len(keys) if tag else None)
            put[0] += len(keys) * args.block

    async def consumer(sub: kvstore.Subscription) -> None:
        async for _ in sub:
            seen[0] += 1

    hub, publishing = parts(store).events, [0.0]
    publish = hub.publish

    def timed_publish(records: Any) -> None:  # the writer thread's CPU time in the hub
        # (its CPU clock, not the wall's: a wait for the GIL is another thread's work)
        t = time.thread_time()
        publish(records)
        publishing[0] += time.thread_time() - t

    started, cpu = time.perf_counter(), time.process_time()
    async with anyio.create_task_group() as tg:
        sub = store.subscribe() if subscribed else None
        if sub is not None:
            hub.publish = timed_publish  # type: ignore[method-assign]
            await sub.__aenter__()
            tg.start_soon(consumer, sub)
        async with anyio.create_task_group() as callers:
            for _ in range(args.callers):
                callers.start_soon(caller)
        if sub is not None:
            sub.close()  # the consumer reads what is left, then ends
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    vars(hub).pop("publish", None)
    return {"put_MBps": put[0] / elapsed / 1e6, "events": seen[0],
            "cpu_s_per_GB": cpu / (put[0] / 1e9), "publish_share": publishing[0] / elapsed}


async def measure(root: str, args: argparse.Namespace) -> dict[str, Any]:
    value = torch.randint(0, 256, (args.block,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    async with kvstore.open(os.path.join(root, "store"), capacity_bytes=args.capacity,
                            sync=args.sync,
                            extent_bytes=min(args.capacity, 1 << 30),
                            staging_bytes=max(64 * MIB, 4 * args.batch * args.block)) as store:
        p = parts(store)
        engine = f"{p.engine.name}{' + O_DIRECT' if p.engine.direct else ''}"
        while store.used_bytes + args.batch * args.block <= args.capacity:  # to capacity
            keys = _batch_keys(args.batch)
            await store.put_many(keys, [value] * len(keys))
        await _stream(store, args, value, False)  # warm-up: one unmeasured run
        reps: list[dict[str, Any]] = []
        for rep in range(args.reps):
            runs: dict[str, Any] = {}
            order = ("alone", "subscribed") if rep % 2 == 0 else ("subscribed", "alone")
            for mode in order:
                runs[mode] = await _stream(store, args, value, mode == "subscribed")
            runs["ratio"] = runs["subscribed"]["put_MBps"] / runs["alone"]["put_MBps"]
            runs["cpu_ratio"] = (runs["subscribed"]["cpu_s_per_GB"]
                                 / runs["alone"]["cpu_s_per_GB"])
            reps.append(runs)
            print(f"rep {rep}: alone {runs['alone']['put_MBps']:.0f} MB/s, subscribed "
                  f"{runs['subscribed']['put_MBps']:.0f} MB/s (ratio {runs['ratio']:.3f}), "
                  f"CPU per GB x{runs['cpu_ratio']:.3f}, {runs['subscribed']['events']} events",
                  file=sys.stderr)
        published, dropped = store.stats().events_published, store.stats().events_dropped
    info = machine_info(root)
    return {
        "command": " ".join(["python benchmarks/event_cost.py", *sys.argv[1:]]),
        "commit": head_commit(HERE), "engine": engine, "block_bytes": args.block,
        "batch": args.batch, "callers": args.callers, "seconds": args.seconds,
        "capacity_bytes": args.capacity, "sync": args.sync, "tag_bytes": args.tags, "reps": reps,
        "ratio": summary([r["ratio"] for r in reps]),
        "cpu_ratio": summary([r["cpu_ratio"] for r in reps]),
        "publish_share": summary([r["subscribed"]["publish_share"] for r in reps]),
        "events_published": published, "events_dropped": dropped,
        "machine": f"{info['nproc']} CPUs ({info['cpu']}), kernel {info['kernel']}, "
                   f"{info['fs_type']} on {info['fs_device']}, load {info['loadavg_start']}"}


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n >> 10} KiB"


def render(doc: dict[str, Any]) -> str:
    r, c, w = doc["ratio"], doc["cpu_ratio"], doc["publish_share"]
    lines = [
        f"# What one event subscriber costs durable puts, at {doc['commit']}",
        "",
        f"`{doc['command']}` — {doc['machine']}; {doc['engine']}.",
        "",
        f"{doc['callers']} caller(s) putting batches of {doc['batch']} new {_size(doc['block_bytes'])} "
        f"blocks back to back for {doc['seconds']} s into a full store of "
        f"{_size(doc['capacity_bytes'])} (so puts evict; "
        f"{'durable puts' if doc['sync'] else 'sync=False: no fdatasync'}), "
        f"{'each with a ' + str(doc.get('tag_bytes')) + '-byte tag, ' if doc.get('tag_bytes') else ''}"
        "with no subscriber and with one "
        "consuming every event on the same event loop, alternating order, "
        f"{len(doc['reps'])} repetitions in one process.",
        "",
        f"**Put throughput with a subscriber / without: min {r['min']:.3f}, median "
        f"{r['median']:.3f}, max {r['max']:.3f}** (cost = 1 - ratio; target <= 2%).  "
        f"Process CPU seconds per GB put, with a subscriber / without: min {c['min']:.3f}, "
        f"median {c['median']:.3f}, max {c['max']:.3f} (what the events add, all threads).  "
        f"The writer thread's CPU time handing events over (``EventHub.publish``, on "
        f"every put's path) / the stream's time: min {100 * w['min']:.3f}%, median "
        f"{100 * w['median']:.3f}%, max {100 * w['max']:.3f}%.  "
        f"Events published {doc['events_published']}, dropped {doc['events_dropped']}.",
        "",
        "| rep | alone MB/s | subscribed MB/s | ratio | CPU s/GB alone / subscribed | "
        "events read |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, rep in enumerate(doc["reps"]):
        a, b = rep["alone"], rep["subscribed"]
        lines.append(f"| {i} | {a['put_MBps']:.0f} | {b['put_MBps']:.0f} | "
                     f"{rep['ratio']:.3f} | {a['cpu_s_per_GB']:.3f} / "
                     f"{b['cpu_s_per_GB']:.3f} | {b['events']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dir", default=None, help="scratch directory (on the disk to measure)")
    p.add_argument("--block", type=parse_size, default=1 << 20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--callers", type=int, default=2)
    p.add_argument("--capacity", type=parse_size, default=1 << 30)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="open(sync=False): no fdatasync, so with --dir on tmpfs the puts are "
                        "CPU-bound and the disk's variance is out of the ratio")
    p.add_argument("--tags", type=int, default=0,
                   help="a tag of this many bytes with every block the stream puts")
    p.add_argument("--out-dir", default=None,
                   help="write event_put_cost_<block>_at_<commit>.md/.json")
    args = p.parse_args(argv)
    args.dir = scratch_dir(args.dir, HERE)
    doc = anyio.run(in_scratch, "event-cost-", args.dir, lambda root: measure(root, args))
    text = render(doc)
    print(text)
    if args.out_dir:
        kind = ("" if args.sync else "_nosync") + (f"_tags{args.tags}" if args.tags else "")
        base = os.path.join(args.out_dir, f"event_put_cost_{_size(args.block).replace(' ', '')}"
                            f"{kind}_at_{doc['commit']}")
        write_results(base, text, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
