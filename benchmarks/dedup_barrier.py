"""What the durable-dedup barrier costs a put that stores nothing of its own (issue 43,
kvstore/core/durable_dedup.py): such a put syncs the index before it is acknowledged
when any transaction committed since the last such sync.

    python benchmarks/dedup_barrier.py [--reps 300] [--engine io_uring]

One store (``sync=True``) holding 32 blocks of 64 KiB; ``put_many`` of those 32 again
(every block deduplicated), timed, in four rounds of ``--reps`` puts in rotating order:
``steady`` (no commit between puts: no sync), ``after a commit`` (a pin and an unpin
before each put: two commits, so the barrier syncs), and both again with the barrier
turned off in the same process (the baseline).  Prints p50/p90 per mode.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

import kvstore
from kvstore.core.durable_dedup import DurableDedup
from kvstore.testing import parts


async def _no_barrier(self: DurableDedup) -> None:
    return None


def measure(store: kvstore.BlockingStore, keys: list[bytes], values: list[torch.Tensor],
            reps: int, commit_between: bool) -> list[float]:
    out = []
    for _ in range(reps):
        if commit_between:
            store.pin(keys[:1])
            store.unpin(keys[:1])
        t0 = time.perf_counter()
        store.put_many(keys, values)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--engine", default="io_uring")
    args = p.parse_args()
    ns = kvstore.Namespace(model="bench", dtype="float32", block_size=16)
    keys = ns.chain_keys(list(range(16 * 32)))
    values = [torch.full((16384,), float(i)) for i in range(32)]
    got: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=".") as d, \
            kvstore.open_blocking(d, namespace=ns, engine=args.engine) as store:
        store.put_many(keys, values)
        barrier = type(parts(store).puts.durable_dedup)
        real = barrier.barrier
        modes: list[tuple[str, bool, Any]] = [
            ("steady, barrier", False, real), ("after a commit, barrier", True, real),
            ("steady, no barrier", False, _no_barrier),
            ("after a commit, no barrier", True, _no_barrier)]
        for rep in range(2):
            for name, between, fn in modes[rep:] + modes[:rep]:
                barrier.barrier = fn  # type: ignore[method-assign]
                got.setdefault(name, []).extend(
                    measure(store, keys, values, args.reps, between))
        barrier.barrier = real  # type: ignore[method-assign]
    for name, _, _ in modes:
        ts = sorted(got[name])
        print(f"{name:28s} p50 {statistics.median(ts) * 1e6:6.0f} us   "
              f"p90 {ts[int(len(ts) * 0.9)] * 1e6:6.0f} us")


if __name__ == "__main__":
    main()
