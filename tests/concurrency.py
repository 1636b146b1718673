"""Helpers of the concurrency tests: a device whose transfers can be held at a gate, a real
engine by name, and a deadline that turns a hang (even a shielded one) into a failure.

No sleeps: a test holds an operation at a :class:`Gate`, learns that it arrived there from
``Gate.entered``, does what it wants to race with it, and lets it go with ``Gate.open()``.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvstore.io.arena import Arena
from kvstore.io.probe import probe
from kvstore.io.protocol import EngineWrapper, IOEngine, IoOp
from kvstore.io.scheduler import IoSchedule, IoScheduler
from kvstore.io.threads import ThreadPoolEngine

DEADLINE = 60.0
"""Seconds a scenario may take before it counts as hung (generous: CI has 2 busy cores)."""

ENGINES = ["io_uring", "threads"]
BACKENDS = ["asyncio", "trio"]


def real_engine(kind: str, path: Path) -> IOEngine:
    """A fresh io_uring or thread-pool engine, as ``open(engine=kind)`` would make it."""
    path.mkdir(parents=True, exist_ok=True)
    result = probe(str(path), kind)
    if result.engine != kind:
        pytest.skip(f"{kind} is not usable here: {result.reason}")
    if kind == "io_uring":
        from kvstore.io.uring import UringEngine
        return UringEngine(direct=result.direct, queue_depth=16)
    return ThreadPoolEngine(direct=result.direct, queue_depth=16)


class Gate:
    """Holds the next transfer of one kind.  ``hold=False`` only signals its arrival: the
    transfer then goes to the device in the same step, so it is in the kernel's hands when
    the test task runs next."""

    def __init__(self, *, hold: bool = True) -> None:
        self.entered = anyio.Event()
        self._release: anyio.Event | None = anyio.Event() if hold else None
        self.on_enter: Callable[[], Awaitable[None]] | None = None  # runs in the caught task

    def open(self) -> None:
        if self._release is not None:
            self._release.set()

    async def pass_through(self) -> None:
        if self.on_enter is not None:
            await self.on_enter()
        self.entered.set()
        if self._release is not None:
            await self._release.wait()


class GatedEngine(EngineWrapper):
    """A real engine whose next read / write / datasync call can be held at a gate (each
    gate catches one call, then is spent)."""

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner)
        self.gates: dict[str, Gate] = {}

    def gate(self, kind: str, *, hold: bool = True) -> Gate:
        self.gates[kind] = gate = Gate(hold=hold)
        return gate

    async def _arrive(self, kind: str) -> None:
        gate = self.gates.pop(kind, None)
        if gate is not None:
            await gate.pass_through()

    async def write(self, ops: Sequence[IoOp]) -> None:
        await self._arrive("write")
        await self.inner.write(ops)

    async def read(self, ops: Sequence[IoOp]) -> list[int | OSError]:
        await self._arrive("read")
        return await self.inner.read(ops)

    async def datasync(self, fds: Sequence[int]) -> None:
        await self._arrive("datasync")
        await self.inner.datasync(fds)


class SchedulerBench:
    """An I/O scheduler over ``engine``, one file in ``path`` and an arena for buffers.  No
    grace after reads unless a test asks for one: the tests do not wait on clocks."""

    def __init__(self, engine: IOEngine, path: Path, **limits: Any) -> None:
        self.sched = IoScheduler(engine, IoSchedule(**{"read_grace_s": 0.0, **limits}))
        self.arena = Arena(64 << 20)
        self.path = path

    async def __aenter__(self) -> Any:
        await self.sched.start()
        (self.path / "data").touch()
        self.fd = self.sched.open_file(str(self.path / "data"))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.sched.close_file(self.fd)
        await self.sched.aclose()
        self.arena.close()

    def ops(self, nbytes: int, offset: int = 0) -> list[IoOp]:
        run = self.arena.try_acquire(nbytes)
        assert run is not None
        return [IoOp(self.fd, offset, run)]


async def until(condition: Callable[[], bool]) -> None:
    """Let other tasks (and the writer thread) run until ``condition`` holds.  Bounded by the
    scenario's deadline, not by a timer."""
    while not condition():
        await anyio.sleep(0)


