"""CRC32C speed of the compiled slot kernels' paths (kvstore/_native/slots.c: PCLMULQDQ
folding, the 3-stream crc32 instruction, slicing-by-8 tables) and of the ``crc32c``
package, for reference.

What is measured
----------------
* ``crc``: the CRC32C of one buffer of 4 KiB, 64 KiB or 2 MiB (random bytes, the same
  buffer every call, so it is in cache from the second call on: the kernels' own
  throughput, as when a slot is checksummed right after its copy).
* ``copy+crc``: ``kvs_crc32c_copy`` of 2 MiB, the copy into another buffer and the
  CRC in the same pass (what staging a raw put and verifying a get into a fresh tensor
  do).
* One sample: ``calls`` back-to-back calls (about 16 MiB of bytes), timed in C
  (``native_slots.time_crc32c``), so no Python call overhead; GB/s in decimal GB.  The
  package is timed from Python (its per-call overhead, ~0.2 us, is in its 4 KiB row).
* min / median / max over ``--reps`` samples, the paths interleaved sample by sample so
  that load from other processes falls on all of them alike.

Rerun::

    python benchmarks/crc_speed.py                   # ~20 s
    python benchmarks/crc_speed.py --reps 31 --out benchmarks/results/crc32c.md

Needs the compiled kernels (``python setup.py build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import crc32c as crc32c_pkg
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import loadavg  # noqa: E402
from kvstore.io import native_slots  # noqa: E402

SIZES = [("4 KiB", 4 << 10), ("64 KiB", 64 << 10), ("2 MiB", 2 << 20)]
SAMPLE_BYTES = 16 << 20


def cpu_description() -> str:
    fields: dict[str, str] = {}
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():
                break
    flags = set(fields.get("flags", "").split())
    have = [f for f in ("sse4_2", "pclmulqdq", "avx2", "vpclmulqdq", "avx512f") if f in flags]
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}, {fields.get('cpu MHz', '?')} MHz, "
            f"{os.cpu_count()} CPUs; {', '.join(have)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="samples per row")
    parser.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    args = parser.parse_args()
    if not native_slots.available():
        sys.exit(f"no compiled slot kernels: {native_slots.reason()}")

    rng = np.random.default_rng(0)
    rows: dict[str, Callable[[], float]] = {}   # row label -> one sample in GB/s
    for label, n in SIZES:
        data = rng.integers(0, 256, n, dtype=np.uint8)
        calls = max(1, SAMPLE_BYTES // n)
        for path in native_slots.crc_paths()[::-1]:
            rows[f"| crc | {label} | {path} |"] = (
                lambda d=data, c=calls, p=path: d.size * c / native_slots.time_crc32c(
                    d, c, path=p) / 1e9)
        rows[f"| crc | {label} | crc32c package |"] = lambda d=data, c=calls: _package(d, c)
    big = rng.integers(0, 256, 2 << 20, dtype=np.uint8)
    dst = np.zeros_like(big)
    for path in native_slots.crc_paths()[::-1]:
        rows[f"| copy+crc | 2 MiB | {path} |"] = (
            lambda p=path: big.size * 8 / native_slots.time_crc32c(
                big, 8, path=p, copy_to=dst) / 1e9)

    load_before = loadavg()
    samples: dict[str, list[float]] = {row: [] for row in rows}
    for _ in range(args.reps + 1):               # the first round warms up, untimed
        for row, sample in rows.items():
            samples[row].append(sample())
    lines = [
        f"# CRC32C, GB/s (min / median / max of {args.reps} samples of ~16 MiB each)",
        "",
        f"Selected at load: {native_slots.reason()}",
        "",
        "| what | size | path | min | median | max |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row, values in samples.items():
        v = values[1:]
        lines.append(f"{row} {min(v):.2f} | {statistics.median(v):.2f} | {max(v):.2f} |")
    lines += [
        "",
        f"Machine: {cpu_description()}; Python {platform.python_version()}, "
        f"crc32c package {getattr(crc32c_pkg, '__version__', '?')}; load average "
        f"{load_before} before, {loadavg()} after.",
        f"Command: `python benchmarks/crc_speed.py --reps {args.reps}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")


def _package(data: np.ndarray, calls: int) -> float:
    buf = data.tobytes()
    t0 = time.perf_counter()
    for _ in range(calls):
        crc32c_pkg.crc32c(buf)
    return len(buf) * calls / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    main()
