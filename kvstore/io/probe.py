"""Start-up probe: which I/O engine works on this host and file system.

Tried in order, on a scratch file inside the store directory (the file system that
matters is the store's own, not /tmp's):

1. O_DIRECT: open, write one aligned page, read it back.  tmpfs and some overlay /
   network file systems refuse it (EINVAL) -> buffered I/O.
2. io_uring: the binding imports, a ring is set up (ENOSYS on old kernels, EPERM under
   seccomp), and one write + read + fdatasync round trip returns the same bytes.

The result names the engine, whether O_DIRECT is on, and why anything was not used;
``stats()`` reports it.  ``open(engine=...)`` skips the probe.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

from kvstore.disk.layout import probe_path
from kvstore.io.liburing_import import import_liburing

ENGINES = ("auto", "io_uring", "threads")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    engine: str
    direct: bool
    reason: str


def _create(path: str, flags: int) -> int:
    """A new probe file, never one reached through a link: a stale one (a crash
    mid-probe) is removed first (unlink removes a link, not its target), then created
    with O_EXCL | O_NOFOLLOW (kvstore writes nothing outside the store's directory)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                   | flags, 0o600)


def probe_direct(directory: str) -> tuple[bool, str]:
    path = probe_path(directory, "direct")
    buf = mmap.mmap(-1, 4096)
    try:
        fd = _create(path, os.O_DIRECT)
    except OSError as e:
        return False, f"O_DIRECT open refused ({e.strerror})"
    try:
        buf[:8] = b"kvstore!"
        os.pwritev(fd, [buf], 0)
        buf[:8] = bytes(8)
        os.preadv(fd, [buf], 0)
        if buf[:8] != b"kvstore!":
            return False, "O_DIRECT read back different bytes"
        return True, "O_DIRECT works"
    except OSError as e:
        return False, f"O_DIRECT I/O refused ({e.strerror})"
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def probe_uring(directory: str, direct: bool) -> tuple[bool, str]:
    try:
        lu = import_liburing()
    except ImportError as e:
        return False, f"liburing not importable ({e})"
    if not hasattr(lu, "io_uring"):
        return False, "unsupported liburing release (need liburing==2024.5.3)"
    ring = lu.io_uring()
    try:
        lu.io_uring_queue_init(4, ring, 0)
    except OSError as e:
        return False, f"io_uring_setup refused ({e.strerror})"
    path = probe_path(directory, "uring")
    buf = mmap.mmap(-1, 4096)
    view = memoryview(buf)
    fd = _create(path, os.O_DIRECT if direct else 0)
    cqe = lu.io_uring_cqe()
    try:
        def run(prep: object) -> int:
            sqe = lu.io_uring_get_sqe(ring)
            prep(sqe)  # type: ignore[operator]
            sqe.user_data = 1
            lu.io_uring_submit_and_wait(ring, 1)
            lu.io_uring_peek_cqe(ring, cqe)
            res = int(cqe.res)
            lu.io_uring_cqe_seen(ring, cqe)
            return res

        buf[:8] = b"kvstore!"
        if run(lambda s: lu.io_uring_prep_write(s, fd, view, 4096, 0)) != 4096:
            return False, "io_uring write failed"
        if run(lambda s: lu.io_uring_prep_fsync(s, fd, 1)) != 0:
            return False, "io_uring fdatasync failed"
        buf[:8] = bytes(8)
        if run(lambda s: lu.io_uring_prep_read(s, fd, view, 4096, 0)) != 4096 or \
                buf[:8] != b"kvstore!":
            return False, "io_uring read back different bytes"
        return True, "io_uring works"
    except OSError as e:
        return False, f"io_uring I/O failed ({e.strerror})"
    finally:
        lu.io_uring_queue_exit(ring)
        os.close(fd)
        os.unlink(path)
        view.release()
        buf.close()


def probe(directory: str, engine: str = "auto") -> ProbeResult:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    direct, direct_reason = probe_direct(directory)
    if engine == "threads":
        return ProbeResult("threads", direct, f"forced; {direct_reason}")
    ok, why = probe_uring(directory, direct)
    if ok:
        return ProbeResult("io_uring", direct, f"{why}; {direct_reason}")
    if engine == "io_uring":
        raise RuntimeError(f"engine='io_uring' was forced but {why}")
    return ProbeResult("threads", direct, f"fallback: {why}; {direct_reason}")
