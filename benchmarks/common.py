"""Shared helpers: units, statistics, machine description, page cache, durability.

Page cache ("cold" reads).  :class:`Cold` empties it before every timed read so that
peers, which read through the page cache, read from the device like kvstore (O_DIRECT):

* ``drop``: ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches`` (needs root; the whole
  machine's clean page cache goes, including kvstore's LMDB index pages - the honest
  "after a restart" state);
* ``fadvise``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file the system wrote
  (after syncing it: dirty pages cannot be dropped); no privileges needed;
* ``none``: nothing (smoke runs).

Durability of peers.  Peers do not fsync; their store time ends with one ``syncfs`` of
the scratch file system (:func:`syncfs`), so every system is timed to durable bytes.
Before every timed store the file system is synced once, outside the timing, so one
system's (or another process's) dirty pages are not charged to the next.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_libc = ctypes.CDLL(None, use_errno=True)


def human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """``64K``, ``2M``, ``1.5GiB``, ``4096`` -> bytes (the scripts' size options)."""
    units = {"K": KiB, "M": MiB, "G": GiB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): with N samples, p99 is the max for N < 100."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def rss_bytes() -> dict[str, int]:
    """This process's resident set now and at its peak (VmRSS, VmHWM)."""
    out = {"rss": 0, "peak_rss": 0}
    with suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss"] = int(line.split()[1]) * KiB
                elif line.startswith("VmHWM:"):
                    out["peak_rss"] = int(line.split()[1]) * KiB
    return out


def reset_peak_rss() -> None:
    """Start VmHWM afresh at the current VmRSS (``echo 5 > /proc/self/clear_refs``, Linux
    >= 4.0), so that the next :func:`rss_bytes` peak is this measurement's; a no-op where
    the kernel refuses."""
    with suppress(OSError):
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5\n")


def process_cpu_seconds() -> float:
    """User + system CPU time of this process so far, every thread of it (the event loop,
    I/O threads, the LMDB writer, io_uring workers); ``CLOCK_PROCESS_CPUTIME_ID``, finer
    than ``os.times``' clock ticks."""
    return time.process_time()


@contextmanager
def timed() -> Iterator[Callable[[], tuple[float, float]]]:
    """Wall seconds and this process's CPU seconds of the block; call the yielded
    function after it."""
    wall, cpu = time.perf_counter(), process_cpu_seconds()
    result: list[tuple[float, float]] = []
    yield lambda: result[0]
    result.append((time.perf_counter() - wall, process_cpu_seconds() - cpu))


def syncfs(path: str) -> None:
    """Flush the file system holding ``path`` (``syncfs(2)``; ``sync`` where missing)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs({path}) failed: {os.strerror(err)}")
    except AttributeError:
        os.sync()
    finally:
        os.close(fd)


def dirty_limit_bytes() -> dict[str, int]:
    """The kernel's dirty page thresholds now (bytes): writers are throttled past
    ``dirty``, background writeback starts past ``background``."""
    out = {"dirty": 0, "background": 0}
    page = os.sysconf("SC_PAGE_SIZE")
    with suppress(OSError, ValueError):
        with open("/proc/vmstat", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == "nr_dirty_threshold":
                    out["dirty"] = int(value) * page
                elif name == "nr_dirty_background_threshold":
                    out["background"] = int(value) * page
    return out


class Cold:
    """Makes the next read cold (see the module docstring for the modes)."""

    DROP_CACHES = "/proc/sys/vm/drop_caches"

    def __init__(self, mode: str, root: str) -> None:
        if mode not in ("auto", "drop", "fadvise", "none"):
            raise ValueError(f"cold mode must be auto, drop, fadvise or none, not {mode!r}")
        self.root = root
        if mode == "auto":
            mode = "drop" if self._can_drop() else "fadvise"
        self.mode = mode

    def _can_drop(self) -> bool:
        if os.geteuid() != 0 or not os.access(self.DROP_CACHES, os.W_OK):
            return False
        try:
            self._drop()
        except OSError:
            return False
        return True

    def _drop(self) -> None:
        syncfs(self.root)
        with open(self.DROP_CACHES, "w", encoding="ascii") as f:
            f.write("3\n")

    def describe(self) -> str:
        return {"drop": "page cache dropped before every timed read (sync; echo 3 > "
                        "/proc/sys/vm/drop_caches)",
                "fadvise": "written files evicted with posix_fadvise(DONTNEED) before every "
                           "timed read (drop_caches not permitted here); kvstore reads with "
                           "O_DIRECT, its LMDB index stays cached",
                "none": "page cache left alone (smoke run): peers' reads may be warm"}[self.mode]

    def __call__(self, files: Iterable[str] = ()) -> None:
        if self.mode == "drop":
            self._drop()
        elif self.mode == "fadvise":
            syncfs(self.root)
            for path in files:
                with suppress(OSError):
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def mount_of(path: str) -> dict[str, str]:
    """File system type, device and mount point holding ``path`` (from mountinfo)."""
    real = os.path.realpath(path)
    best = {"fstype": "unknown", "device": "unknown", "mount": "/"}
    best_len = -1
    with suppress(OSError):
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4].replace("\\040", " ")
                fstype, device = right.split()[:2]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= best_len:
                    best, best_len = {"fstype": fstype, "device": device, "mount": mnt}, len(mnt)
    return best


def git_source(pkg_dir: str) -> str:
    """``pkg_dir @ commit`` (``+dirty`` with uncommitted changes under it)."""
    try:
        head = subprocess.run(["git", "-C", pkg_dir, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", pkg_dir, "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return pkg_dir
    if head.returncode != 0:
        return pkg_dir
    return f"{pkg_dir} @ {head.stdout.strip()}{'+dirty' if dirty.stdout.strip() else ''}"


def machine_info(directory: str) -> dict[str, Any]:
    import torch

    import kvstore

    cpu = "unknown"
    with suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    mem_gib = 0.0
    with suppress(ValueError, OSError):
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    mnt = mount_of(directory)
    sched = "unknown"
    sysdev = os.path.realpath(f"/sys/class/block/{os.path.basename(mnt['device'])}")
    for cand in (sysdev, os.path.dirname(sysdev)):  # a partition's queue is its disk's
        try:
            with open(os.path.join(cand, "queue", "scheduler"), encoding="utf-8") as f:
                sched = f.read().strip()
            break
        except OSError:
            pass
    st = os.statvfs(directory)
    return {
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kvstore": kvstore.__version__,
        "kvstore_source": git_source(os.path.dirname(os.path.abspath(kvstore.__file__))),
        "dir": os.path.abspath(directory),
        "fs_type": mnt["fstype"],
        "fs_device": mnt["device"],
        "fs_mount": mnt["mount"],
        "fs_free_gib": round(st.f_bavail * st.f_frsize / GiB, 1),
        "io_scheduler": sched,
        "dirty_thresholds": dirty_limit_bytes(),
        "loadavg_start": loadavg(),
    }


class CpuMeter:
    """How busy the rest of the machine is: CPU time of everything except this process
    and its waited-for children, and hypervisor steal, from /proc/stat, in % of one CPU.
    Kernel threads doing our own I/O count as "other": a quiet machine shows a few %."""

    def __init__(self) -> None:
        self._hz = os.sysconf("SC_CLK_TCK")
        self._last = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        busy = steal = 0.0
        with suppress(OSError, ValueError, IndexError):
            with open("/proc/stat", encoding="ascii") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
            steal = vals[7] / self._hz
            busy = (sum(vals[:8]) - vals[3] - vals[4] - vals[7]) / self._hz
        t = os.times()
        return time.perf_counter(), busy, steal, t.user + t.system + t.children_user + \
            t.children_system

    def lap(self) -> dict[str, float]:
        now = self._read()
        t0, busy0, steal0, own0 = self._last
        t, busy, steal, own = now
        wall = max(t - t0, 1e-9)
        self._last = now
        return {"seconds": wall,
                "other_cpu_pct": max(0.0, (busy - busy0) - (own - own0)) / wall * 100,
                "steal_pct": (steal - steal0) / wall * 100}


def head_commit(repo: str) -> str:
    """The short commit of ``repo``'s HEAD (what a results file is named after)."""
    out = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def scratch_dir(directory: str | None, repo: str) -> str:
    """``directory``, or ``repo/.bench-tmp`` (made if missing): where a benchmark writes."""
    if directory is None:
        directory = os.path.join(repo, ".bench-tmp")
        os.makedirs(directory, exist_ok=True)
    return directory


def write_results(base: str, text: str, doc: dict[str, Any]) -> None:
    """A benchmark's report as ``base.md`` (markdown) and ``base.json`` (every number)."""
    import json

    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)


async def in_scratch(prefix: str, directory: str,
                     run: Callable[[str], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """``await run(root)`` in a new directory under ``directory``, removed after."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix=prefix, dir=directory)
    try:
        return await run(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
