"""Real kills: a writer process under heavy put/delete load is SIGKILLed at random moments.

The writer prints one line per acknowledged operation (after the ack, before its next
operation); the parent kills it after a random number of acknowledgements, so the kill
lands while later batches are being written, synced or committed.  After each kill the
store is reopened: every block whose put was acknowledged (and not deleted since) reads
back with the checksum the writer logged, no deleted block comes back, and fsck finds
nothing but reclaimable leftovers; ``--repair`` then leaves it clean.

CI runs a few kills; ``-m slow`` runs 50.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.format import crc32c
from kvstore.tools import fsck

WRITER = textwrap.dedent("""
    import os, random, sys, anyio, torch, kvstore
    from kvstore.disk.format import crc32c
    NS = kvstore.Namespace(model="kill-test", dtype="bf16", block_size=4)
    path, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    async def main():
        async with kvstore.open(path, namespace=NS, extent_bytes=4 << 20,
                                staging_bytes=8 << 20) as store:
            stored = []
            for step in range(10_000):
                if stored and rng.random() < 0.25:
                    victims = rng.sample(stored, min(len(stored), rng.randint(1, 4)))
                    await store.delete_many(victims)
                    for k in victims:
                        stored.remove(k)
                    print("del", " ".join(k.hex() for k in victims), flush=True)
                    continue
                start = rng.randrange(1 << 30)
                keys = NS.chain_keys([start + i for i in range(4 * rng.randint(1, 12))])
                vals = [torch.randint(0, 255, (rng.randint(1, 300_000),), dtype=torch.uint8)
                        for _ in keys]
                await store.put_many(keys, vals, parents=kvstore.chain_parents(keys))
                stored.extend(k for k in keys if k not in stored)
                print("put", " ".join(f"{k.hex()}:{crc32c(v.numpy().data)}"
                                      for k, v in zip(keys, vals)), flush=True)
    anyio.run(main)
""")


def kill_once(path: Path, seed: int) -> tuple[dict[str, int], set[str]]:
    """Run the writer, SIGKILL it after a random number of acks; return the ack log."""
    rng = random.Random(seed)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(seed)],
                            stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout is not None
    live: dict[str, int] = {}
    deleted: set[str] = set()
    target = rng.randint(1, 25)
    for n, line in enumerate(proc.stdout, start=1):
        kind, *items = line.split()
        for item in items:
            if kind == "put":
                key, crc = item.split(":")
                live.setdefault(key, int(crc))  # a re-put of a stored key writes nothing
                deleted.discard(key)
            else:
                live.pop(item, None)
                deleted.add(item)
        if n >= target:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the writer ended before it was killed"
    return live, deleted


def check_after_kill(path: Path, live: dict[str, int], deleted: set[str]) -> None:
    async def read() -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        async with kvstore.open(path) as store:
            return (await store.get_many([bytes.fromhex(k) for k in live]),
                    await store.get_many([bytes.fromhex(k) for k in deleted]))

    got, gone = anyio.run(read)
    for (key, crc), value in zip(live.items(), got):
        assert value is not None, f"acknowledged block {key} lost"
        assert crc32c(value.numpy().data) == crc, f"block {key} has other bytes"
    assert gone == [None] * len(gone), "a deleted block came back"
    report = fsck.check(str(path), deep=True)
    assert not report.damage, [f.detail for f in report.damage]
    fsck.check(str(path), repair=True, deep=True)
    assert fsck.check(str(path), deep=True).findings == []


def run_kills(tmp_path: Path, kills: int) -> None:
    path = tmp_path / "store"
    live: dict[str, int] = {}
    deleted: set[str] = set()
    for seed in range(kills):
        new_live, new_deleted = kill_once(path, seed)
        for k in new_deleted:
            live.pop(k, None)
        deleted = (deleted | new_deleted) - set(new_live)
        live.update(new_live)
        check_after_kill(path, live, deleted)


def test_sigkill_under_load_loses_nothing_acknowledged(tmp_path: Path) -> None:
    run_kills(tmp_path, kills=4)


@pytest.mark.slow
def test_sigkill_under_load_50_times(tmp_path: Path) -> None:
    run_kills(tmp_path, kills=50)
