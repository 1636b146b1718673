"""A simulated disk behind the I/O-engine protocol: the test seam of the crash tests.

``SimulatedDisk`` outlives store instances (it is "the hardware"); a store opened with
``engine=SimulatedEngine(disk)`` does its extent I/O through it.  The disk

* writes through to the real files (so reads and reopen see them, like a page cache) and
  keeps, per file, an undo record of every write since that file's last fdatasync;
* enforces O_DIRECT rules (4 KiB-aligned offsets, lengths and buffer addresses: EINVAL);
* completes the ops of one call in a shuffled order, as io_uring may, and yields to the
  event loop a seeded random number of times (``SimulatedDisk.max_yields``, at least
  once) before every op: other tasks run while I/O is "in flight", ops of concurrent
  calls complete interleaved and out of order, and a caller can be cancelled at any of
  these scheduling points (ops already done stay done, later ones never start, which is
  what a cancelled real engine leaves too).  One seed decides every delay and order;

* counts I/O operations and can stop the "machine" at a chosen one
  (:class:`SimulatedCrash`, a ``BaseException`` so no ``except Exception`` swallows it), or
  fail it with EIO / ENOSPC / a short write;
* materialises any legal crash state of the unsynced writes: each one lost or kept,
  torn at 512-byte sectors, or filled with garbage (:meth:`SimulatedDisk.crash`).

LMDB writes its own files, so it is not simulated here: a crash leaves it at its last
committed transaction, which is exactly what stopping the process before the next
commit gives (commits happen after all extent I/O of a batch).  A new extent file's
space and header go through the engine too (``initialise``:
kvstore/io/extent_files.py), so its faults and crashes are simulated as well.
"""

from __future__ import annotations

import errno as _errno
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio

from kvstore.disk.format import PAGE
from kvstore.errors import StoreIOError
from kvstore.io.protocol import IoOp
from kvstore.io.threads import raise_write_errors

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

SECTOR = 512
CRASH_MODES = ("lose", "keep", "random", "torn", "garbage")


class SimulatedCrash(BaseException):
    """The simulated machine stopped at this I/O operation."""


def is_simulated_crash(e: BaseException) -> bool:
    """True for a SimulatedCrash, or a task-group exception made only of them."""
    if isinstance(e, SimulatedCrash):
        return True
    return isinstance(e, BaseExceptionGroup) and all(is_simulated_crash(x) for x in e.exceptions)


@dataclass
class _Pending:
    offset: int
    old: bytes
    new: bytes


