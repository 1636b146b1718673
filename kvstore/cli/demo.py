"""``python -m kvstore demo``: what the store does for an inference engine, and how fast.

1. Offload: many chat sessions share a few system prompts.  Each session's KV blocks
   (16 tokens x 32 layers x K,V x 8 heads x 128 dims, fp16 = 2 MiB per block, a
   Llama-3-8B-like layout) are keyed by the chained prefix hash and put in batches, as
   an engine offloads finished requests.  Shared system-prompt blocks are stored once.
2. Restart: the engine process exits; a *new process* opens the store (no scan).
3. Reload: for every session, ``match_prefix`` finds the cached prefix and ``get_many``
   loads it; every block is checked against the CRC32C the writer recorded.

The KV tensors are generated deterministically per block (seeded by its key), so the
reader can verify bytes without keeping them in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import anyio
import torch

import kvstore
from kvstore import permissions
from kvstore.cli.progress import Progress
from kvstore.format import crc32c

BLOCK_TOKENS = 16
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
NAMESPACE = kvstore.Namespace(model="demo/llama-3-8b-like", dtype="float16",
                              block_size=BLOCK_TOKENS, layout="[2,layers,tokens,heads,dim]")


def default_path() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("KVSTORE_DEMO_PATH") or os.path.join(cache, "kvstore", "demo")


def block_tensor(key: bytes) -> torch.Tensor:
    """Deterministic stand-in KV for one block (fp16, activation-like scale)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randn(2, LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM, generator=g,
                       dtype=torch.float32).mul_(2.0).to(torch.float16)


def sessions(n_sessions: int, n_prompts: int, prompt_tokens: int, turn_tokens: int
             ) -> list[list[int]]:
    """Token ids per session: one of ``n_prompts`` system prompts + a unique user turn."""
    out = []
    for s in range(n_sessions):
        g = torch.Generator().manual_seed(10_000 + s % n_prompts)
        system = torch.randint(0, 128_000, (prompt_tokens,), generator=g).tolist()
        g = torch.Generator().manual_seed(20_000 + s)
        turn = torch.randint(0, 128_000, (turn_tokens,), generator=g).tolist()
        out.append(system + turn)
    return out


def _row(name: str, value: str) -> str:
    return f"| {name:<44} | {value:>22} |"


async def offload(path: str, tokens: list[list[int]]) -> dict[str, Any]:
    checksums: dict[str, int] = {}
    logical = 0
    put_seconds = 0.0
    async with kvstore.open(path, namespace=NAMESPACE) as store:
        bar = Progress("offload (put_many)", len(tokens), " sessions")
        for toks in tokens:
            keys = NAMESPACE.chain_keys(toks)
            present = await store.contains_many(keys)
            blocks = [block_tensor(k) if not p else torch.empty(0) for k, p in zip(keys, present)]
            # An engine offloads only blocks the store lacks; dedup also catches the rest.
            new = [(k, b) for k, b, p in zip(keys, blocks, present) if not p]
            for k, b in new:
                checksums[k.hex()] = crc32c(b.view(torch.uint8).numpy().data)
            t0 = time.perf_counter()
            parents = kvstore.chain_parents(keys)
            await store.put_many([k for k, _ in new], [b for _, b in new],
                                 parents=[parents[keys.index(k)] for k, _ in new])
            put_seconds += time.perf_counter() - t0
            logical += len(keys) * blocks_bytes()
            bar.advance()
        bar.close()
        stats = store.stats()
    return {"checksums": checksums, "put_seconds": put_seconds, "logical_bytes": logical,
            "stats": stats.as_dict()}


def blocks_bytes() -> int:
    return 2 * LAYERS * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2


