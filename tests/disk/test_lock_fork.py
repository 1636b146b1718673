"""A forked child does not keep the store locked (issue 31, a sibling of item 4).

A ``flock`` belongs to the open file description, which a child shares through its copy
of the descriptor: the lock dropped only when the last copy closed, so a child that ran
on (a worker process) kept the store locked after the parent had closed it.  The child
now closes its copy at fork, which never unlocks the parent's store while it is open.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
import pytest

import kvstore
from kvstore.disk import lock


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_running_child_neither_keeps_the_lock_nor_takes_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        held_r, held_w = os.pipe()
        report_r, report_w = os.pipe()
        async with kvstore.open(tmp_path):
            pid = os.fork()
            if pid == 0:  # the child: reports, then runs on until the parent says
                try:
                    os.write(report_w, b"up")
                    os.read(held_r, 1)
                finally:
                    os._exit(0)
            assert os.read(report_r, 2) == b"up"
            # Still the parent's: an exclusive opener is refused while it is open.
            with pytest.raises(kvstore.StoreLockedError):
                async with kvstore.open(tmp_path, exclusive=True):
                    pass
        try:
            # Closed by the parent while the child still runs: free for the next one.
            async with kvstore.open(tmp_path) as again:
                assert again.stats().blocks == 0
        finally:
            os.write(held_w, b"x")
            _, status = os.waitpid(pid, 0)
            for fd in (held_r, held_w, report_r, report_w):
                os.close(fd)
        assert os.waitstatus_to_exitcode(status) == 0

    anyio.run(scenario)


# ------------------------------------------------------------- a fork while another thread
# opens or releases the lock.  The store opens (``open``) and closes (``aclose``) on a worker
# thread, so an engine that forks from its event loop thread meanwhile raced the lock: a
# child forked after the descriptor was opened but before the lock was registered, or after
# it was unregistered but before it was closed, kept an untracked copy, and with it the
# store's lock for as long as it lived.  The thread is stepped through lock.py one line at a
# time (a trace function holds it), and the process forks at every step.

def _lock_descriptors() -> int:
    """Descriptors of this process on a LOCK file."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{lock.LOCK_FILE}")
    return n