@dataclass
class SimulatedDisk:
    seed: int = 0
    ops: int = 0
    """I/O operations (each write, read or fdatasync of one file) issued so far."""
    crash_at: int | None = None
    """Stop the machine when ``ops`` reaches this number (before the op takes effect)."""
    faults: list[tuple[str, int]] = field(default_factory=list)
    """Queued faults: (``"write"``/``"read"``/``"datasync"``/``"initialise"``, errno or
    -1 for a short write)."""
    crash_states: int = 0
    pending: dict[str, list[_Pending]] = field(default_factory=dict)
    max_yields: int = 3
    """Scheduling points before each op: 1 to this many, drawn from the seed."""
    yields: int = 0
    """Scheduling points taken so far."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def unsynced_writes(self) -> int:
        return sum(len(v) for v in self.pending.values())

    def _tick(self) -> None:
        self.ops += 1
        if self.crash_at is not None and self.ops >= self.crash_at:
            self.crash_at = None
            raise SimulatedCrash(f"simulated crash at I/O op {self.ops}")

    def _fault(self, kind: str) -> int | None:
        for i, (k, code) in enumerate(self.faults):
            if k == kind:
                del self.faults[i]
                return code
        return None

    def drop(self, path: str) -> int:
        """What Linux may do when an fdatasync of ``path`` fails: the dirty pages it
        could not write are dropped, the file reads its old bytes there, and a later
        sync succeeds with nothing to say about them.  Returns the writes dropped."""
        writes = self.pending.pop(path, [])
        with open(path, "r+b") as f:
            for w in reversed(writes):  # newest first, so overlaps restore correctly
                f.seek(w.offset)
                f.write(w.old)
        return len(writes)

    def crash(self, mode: str, keep: Sequence[bool] | None = None, *,
              moved: tuple[str, str] | None = None, clear: bool = True) -> int:
        """Turn the unsynced writes into one legal post-crash state; returns how many there
        were.  ``keep`` (one flag per pending write, in issue order, files sorted by path)
        overrides the mode's choice of which writes survive whole.  ``moved=(old, new)``
        applies the state to a copy of the store made at ``new`` (path prefix swapped),
        and ``clear=False`` keeps the pending writes for further states."""
        if mode not in CRASH_MODES:
            raise ValueError(f"mode must be one of {CRASH_MODES}")
        writes = [(path, w) for path in sorted(self.pending) for w in self.pending[path]]
        if keep is not None and len(keep) != len(writes):
            raise ValueError(f"keep has {len(keep)} flags for {len(writes)} pending writes")
        # Undo from the newest write back, so overlapping writes restore correctly.
        for n in range(len(writes) - 1, -1, -1):
            path, w = writes[n]
            if keep is not None:
                image = w.new if keep[n] else w.old
            elif mode == "lose":
                image = w.old
            elif mode == "keep":
                image = w.new
            elif mode == "random":
                image = w.new if self.rng.random() < 0.5 else w.old
            elif mode == "torn":
                image = b"".join(
                    (w.new if self.rng.random() < 0.5 else w.old)[i:i + SECTOR]
                    for i in range(0, len(w.new), SECTOR))
            else:  # garbage: what a device may return for a page it never finished
                image = b"".join(
                    self.rng.randbytes(PAGE) if self.rng.random() < 0.5 else w.new[i:i + PAGE]
                    for i in range(0, len(w.new), PAGE))
            if moved is not None:
                path = moved[1] + path[len(moved[0]):]
            with open(path, "r+b") as f:
                f.seek(w.offset)
                f.write(image)
        if clear:
            self.pending.clear()
        self.crash_states += 1
        return len(writes)


class SimulatedEngine:
    name = "simulated"
    direct = False

    def __init__(self, disk: SimulatedDisk) -> None:
        self.disk = disk
        self._paths: dict[int, str] = {}

    async def start(self) -> None:
        return None

    def open_file(self, path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._paths[fd] = path
        return fd

    def close_file(self, fd: int) -> None:
        self._paths.pop(fd, None)
        os.close(fd)

    def _check_direct(self, op: IoOp, address: int) -> None:
        if op.offset % PAGE or op.run.length % PAGE or address % PAGE:
            raise OSError(_errno.EINVAL, "O_DIRECT transfer not 4 KiB-aligned")

    def _shuffled(self, ops: Sequence[IoOp]) -> list[int]:
        order = list(range(len(ops)))
        self.disk.rng.shuffle(order)
        return order

    async def _delay(self) -> None:
        """A seeded number of scheduling points: the op is "on the device" meanwhile."""
        n = self.disk.rng.randint(1, max(1, self.disk.max_yields))
        self.disk.yields += n
        for _ in range(n):
            await anyio.lowlevel.checkpoint()

    async def _each(self, ops: Sequence[IoOp], kind: str,
                    transfer: Callable[[IoOp, int | None], int]) -> list[int | OSError]:
        """Run ``transfer`` on every op in a shuffled order, one I/O tick each, after the
        O_DIRECT checks; an injected errno fails the op, other faults go to ``transfer``.
        Each op waits its seeded delay first."""
        results: list[int | OSError] = [0] * len(ops)
        for i in self._shuffled(ops):
            op = ops[i]
            await self._delay()
            self.disk._tick()
            try:
                self._check_direct(op, op.run.offset)
                fault = self.disk._fault(kind)
                if fault is not None and fault > 0:
                    raise OSError(fault, os.strerror(fault))
                results[i] = transfer(op, fault)
            except OSError as e:
                results[i] = e
        return results

    def _write_one(self, op: IoOp, fault: int | None) -> int:
        new = bytes(op.run.view)
        if fault == -1:  # short write: only the first half reaches the file
            new = new[: len(new) // 2]
        old = os.pread(op.fd, len(new), op.offset)
        old += bytes(len(new) - len(old))
        self.disk.pending.setdefault(self._paths[op.fd], []).append(_Pending(op.offset, old, new))
        return os.pwrite(op.fd, new, op.offset)

    async def write(self, ops: Sequence[IoOp]) -> None:
        raise_write_errors(await self._each(ops, "write", self._write_one), ops, "write")

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        return await self._each(ops, "read",
                                lambda op, _: os.preadv(op.fd, [op.run.view], op.offset))

    async def initialise(self, fd: int, nbytes: int, header: bytes) -> None:
        """One I/O tick; an injected ``"initialise"`` errno fails it (ENOSPC: no room).
        Durable at once when it returns, as the real engines' fsync makes it."""
        await self._delay()
        self.disk._tick()
        fault = self.disk._fault("initialise")
        if fault is not None:
            raise OSError(fault, os.strerror(fault))
        os.posix_fallocate(fd, 0, nbytes)
        os.pwrite(fd, header, 0)

    async def datasync(self, fds: Sequence[int]) -> None:
        for fd in fds:
            await self._delay()
            self.disk._tick()
            fault = self.disk._fault("datasync")
            if fault is not None:
                # After a failed fsync the kernel may drop the dirty pages, and it does
                # here: a later sync that succeeds would otherwise make them durable,
                # hiding a store that acknowledged them after the failure (fsyncgate).
                self.disk.drop(self._paths[fd])
                raise StoreIOError(fault, f"fdatasync failed: {os.strerror(abs(fault))}")
            self.disk.pending.pop(self._paths[fd], None)

    async def aclose(self) -> None:
        return None
