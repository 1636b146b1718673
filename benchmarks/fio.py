"""The physical limit: fio with io_uring and O_DIRECT, same block size and queue depth.

``write`` runs ``--rw=write --end_fsync=1`` (the final fsync is inside fio's runtime, as
kvstore's fdatasync + commit is inside its put) on a fresh file; ``read`` then reads that
file back.  fio lays the file out with fallocate, as kvstore preallocates its extents.

A second read of the same file *through the page cache* (``--direct=0``, cache emptied
first; system ``fio buffered``) is a reference, not the limit: on a virtual disk the
kernel's readahead (``read_ahead_kb``) can outrun O_DIRECT, and then so can peers that
read buffered.

``numjobs > 1`` (the 4-caller comparison, :mod:`benchmarks.callers`): that many jobs at
once, each on its own file of ``volume / numjobs`` bytes (``FILE.0``, ``FILE.1``, ...),
each with ``iodepth`` in flight and its own ``--end_fsync=1``; the run takes as long as
its slowest job.  :func:`measure_fio` also returns fio's CPU time: the usr + sys it
reports per job (the I/O itself), and the whole child process's ``getrusage`` (start-up
and file layout included).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from contextlib import suppress
from dataclasses import dataclass
from typing import Any


def find_fio(name: str | None = None) -> str | None:
    return shutil.which(name or "fio")


def fio_version(fio: str) -> str:
    try:
        return subprocess.run([fio, "--version"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass(frozen=True)
class FioRun:
    seconds: float  # the slowest job's runtime (the final fsync included for writes)
    io_bytes: int  # moved by all jobs together
    cpu_s: float  # usr + sys CPU seconds of the jobs, as fio reports them
    child_cpu_s: float  # getrusage of the fio process: start-up and file layout included


def fio_command(fio: str, filename: str, rw: str, block: int, volume: int,
                iodepth: int, direct: bool = True, numjobs: int = 1) -> list[str]:
    if numjobs == 1:
        where = [f"--filename={filename}", f"--size={volume}"]
    else:  # one file per job: FILE.0, FILE.1, ...
        where = [f"--directory={os.path.dirname(filename) or '.'}",
                 f"--filename_format={os.path.basename(filename)}.$jobnum",
                 f"--size={volume // numjobs}"]
    cmd = [fio, "--name=bench", *where, "--ioengine=io_uring", f"--direct={int(direct)}",
           f"--bs={block}", f"--iodepth={iodepth}", f"--rw={rw}", f"--numjobs={numjobs}",
           "--thread", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    return cmd


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _job_cpu_s(job: dict[str, Any]) -> float:
    # fio's usr_cpu / sys_cpu are percentages of the job's runtime (per thread: --thread)
    return (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * \
        float(job["job_runtime"]) / 1000


def measure_fio(fio: str, filename: str, rw: str, block: int, volume: int,
                iodepth: int, direct: bool = True, numjobs: int = 1) -> FioRun:
    """Run fio once; how long it took to move ``volume`` bytes and the CPU it used."""
    cmd = fio_command(fio, filename, rw, block, volume, iodepth, direct, numjobs)
    cpu0 = _children_cpu_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    child_cpu = _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    out = proc.stdout
    doc: dict[str, Any] = json.loads(out[out.index("{"):])  # fio may print warnings first
    jobs = doc["jobs"]
    moved = sum(int(j[rw]["io_bytes"]) for j in jobs)
    runtime_ms = max(float(j[rw]["runtime"]) for j in jobs)
    if len(jobs) != numjobs or moved != volume // numjobs * numjobs or runtime_ms <= 0:
        raise RuntimeError(f"fio {rw}: {len(jobs)} jobs moved {moved} of {volume} bytes in "
                           f"{runtime_ms} ms")
    return FioRun(seconds=runtime_ms / 1000.0, io_bytes=moved,
                  cpu_s=sum(_job_cpu_s(j) for j in jobs), child_cpu_s=child_cpu)


def run_fio(fio: str, filename: str, rw: str, block: int, volume: int,
            iodepth: int, direct: bool = True) -> float:
    """Seconds fio needed to move ``volume`` bytes (its own runtime)."""
    return measure_fio(fio, filename, rw, block, volume, iodepth, direct).seconds


def remove(filename: str, numjobs: int = 1) -> None:
    names = [filename] if numjobs == 1 else [f"{filename}.{j}" for j in range(numjobs)]
    for name in names:
        with suppress(FileNotFoundError):
            os.unlink(name)
