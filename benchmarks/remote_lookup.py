"""How long a prefix lookup that goes to the remote tier holds vLLM's scheduler thread:
answered synchronously (``lookup_wait_ms: null``) against the connector's wait budget
(``kvstore.integrations.vllm.scheduler.lookup_pool.LookupPool``, 5 ms by default with a remote).

On a loopback SeaweedFS cluster (the remote tests' fixture), store A saves ``chains``
chains of ``blocks`` blocks and uploads them; store B, with an empty local disk and the
same bucket, is asked about each chain once, as vLLM's scheduler asks the connector (from
a thread, through a blocking portal, as the connector does).  Half of the chains
(alternating) are asked synchronously, half through ``LookupPool``; between two asks of a
deferred lookup the "scheduler" runs a step of ``step_ms`` (a sleep: here it stands for
the model's forward).  Reported per lookup: the longest single hold of the scheduler
thread (what one step is delayed by), the total hold, and the steps until the answer.

Usage: python -m benchmarks.remote_lookup [--chains 12] [--blocks 8] [--block-mib 2]
       [--step-ms 20] [--out benchmarks/results/remote_lookup.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import anyio
import anyio.from_thread
import torch

import kvstore
from benchmarks.remote import run_on_cluster
from kvstore.integrations.vllm.config import DEFAULT_REMOTE_LOOKUP_WAIT_S
from kvstore.integrations.vllm.scheduler.lookup_pool import LookupPool
from kvstore.remote import RemoteConfig
from tests.tiers.remote.cluster import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedCluster

NS = kvstore.Namespace(model="bench-remote-lookup", dtype="bfloat16", block_size=16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chains", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    run_on_cluster("remote-lookup", lambda cluster, root: measure(cluster, args, root),
                   args.out)


def measure(cluster: SeaweedCluster, args: argparse.Namespace, root: str) -> list[str]:
    prefix = f"lookup-{uuid.uuid4().hex[:8]}"
    remote = RemoteConfig(bucket=BUCKET, endpoint=cluster.endpoint, prefix=prefix,
                          access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
    numel = int(args.block_mib * (1 << 20)) // 2
    chains = [NS.chain_keys(list(range(c * 1000, c * 1000 + args.blocks * 16)))
              for c in range(args.chains)]

    def opened(path: str):  # type: ignore[no-untyped-def]
        return kvstore.open(path, namespace=NS, extent_bytes=256 << 20,
                            staging_bytes=64 << 20, remote=remote)

    async def save() -> None:
        async with opened(os.path.join(root, "a")) as a:
            for keys in chains:
                values = [torch.randn(numel).to(torch.bfloat16) for _ in keys]
                await a.put_many(keys, values, parents=kvstore.chain_parents(keys))
            assert a.remote is not None
            await a.remote.flush()

    anyio.run(save)
    held: dict[str, list[tuple[float, float, int]]] = {"sync": [], "wait": []}
    with anyio.from_thread.start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(opened(os.path.join(root, "b"))) as b:
        def match(keys: list[bytes]) -> int:
            return int(portal.call(b.match_prefix, keys))

        lookups = LookupPool(match, DEFAULT_REMOTE_LOOKUP_WAIT_S)
        try:
            for i, keys in enumerate(chains):
                mode = "sync" if i % 2 == 0 else "wait"
                asks: list[float] = []
                while True:
                    t = time.perf_counter()
                    hit = match(keys) if mode == "sync" else lookups.ask(f"r{i}", keys)
                    asks.append(time.perf_counter() - t)
                    if hit is not None:
                        break
                    time.sleep(args.step_ms / 1000)  # the scheduler's step goes on
                assert hit == len(keys), (hit, len(keys))
                held[mode].append((max(asks), sum(asks), len(asks) - 1))
        finally:
            lookups.close()

    def ms(values: list[float]) -> str:
        v = sorted(values)
        return f"{v[0] * 1e3:.1f} / {statistics.median(v) * 1e3:.1f} / {v[-1] * 1e3:.1f}"

    lines = [f"# A remote lookup and vLLM's scheduler thread: {args.blocks} blocks of "
             f"{args.block_mib:g} MiB per chain, loopback SeaweedFS, {os.cpu_count()} cores",
             "", f"{len(held['sync'])} chains asked synchronously, {len(held['wait'])} "
             f"with the connector's {DEFAULT_REMOTE_LOOKUP_WAIT_S * 1e3:g} ms wait (a step of "
             f"{args.step_ms:g} ms between asks); min / median / max per lookup.", "",
             "| lookup | longest hold of the scheduler, ms | total hold, ms | "
             "steps deferred |", "|---|---|---|---|"]
    for mode, rows in held.items():
        label = "synchronous (`lookup_wait_ms: null`)" if mode == "sync" else \
            f"`lookup_wait_ms: {DEFAULT_REMOTE_LOOKUP_WAIT_S * 1e3:g}` (default with remote)"
        lines.append(f"| {label} | {ms([r[0] for r in rows])} | {ms([r[1] for r in rows])} "
                     f"| {min(r[2] for r in rows)} / {statistics.median(r[2] for r in rows):g}"
                     f" / {max(r[2] for r in rows)} |")
    lines += ["", "Each lookup found its whole chain in the bucket (B's disk was empty): "
              "`match_prefix` fetched, verified and promoted it.  The hold is what every "
              "running request's next step waits for; with the wait budget a deferred "
              "request is asked about again at the next step."]
    return lines


if __name__ == "__main__":
    main()
