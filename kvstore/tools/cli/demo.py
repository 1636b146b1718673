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

The store directory holds a manifest (``kvstore-demo.json``: the workload and every
block's CRC32C) written before anything else.  It is how the demo recognises a store it
made: a rerun replaces such a directory, and refuses any other non-empty directory (a
tool must never delete what it did not create).  ``--remove`` deletes the demo's store
under the same rule.  The manifest is read and written without following a link,
like every file of the store (a link there is refused, never read through).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch

import kvstore
from kvstore.disk import layout, permissions, store_files
from kvstore.disk.format import PAGE, SLOT_HEADER_BYTES, crc32c, round_up
from kvstore.errors import UnsafePathError
from kvstore.tools.cli.progress import Progress
from kvstore.tools.cli.units import disk_usage, human_bytes

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


@dataclass(frozen=True)
class Workload:
    sessions: int
    prompts: int
    prompt_tokens: int
    turn_tokens: int


WORKLOADS = {
    "full": Workload(24, 3, 1024, 512),
    "quick": Workload(6, 2, 256, 128),
    "tiny": Workload(2, 1, 32, 16),  # the tests' (hidden option): 4 blocks, 8 MiB
}


def sessions(w: Workload) -> list[list[int]]:
    """Token ids per session: one of ``w.prompts`` system prompts + a unique user turn."""
    out = []
    for s in range(w.sessions):
        g = torch.Generator().manual_seed(10_000 + s % w.prompts)
        system = torch.randint(0, 128_000, (w.prompt_tokens,), generator=g).tolist()
        g = torch.Generator().manual_seed(20_000 + s)
        turn = torch.randint(0, 128_000, (w.turn_tokens,), generator=g).tolist()
        out.append(system + turn)
    return out


def extent_bytes_for(tokens: list[list[int]]) -> int:
    """Extents sized to the workload: the demo's distinct blocks in as few extent files
    as fit 1 GiB each, split evenly, so the store preallocates what it will hold (the
    store's 1 GiB default would reserve 1 GiB for --quick's 0.16 GiB)."""
    distinct = len({k for toks in tokens for k in NAMESPACE.chain_keys(toks)})
    slot = round_up(SLOT_HEADER_BYTES + blocks_bytes())
    per_extent_max = ((1 << 30) - PAGE) // slot
    n_extents = -(-distinct // per_extent_max)
    return PAGE + -(-distinct // n_extents) * slot


def _row(name: str, value: str) -> str:
    return f"| {name:<44} | {value:>22} |"


async def offload(path: str, tokens: list[list[int]], extent_bytes: int) -> dict[str, Any]:
    """Put every session's whole chain, as an engine offloading finished requests does;
    the store's dedup skips the blocks it already holds (shared system prompts), so its
    persisted totals (``stats``) show the same dedup as this demo."""
    checksums: dict[str, int] = {}
    logical = 0
    put_seconds = 0.0
    previous: dict[bytes, torch.Tensor] = {}
    async with kvstore.open(path, namespace=NAMESPACE, extent_bytes=extent_bytes) as store:
        bar = Progress("offload (put_many)", len(tokens), " sessions")
        # Sessions sharing a system prompt one after another (sorted token lists), so a
        # shared block's tensor is generated once and reused from the previous session.
        for toks in sorted(tokens):
            keys = NAMESPACE.chain_keys(toks)
            blocks = [previous.get(k) for k in keys]
            for i, (k, b) in enumerate(zip(keys, blocks)):
                if b is None:
                    blocks[i] = block_tensor(k)
            values = [b for b in blocks if b is not None]
            previous = dict(zip(keys, values))
            t0 = time.perf_counter()
            await store.put_many(keys, values, parents=kvstore.chain_parents(keys))
            put_seconds += time.perf_counter() - t0
            for k, b in zip(keys, values):
                if k.hex() not in checksums:
                    checksums[k.hex()] = crc32c(b.view(torch.uint8).numpy().data)
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


# ---------------------------------------------------------------------- the store path

MANIFEST = layout.DEMO_MANIFEST
_MANIFEST_TAG = "python -m kvstore demo"
# What a demo run puts in its directory: the manifest and the store's own entries
# (LOCK, index/, extents/; index.broken-* from fsck --rebuild-index; .probe-* files an
# I/O probe killed mid-way leaves).
_OWN_NAMES = {MANIFEST, *layout.STORE_NAMES}
_OWN_PREFIXES = (layout.BROKEN_INDEX_PREFIX, layout.PROBE_PREFIX)


class DemoPathError(Exception):
    """The demo's directory cannot be used (exit 2); the message says why and what to do."""


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the demo store at ``path``, never read through a link
    (:class:`~kvstore.errors.UnsafePathError`, an OSError); OSError or ValueError if it
    is missing or not the demo's JSON."""
    p = os.path.join(path, MANIFEST)
    fd = store_files.open_regular(p, os.O_RDONLY, f"Remove it (rm {p}) and run the demo again.")
    with os.fdopen(fd) as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{p} is not the demo's manifest")
    return doc


def _is_demo_store(path: str) -> bool:
    try:
        return bool(read_manifest(path).get("created_by") == _MANIFEST_TAG)
    except UnsafePathError as e:
        raise DemoPathError(str(e)) from None
    except (OSError, ValueError):
        return False


def _foreign_entries(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path)
                  if n not in _OWN_NAMES and not n.startswith(_OWN_PREFIXES))


def check_removable(path: str) -> bool:
    """True if ``path`` holds a store this demo made (and nothing else), False if it does
    not exist or is empty; raises DemoPathError for anything the demo must not touch."""
    if not os.path.lexists(path):
        return False
    if not os.path.isdir(path) or os.path.islink(path):
        raise DemoPathError(f"{path} is a file, not a directory; pass --path with a new or "
                            "empty directory")
    if not os.listdir(path):
        return False
    if not _is_demo_store(path):
        raise DemoPathError(
            f"{path} is not empty and is not a store made by the demo (no {MANIFEST}); "
            "the demo deletes only what it created. Pass --path with a new or empty directory.")
    foreign = _foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DemoPathError(
            f"{path} is a demo store but also holds files the demo did not create ({shown}); "
            "move them elsewhere or pass another --path")
    return True


def remove_demo_store(path: str) -> None:
    """Delete a demo store: only the entries a demo run creates, then the directory if it
    is empty (checked by :func:`check_removable` first)."""
    for name in os.listdir(path):
        if name not in _OWN_NAMES and not name.startswith(_OWN_PREFIXES):
            continue
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
    os.rmdir(path)


def write_manifest(path: str, workload: str, checksums: dict[str, int]) -> None:
    """Mark ``path`` as the demo's store and keep the writer's checksums for the reloading
    process; owner-only, as the store is."""
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with contextlib.suppress(FileNotFoundError):  # a stale one, or a link: never written through
        os.unlink(tmp)
    with os.fdopen(permissions.create_file(tmp, os.O_WRONLY | os.O_TRUNC | os.O_EXCL), "w") as f:
        json.dump({"created_by": _MANIFEST_TAG, "workload": workload,
                   "checksums": checksums}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


# ---------------------------------------------------------------------- the command


def _workload_name(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else "quick" if args.quick else "full"


def run_demo(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.path or default_path())
    args.path = path  # for the CLI's Ctrl-C message
    try:
        exists = check_removable(path)
    except DemoPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.remove:
        if not exists:
            print(f"nothing to remove: {path} holds no demo store")
            return 0
        size = disk_usage(path)
        remove_demo_store(path)
        print(f"removed the demo store {path} ({human_bytes(size)})")
        return 0
    if args.reload_only:
        manifest = read_manifest(path)
        tokens = sessions(WORKLOADS[manifest["workload"]])
        result = anyio.run(reload, path, tokens, manifest["checksums"])
        print(json.dumps(result))
        return 0 if result["bad"] == 0 else 1

    name = _workload_name(args)
    w = WORKLOADS[name]
    tokens = sessions(w)
    if exists:
        remove_demo_store(path)
    permissions.make_dirs(path)
    write_manifest(path, name, {})  # first: marks the directory as the demo's
    print(f"kvstore demo: {w.sessions} sessions sharing {w.prompts} system prompts of "
          f"{w.prompt_tokens} tokens, + {w.turn_tokens}-token user turns; 2 MiB KV blocks of "
          f"{BLOCK_TOKENS} tokens\nstore: {path}\n", file=sys.stderr)
    t0 = time.perf_counter()
    wrote = anyio.run(offload, path, tokens, extent_bytes_for(tokens))
    write_manifest(path, name, wrote["checksums"])
    print("engine restart: a new process opens the store ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "kvstore", "demo", "--reload-only", "--path", path]
    returncode, stdout = _run_reload(cmd)
    if returncode not in (0, 1):
        print("the reload process failed", file=sys.stderr)
        return 2
    got = json.loads(stdout.strip().splitlines()[-1])
    total = time.perf_counter() - t0
    _print_table(w, wrote, got, total)
    want_blocks = sum(len(t) // BLOCK_TOKENS for t in tokens)
    want_tokens = want_blocks * BLOCK_TOKENS
    size = disk_usage(path)
    print(f"\ndata:      {path} ({human_bytes(size)} on disk, manifest inside)")
    print(f"inspect:   python -m kvstore stats {path}")
    default = os.path.abspath(default_path())
    remove = "python -m kvstore demo --remove" + ("" if path == default else f" --path {path}")
    print(f"remove:    {remove}   (or: rm -r {path})")
    ok = got["bad"] == 0 and got["verified"] == want_blocks and got["matched_tokens"] == want_tokens
    print(f"\n{'OK' if ok else 'FAILED'}: {got['verified']}/{want_blocks} blocks bit-exact after "
          f"restart ({got['bad']} bad); {got['matched_tokens']} of {want_tokens} prefix tokens "
          "found")
    return 0 if ok else 1


def _run_reload(cmd: list[str]) -> tuple[int, str]:
    """Run the reload process; on Ctrl-C kill it before this process reports.

    The child has its own session: Ctrl-C reaches this process only, which says so once;
    the reader is then killed (it only reads: stopping it anywhere leaves the store
    consistent).  While the child starts, Ctrl-C is only noted: a KeyboardInterrupt raised
    inside ``Popen`` after the fork loses the only handle to a running child, which then
    printed its progress after this process's "interrupted" line.  (Blocking SIGINT with
    a signal mask is not enough: a signal that arrived just before the block has already
    set Python's flag, and the exception is raised at the next bytecode, inside Popen.)"""
    interrupted = False

    def note(_signum: int, _frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, note)
    proc: subprocess.Popen[str] | None = None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        signal.signal(signal.SIGINT, previous)
        if interrupted:
            raise KeyboardInterrupt
        stdout, _ = proc.communicate()
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.wait()
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    return proc.returncode, stdout


def _print_table(w: Workload, wrote: dict[str, Any], got: dict[str, Any], total: float) -> None:
    s = wrote["stats"]
    stored = s["put_bytes"]
    gib = 1 << 30
    print()
    print(_row("what", "value"))
    print("|" + "-" * 46 + "|" + "-" * 24 + "|")
    rows = [
        ("I/O engine", f"{s['engine']}{' + O_DIRECT' if s['o_direct'] else ''}"),
        ("sessions offloaded", f"{w.sessions}"),
        ("KV offered by the engine", f"{wrote['logical_bytes'] / gib:.2f} GiB"),
        ("KV written (prefix dedup)", f"{stored / gib:.2f} GiB in {s['put_blocks']} blocks"),
        ("dedup ratio (offered / written)", f"{wrote['logical_bytes'] / max(stored, 1):.2f}x"),
        ("put throughput, durable (fdatasync+commit)",
         f"{stored / wrote['put_seconds'] / 1e9:.2f} GB/s"),
        ("reopen in a new process", f"{got['open_seconds'] * 1e3:.0f} ms"),
        ("match_prefix per session (avg)", f"{got['match_seconds'] / w.sessions * 1e3:.2f} ms"),
        ("prefix tokens found after restart", f"{got['matched_tokens']}"),
        ("get throughput (O_DIRECT, cold)" if s["o_direct"] else "get throughput (cold)",
         f"{got['loaded_bytes'] / max(got['get_seconds'], 1e-9) / 1e9:.2f} GB/s"),
        ("blocks verified bit-exact", f"{got['verified']} ok, {got['bad']} bad"),
        ("total demo time", f"{total:.1f} s"),
    ]
    for name, value in rows:
        print(_row(name, value))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="offload, restart, reload and verify an engine-like workload",
        description="Offload an engine-like workload, restart (a new process), reload and "
        "verify every block. " + TIMING)
    p.add_argument("--path", help=f"store directory (default {default_path()}); a demo store "
                   "there is replaced, any other non-empty directory is refused")
    p.add_argument("--quick", action="store_true",
                   help="a smaller workload: 0.16 GiB instead of 1.9 GiB (15 s instead of "
                   "52 s on the 2-core VM above)")
    p.add_argument("--remove", action="store_true",
                   help="delete the demo's store (only a store the demo made) and exit")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reload-only", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(fn=run_demo)


# Measured on the development machine (2 cores, ext4 on a shared virtual disk), wall
# clock including start-up: 52 s and 15 s.  It varies with the disk and the CPU.
TIMING = ("It writes 1.9 GiB (--quick: 0.16 GiB); on a 2-core VM with a shared virtual "
          "disk that took 52 s (--quick: 15 s), start-up included. The time varies with "
          "the disk.")