def run_within(scenario: Callable[[], Awaitable[Any]], backend: str,
               seconds: float = DEADLINE) -> Any:
    """Run ``scenario`` on ``backend`` in its own thread and fail if it has not ended within
    ``seconds``.  A thread, not ``fail_after``: the hangs this catches sit in shielded
    scopes, which no cancellation reaches."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = anyio.run(scenario, backend=backend)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name="scenario", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the scenario hung: it had not ended after {seconds:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def resident_bytes(address: int, length: int) -> int:
    """Bytes of [address, address+length) resident in RAM, by mincore(2): exact for the
    range, whatever VMA the kernel merged it into (smaps reports whole VMAs)."""
    import ctypes
    import ctypes.util
    import mmap as _mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = _mmap.PAGESIZE
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * page


class SnapshotReader:
    """A process reading the store's index (``PATH/index``), as another process of a
    shared store would, holding one read snapshot until :meth:`end`.  While it does,
    LMDB reuses no page that snapshot may read, so every commit needs new pages:
    ``data.mdb`` must grow (on a full disk, it cannot).  It ends on a line, not at end
    of file: a child forked meanwhile holds a copy of its pipe."""

    SCRIPT = ("import lmdb, sys; env = lmdb.open(sys.argv[1], readonly=True, max_dbs=64); "
              "txn = env.begin(); print('ready', flush=True); sys.stdin.readline()")

    def __init__(self, index: Path) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", self.SCRIPT, str(index)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline() == "ready\n"

    def end(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.write("end\n")
            self._proc.stdin.close()
            try:
                self._proc.wait(DEADLINE)
            finally:
                self._proc.kill()  # (a no-op once it ended)
        assert self._proc.returncode == 0, "the snapshot reader did not end"


def lock_descriptors(store_path: Path) -> int:
    """Descriptors this process has on the LOCK file of the store at ``store_path``."""
    lock_file = os.path.join(os.path.abspath(store_path), "LOCK")
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own)
            n += os.readlink(f"/proc/self/fd/{fd}") == lock_file
    return n


class LiveChild:
    """A child forked from the calling thread (an event loop's, mid-round): it reports what
    ``probe`` returns (a small count; read later, so nothing here waits for the child to be
    scheduled) and then runs on, as a worker process an engine forks would, answering
    :meth:`ask` with ``later(message)`` until :meth:`end`.  It never returns into the
    caller's code (it leaves by ``os._exit``: no atexit handler, no buffer flushed), so it
    cannot run the parent's event loop or store; a probe or ``later`` that raises is its
    exit status 1.  ``later`` runs in the forking thread, which in the child is still
    "inside" the parent's event loop: run anything asynchronous on a new thread."""

    def __init__(self, probe: Callable[[], int],
                 later: Callable[[bytes], bytes] | None = None) -> None:
        report_r, report_w = os.pipe()
        ask_r, self._ask_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            status = 1
            try:
                os.close(report_r)
                os.close(self._ask_w)
                os.write(report_w, bytes([min(probe(), 255)]))
                while (message := _receive(ask_r, None)) is not None:  # None: parent ended it
                    _send(report_w, b"" if later is None else later(message))
                status = 0
            finally:
                os._exit(status)
        os.close(report_w)
        os.close(ask_r)
        # Read at the end, not now: the parent runs on while the child may not even
        # have run its at-fork hooks yet (the window that kept the store locked).
        self._report_r = report_r
        self.report: int | None = None
        self.status: int | None = None

    def _read_report(self) -> None:
        if self.report is None:
            got = _read_exactly(self._report_r, 1, DEADLINE)  # written at once by the child
            self.report = got[0] if got else None

    def ask(self, message: bytes) -> bytes:
        """Have the child run ``later(message)`` now; its answer.  Fails if the child
        ended without one or gave none within :data:`DEADLINE` (it is then killed)."""
        self._read_report()
        _send(self._ask_w, message)
        answer = _receive(self._report_r, DEADLINE)
        if answer is None:
            os.kill(self.pid, 9)
            pytest.fail(f"the forked child {self.pid} gave no answer to {message!r} "
                        f"within {DEADLINE:.0f} s (hung, or ended)")
        return answer

    def end(self) -> int:
        """Let it exit; its exit status (and ``report``, what its probe returned)."""
        if self.status is None:
            try:
                self._read_report()
            finally:
                os.close(self._report_r)
                os.close(self._ask_w)
            _, raw = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(raw)
        return self.status


def _read_exactly(fd: int, n: int, seconds: float | None) -> bytes:
    """Up to ``n`` bytes from ``fd`` (fewer at end of file), waiting at most ``seconds``
    for each part (None: for ever)."""
    out = b""
    while len(out) < n:
        if seconds is not None and not select.select([fd], [], [], seconds)[0]:
            break
        part = os.read(fd, n - len(out))
        if not part:
            break
        out += part
    return out


def _send(fd: int, message: bytes) -> None:
    data = len(message).to_bytes(4, "little") + message
    while data:
        data = data[os.write(fd, data):]


def _receive(fd: int, seconds: float | None) -> bytes | None:
    """One message :func:`_send` wrote; None at end of file or past ``seconds``."""
    head = _read_exactly(fd, 4, seconds)
    if len(head) < 4:
        return None
    size = int.from_bytes(head, "little")
    body = _read_exactly(fd, size, seconds)
    return body if len(body) == size else None
