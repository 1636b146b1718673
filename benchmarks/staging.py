"""Slot staging and verification: the compiled kernels (kvstore/_native/slots.c) vs the
Python path of kvstore.io.slots, side by side in one run.

What is measured
----------------
* ``stage``: ``kvstore.io.slots.stage_all`` over one chunk of raw float16 blocks (the
  store's chunk: at most 8 MiB, or one larger block), i.e. header build, CRC32C of the
  staged payload, copy into the arena, zeroed padding.  Each block has its own source
  tensor, so nothing is served from cache that would not be in a real put.
* ``verify``: ``kvstore.io.slots.verify_copy_all`` over the chunk just staged, i.e. header
  checks, CRC32C and the copy out into a new tensor (``out=None``) and into a caller's
  contiguous tensor (``out=``).
* GB/s of payload bytes (decimal GB), the median of ``--reps`` timed passes after one
  untimed one, each pass running chunks until ``--mib`` MiB have moved; ``us/block`` is
  the median wall time per block, i.e. what a put or get spends here per block.
* native / python: the ratio of the two in the same run.

Rerun::

    python benchmarks/staging.py               # ~1 min on a quiet 2-core machine
    python benchmarks/staging.py --mib 64 --reps 3

Needs the compiled kernels (``python setup.py build_ext --inplace``).  The machine the
committed figures come from is a shared 2-core VM: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.codecs.tensors import DTYPE_CODES  # noqa: E402
from kvstore.disk.format import IndexEntry  # noqa: E402
from kvstore.io import native_slots, slots  # noqa: E402
from kvstore.io.arena import Arena, ArenaRun  # noqa: E402
from kvstore.io.slots import PutItem  # noqa: E402

CHUNK_BYTES = 8 << 20       # the store's chunk with its default 256 MiB arena
SIZES = [("64 KiB", 64 << 10), ("2 MiB", 2 << 20), ("32 MiB", 32 << 20)]


def make_chunk(arena: Arena, block: int) -> tuple[list[PutItem], ArenaRun, list[ArenaRun]]:
    n = max(1, CHUNK_BYTES // block)
    items = []
    for i in range(n):
        value = torch.randn(block // 2, generator=torch.Generator().manual_seed(i)).half()
        item = PutItem(i.to_bytes(16, "little"), None, value.view(torch.uint8),
                       DTYPE_CODES[torch.float16], (block // 2,))
        item.seq = i + 1
        items.append(item)
    whole = arena.try_acquire(sum(item.slot_len for item in items))
    assert whole is not None
    return items, whole, arena.split(whole, [item.slot_len for item in items])


def entry(item: PutItem) -> IndexEntry:
    return IndexEntry(1, 4096, item.slot_len, item.payload_len, item.raw_len, item.codec,
                      item.dtype, item.crc, item.seq, 0, None)


def timed(fn: Callable[[], None], chunk_bytes: int, mib: int, reps: int) -> float:
    """Median seconds per chunk."""
    passes = max(1, (mib << 20) // chunk_bytes)
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(passes):
            fn()
        samples.append((time.perf_counter() - t0) / passes)
    return statistics.median(samples)


def bench_size(arena: Arena, label: str, block: int, mib: int, reps: int) -> None:
    """One table row per step for blocks of ``block`` bytes."""
    items, whole, runs = make_chunk(arena, block)
    chunk = list(zip(items, runs))
    nbytes = sum(item.payload_len for item in items)
    outs = [torch.empty(block // 2, dtype=torch.float16) for _ in items]

    def verify(native: bool, with_out: bool) -> None:
        batch = [(run, item.key, entry(item), out if with_out else None)
                 for item, run, out in zip(items, runs, outs)]
        for result in slots.verify_copy_all(batch, native=native):
            assert isinstance(result, torch.Tensor)

    steps: list[tuple[str, Callable[[bool], None]]] = [
        ("stage", lambda native: slots.stage_all(chunk, native=native)),
        ("verify, out=None", lambda native: verify(native, False)),
        ("verify, out=", lambda native: verify(native, True)),
    ]
    for step, fn in steps:
        t_py = timed(lambda fn=fn: fn(False), nbytes, mib, reps)  # type: ignore[misc]
        t_nat = timed(lambda fn=fn: fn(True), nbytes, mib, reps)  # type: ignore[misc]
        print(f"| {label} | {step} | {nbytes / t_py / 1e9:.2f} | {nbytes / t_nat / 1e9:.2f} "
              f"| {t_py / t_nat:.2f}x | {t_py / len(items) * 1e6:.1f} "
              f"| {t_nat / len(items) * 1e6:.1f} |", flush=True)
    arena.release(whole)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=128, help="MiB moved per timed pass")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not native_slots.available():
        sys.exit(f"no compiled slot kernels: {native_slots.reason()}")
    print(f"# slot staging / verification, {native_slots.reason()}")
    print(f"# payload GB/s, median of {args.reps} passes of {args.mib} MiB; chunks of "
          f"<= {CHUNK_BYTES >> 20} MiB\n")
    print("| block | step | python GB/s | native GB/s | native / python "
          "| python us/block | native us/block |")
    print("|---|---|---:|---:|---:|---:|---:|")
    arena = Arena(80 << 20)
    for label, block in SIZES:
        bench_size(arena, label, block, args.mib, args.reps)
    arena.close()


if __name__ == "__main__":
    main()