async def reload(path: str, tokens: list[list[int]], checksums: dict[str, int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    async with kvstore.open(path, namespace=NAMESPACE, create=False) as store:
        open_seconds = time.perf_counter() - t0
        bar = Progress("reload (match + get_many)", len(tokens), " sessions")
        ok = bad = loaded_bytes = matched_tokens = 0
        match_seconds = get_seconds = 0.0
        for toks in tokens:
            keys = NAMESPACE.chain_keys(toks)
            t = time.perf_counter()
            n = await store.match_prefix(keys)
            match_seconds += time.perf_counter() - t
            matched_tokens += n * BLOCK_TOKENS
            t = time.perf_counter()
            got = await store.get_many(keys[:n])
            get_seconds += time.perf_counter() - t
            for k, g in zip(keys[:n], got):
                if g is not None and crc32c(g.view(torch.uint8).numpy().data) == checksums[k.hex()]:
                    ok += 1
                    loaded_bytes += g.numel() * g.element_size()
                else:
                    bad += 1
            bar.advance()
        bar.close()
        stats = store.stats()
    return {"open_seconds": open_seconds, "match_seconds": match_seconds,
            "get_seconds": get_seconds, "verified": ok, "bad": bad, "loaded_bytes": loaded_bytes,
            "matched_tokens": matched_tokens, "engine": stats.engine}


def write_manifest(path: str, checksums: dict[str, int]) -> None:
    """The writer's checksums for the reloading process; owner-only, as the store is."""
    permissions.make_dirs(os.path.dirname(path))
    with os.fdopen(permissions.create_file(path, os.O_WRONLY | os.O_TRUNC), "w") as f:
        json.dump(checksums, f)


def run_demo(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.path or default_path())
    n_sessions, n_prompts, prompt_tokens, turn_tokens = (
        (6, 2, 256, 128) if args.quick else (24, 3, 1024, 512))
    tokens = sessions(n_sessions, n_prompts, prompt_tokens, turn_tokens)
    manifest = os.path.join(os.path.dirname(path), "demo-manifest.json")
    if args.reload_only:
        with open(manifest) as f:
            checksums = json.load(f)
        result = anyio.run(reload, path, tokens, checksums)
        print(json.dumps(result))
        return 0 if result["bad"] == 0 else 1

    shutil.rmtree(path, ignore_errors=True)
    permissions.make_dirs(os.path.dirname(path))
    print(f"kvstore demo: {n_sessions} sessions sharing {n_prompts} system prompts of "
          f"{prompt_tokens} tokens, + {turn_tokens}-token user turns; 2 MiB KV blocks of "
          f"{BLOCK_TOKENS} tokens\nstore: {path}\n", file=sys.stderr)
    t0 = time.perf_counter()
    wrote = anyio.run(offload, path, tokens)
    write_manifest(manifest, wrote["checksums"])
    print("engine restart: a new process opens the store ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "kvstore", "demo", "--reload-only", "--path", path]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode not in (0, 1):
        print("the reload process failed", file=sys.stderr)
        return 2
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    total = time.perf_counter() - t0

    s = wrote["stats"]
    stored = s["put_bytes"]
    gib = 1 << 30
    print()
    print(_row("what", "value"))
    print("|" + "-" * 46 + "|" + "-" * 24 + "|")
    rows = [
        ("I/O engine", f"{s['engine']}{' + O_DIRECT' if s['o_direct'] else ''}"),
        ("sessions offloaded", f"{n_sessions}"),
        ("KV offered by the engine", f"{wrote['logical_bytes'] / gib:.2f} GiB"),
        ("KV written (prefix dedup)", f"{stored / gib:.2f} GiB in {s['put_blocks']} blocks"),
        ("dedup ratio (offered / written)", f"{wrote['logical_bytes'] / max(stored, 1):.2f}x"),
        ("put throughput, durable (fdatasync+commit)",
         f"{stored / wrote['put_seconds'] / 1e9:.2f} GB/s"),
        ("reopen in a new process", f"{got['open_seconds'] * 1e3:.0f} ms"),
        ("match_prefix per session (avg)", f"{got['match_seconds'] / n_sessions * 1e3:.2f} ms"),
        ("prefix tokens found after restart", f"{got['matched_tokens']}"),
        ("get throughput (O_DIRECT, cold)", f"{got['loaded_bytes'] / got['get_seconds'] / 1e9:.2f} GB/s"),
        ("blocks verified bit-exact", f"{got['verified']} ok, {got['bad']} bad"),
        ("total demo time", f"{total:.1f} s"),
    ]
    for name, value in rows:
        print(_row(name, value))
    print(f"\ninspect it: python -m kvstore stats {path}")
    return 0 if got["bad"] == 0 and got["verified"] > 0 else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="offload, restart, reload and verify an engine-like workload")
    p.add_argument("--path", help=f"store directory (default {default_path()}; it is recreated)")
    p.add_argument("--quick", action="store_true", help="a few seconds instead of a minute")
    p.add_argument("--reload-only", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(fn=run_demo)
