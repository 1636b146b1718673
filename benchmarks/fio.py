"""The physical limit: fio with io_uring and O_DIRECT, same block size and queue depth.

``write`` runs ``--rw=write --end_fsync=1`` (the final fsync is inside fio's runtime, as
kvstore's fdatasync + commit is inside its put) on a fresh file; ``read`` then reads that
file back.  fio lays the file out with fallocate, as kvstore preallocates its extents.

A second read of the same file *through the page cache* (``--direct=0``, cache emptied
first; system ``fio buffered``) is a reference, not the limit: on a virtual disk the
kernel's readahead (``read_ahead_kb``) can outrun O_DIRECT, and then so can peers that
read buffered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from contextlib import suppress
from typing import Any


def find_fio(name: str | None = None) -> str | None:
    return shutil.which(name or "fio")


def fio_version(fio: str) -> str:
    try:
        return subprocess.run([fio, "--version"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fio_command(fio: str, filename: str, rw: str, block: int, volume: int,
                iodepth: int, direct: bool = True) -> list[str]:
    cmd = [fio, "--name=bench", f"--filename={filename}", "--ioengine=io_uring",
           f"--direct={int(direct)}",
           f"--bs={block}", f"--iodepth={iodepth}", f"--rw={rw}", f"--size={volume}",
           "--numjobs=1", "--thread", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    return cmd


def run_fio(fio: str, filename: str, rw: str, block: int, volume: int,
            iodepth: int, direct: bool = True) -> float:
    """Seconds fio needed to move ``volume`` bytes (its own runtime)."""
    cmd = fio_command(fio, filename, rw, block, volume, iodepth, direct)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    out = proc.stdout
    doc: dict[str, Any] = json.loads(out[out.index("{"):])  # fio may print warnings first
    job = doc["jobs"][0][rw]
    if job["io_bytes"] != volume or job["runtime"] <= 0:
        raise RuntimeError(f"fio {rw}: moved {job['io_bytes']} of {volume} bytes in "
                           f"{job['runtime']} ms")
    return float(job["runtime"]) / 1000.0


def remove(filename: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(filename)