class _Stepper:
    """Runs ``work`` on a thread that stops at its ``step``-th line inside kvstore/disk/lock.py
    until the process forks (the test's own before-fork hook lets it go, so a fork that
    waits for the thread to leave lock.py does not wait forever)."""

    def __init__(self, work: Callable[[], object], step: int) -> None:
        self.work, self.step = work, step
        self.lines = 0
        self.paused = threading.Event()  # at the step (or done: fewer lines than that)
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lock-stepper")

    def _trace(self, frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code.co_filename != lock.__file__:
            return None
        if event == "line":
            self.lines += 1
            if self.lines == self.step:
                self.paused.set()
                self.go.wait()
        return self._trace

    def _run(self) -> None:
        sys.settrace(self._trace)
        try:
            self.work()
        finally:
            sys.settrace(None)
            self.paused.set()


_STEPPER: list[_Stepper] = []  # the one a fork should release (at most one)


def _release_stepper() -> None:
    for s in _STEPPER:
        s.go.set()


if hasattr(os, "register_at_fork"):
    # Registered after kvstore.disk.lock's hooks, so it runs before them (before-fork hooks
    # run last-registered first).
    os.register_at_fork(before=_release_stepper)


def _fork_and_count() -> int:
    """Fork; the child reports how many LOCK descriptors it has and exits."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, bytes([min(_lock_descriptors(), 255)]))
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 1)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return got[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not hasattr(os, "fork"),
                    reason="needs fork and /proc")
@pytest.mark.parametrize("what", ["open", "release"])
def test_a_fork_at_any_point_of_opening_or_releasing_leaves_the_child_no_lock(
        tmp_path: Path, what: str) -> None:
    held: list[lock.StoreLock] = []

    def work() -> None:
        if what == "open":
            held.append(lock.StoreLock(str(tmp_path)))
        else:
            held[0].release()

    step = 1
    while True:
        held.clear()
        if what == "release":
            held.append(lock.StoreLock(str(tmp_path)))
        stepper = _Stepper(work, step)
        _STEPPER[:] = [stepper]
        try:
            stepper.thread.start()
            stepper.paused.wait()
            inherited = _fork_and_count()
        finally:
            stepper.go.set()
            stepper.thread.join()
            _STEPPER.clear()
        assert inherited == 0, f"a child forked at line {step} of {what} kept the LOCK descriptor"
        for h in held:
            h.release()
        if stepper.lines < step:  # forked after the last line: every point was tried
            break
        step += 1
    assert step > 3  # the thread did stop inside lock.py


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_the_store_closes_on_its_worker_thread_does_not_keep_it_locked(
        tmp_path: Path) -> None:
    """The store's own close: its lock is released on the cleanup thread; the event loop
    forks a child that runs on, at each line of that release."""
    async def open_close(step: int, children: list[tuple[int, int]]) -> _Stepper:
        async with kvstore.open(tmp_path):
            mine = [h for h in list(lock._HELD) if h.path == str(tmp_path)]
            assert len(mine) == 1
            stepper = _Stepper(mine[0].release, step)  # as aclose() does, on its thread
            _STEPPER[:] = [stepper]
            try:
                stepper.thread.start()
                stepper.paused.wait()
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # runs on until the parent has reopened the store
                    try:
                        os.close(w)
                        os.read(r, 1)
                    finally:
                        os._exit(0)
                os.close(r)
                children.append((pid, w))
            finally:
                stepper.go.set()
                stepper.thread.join()
                _STEPPER.clear()
        return stepper

    step = 1
    while True:
        children: list[tuple[int, int]] = []
        stepper = anyio.run(open_close, step, children)
        try:
            async def reopen() -> None:
                async with kvstore.open(tmp_path):
                    pass
            anyio.run(reopen)  # while the child still runs
        finally:
            for pid, w in children:
                os.close(w)
                os.waitpid(pid, 0)
        if stepper.lines < step:
            break
        step += 1
    assert step > 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_a_child_that_has_not_run_its_fork_hook_does_not_keep_the_store_locked(
        tmp_path: Path) -> None:
    """A child closes its copy of the descriptor in its at-fork hook, which runs when the
    child is scheduled: until then (or for ever, for a process made by native code,
    which runs no Python hook) it shares the parent's lock.  Before, a parent that
    closed and reopened the store first got ``StoreLockedError`` (seen as a flaky
    reopen in the concurrent state machine).  Here the child is made by
    ``_posixsubprocess`` (fork and exec in C, no Python hook) with the descriptor handed
    down, so it holds a copy of the parent's open file description, as a child that
    never ran the hook does; it blocks reading its stdin until the parent has reopened.
    The parent's release unlocks, whatever copies remain.

    (This test forked with libc's ``fork`` through ctypes before, and the child then ran
    Python bytecode: when another thread of the test process had asked for the GIL at
    the fork, the child waited for a GIL hand-over to that thread, which it does not
    have, for ever: a hung CI run.)"""
    child: subprocess.Popen[bytes] | None = None

    async def scenario() -> subprocess.Popen[bytes]:
        async with kvstore.open(tmp_path):
            (held,) = [h for h in list(lock._HELD) if h.path == str(tmp_path)]
            proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, pass_fds=(held.fd,))
            assert _child_has_lock_descriptor(proc.pid)  # it shares the parent's lock
        return proc

    try:
        child = anyio.run(scenario)

        async def reopen() -> None:
            async with kvstore.open(tmp_path) as again:
                assert again.stats().blocks == 0

        anyio.run(reopen)  # while the child still holds its copy
        assert _child_has_lock_descriptor(child.pid)
    finally:
        if child is not None:
            assert child.stdin is not None
            child.stdin.close()   # cat ends
            assert child.wait() == 0


def _child_has_lock_descriptor(pid: int) -> bool:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").endswith(f"/{lock.LOCK_FILE}"):
                return True
    return False
