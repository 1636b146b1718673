"""The owners of a store (issue 43, kvstore/core/owners.py): every open Store registers
a row in the index and holds a lock file; a killed process's row is recovered by the
next opener; ``sync`` must agree among live owners; ``LOCK`` is shared by default and
exclusive with ``exclusive=True`` (and for fsck's repairs), with errors naming the
processes that hold it.  Other processes are real ones (subprocess), killed with
SIGKILL where the test says so.

Several processes share a store: each is an owner beside the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore
from kvstore.disk import layout
from kvstore.disk.lock import live_owner_pids, probe_owner
from kvstore.index.owners import OwnerRecord
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, keys

ROOT = Path(__file__).resolve().parents[2]

HOLDER = textwrap.dedent("""
    import sys, kvstore
    from tests.conformance import NS
    path, sync, exclusive = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
    try:
        store = kvstore.open_blocking(path, namespace=NS, extent_bytes=1 << 20,
                                      engine="threads", sync=sync, exclusive=exclusive)
    except kvstore.KVStoreError as e:
        print("refused", type(e).__name__, e, flush=True)
        sys.exit(0)
    print("open", flush=True)
    sys.stdin.readline()  # until the test says (or kills it)
    store.close()
    print("closed", flush=True)
""")


@contextmanager
def holder(path: Path, *, sync: bool = True, exclusive: bool = False
           ) -> Iterator[subprocess.Popen[str]]:
    """Another process with the store open until the block ends (it closes then)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(int(sync)),
                             str(int(exclusive))], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line == "open\n", line
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.close()
        proc.wait(timeout=120)
        proc.stdout.close()


def lock_files(path: Path) -> list[str]:
    """The owner lock files in ``PATH/owners`` (the marks file beside them stays: it is
    mapped by whoever opens the store next, so nobody unlinks it while it may be)."""
    return sorted(n for n in os.listdir(layout.owners_dir(str(path)))
                  if n != layout.MARKS_FILE)


def other_open(path: Path, *, sync: bool = True, exclusive: bool = False) -> str:
    """What another process's open says: "open" (then it closes) or why it was refused."""
    run = subprocess.run([sys.executable, "-c", HOLDER, str(path), str(int(sync)),
                          str(int(exclusive))], cwd=ROOT, text=True, input="\n",
                         capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()[0]


def owner_rows(store: kvstore.BlockingStore) -> dict[int, OwnerRecord]:
    index = parts(store).index
    with index.begin() as txn:
        return index.owner_records.rows(txn)


def open_here(path: Path, **options: Any) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=1 << 20, engine="threads",
                                 **options)


def test_an_open_store_is_a_registered_owner_until_it_closes(tmp_path: Path) -> None:
    with open_here(tmp_path) as store:
        me = parts(store).owner
        rows = owner_rows(store)
        assert list(rows) == [me.id]
        assert rows[me.id].pid == os.getpid() and rows[me.id].sync
        assert probe_owner(str(tmp_path), me.id) is None  # its lock is held: alive
        assert live_owner_pids(str(tmp_path)) == [os.getpid()]
    assert lock_files(tmp_path) == []
    with open_here(tmp_path) as again:
        assert list(owner_rows(again)) == [me.id + 1]  # ids are never reused
        assert parts(again).owner.recovered == 0


def test_a_killed_owner_is_recovered_by_the_next_open(tmp_path: Path) -> None:
    with holder(tmp_path) as proc:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    [left] = lock_files(tmp_path)  # its lock file, not held
    assert live_owner_pids(str(tmp_path)) == []
    with open_here(tmp_path) as store:
        assert parts(store).owner.recovered == 1
        assert list(owner_rows(store)) == [parts(store).owner.id]
        stats = store.stats()
        assert (stats.owner_id, stats.owners_recovered) == (parts(store).owner.id, 1)
        assert left not in lock_files(tmp_path)
    assert fsck.check(str(tmp_path)).problems == []


def test_a_second_process_opens_beside_the_owner(tmp_path: Path) -> None:
    with open_here(tmp_path) as store:
        assert other_open(tmp_path) == "open"
        assert list(owner_rows(store)) == [parts(store).owner.id]  # it closed: its row went
    assert lock_files(tmp_path) == []


def test_sync_must_agree_among_live_owners(tmp_path: Path) -> None:
    with open_here(tmp_path, sync=True):
        said = other_open(tmp_path, sync=False)
    assert said.startswith("refused OptionMismatchError")
    assert f"open with sync=True (pid {os.getpid()})" in said and "sync=False" in said


def test_an_exclusive_open_refuses_others_and_is_refused_beside_them(tmp_path: Path) -> None:
    with open_here(tmp_path, exclusive=True):
        said = other_open(tmp_path)
        assert said.startswith("refused StoreLockedError")
        assert f"open exclusively (holder pid {os.getpid()}" in said
    with holder(tmp_path) as proc:
        with pytest.raises(kvstore.StoreLockedError,
                           match=rf"open in 1 process\(es\) \(pid {proc.pid}\); this needs it "
                                 "alone"):
            open_here(tmp_path, exclusive=True)
        # fsck's repairs take it exclusively too, and say who uses it
        with pytest.raises(kvstore.StoreLockedError, match=rf"\(pid {proc.pid}\)"):
            fsck.check(str(tmp_path), repair=True)
    said = other_open(tmp_path, exclusive=True)  # all closed: free again
    assert said == "open"


MAKER = textwrap.dedent("""
    import sys, anyio, torch, kvstore
    from kvstore.io.threads import ThreadPoolEngine
    from tests.conformance import NS, keys
    class Held(ThreadPoolEngine):
        async def initialise(self, fd, nbytes, header):
            print("creating", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)  # killed here
            await super().initialise(fd, nbytes, header)
    async def main():
        async with kvstore.open(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                                engine=Held(direct=False)) as store:
            await store.put_many(keys(1), [torch.ones(4)])
    anyio.run(main)
""")


@contextmanager
def script_running(script: str, path: Path, line: str) -> Iterator[subprocess.Popen[str]]:
    """Run ``script`` on the store in another process; yields it once it printed
    ``line`` (it waits on its stdin meanwhile); SIGKILLed at the end if still running."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=ROOT,
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline() == line
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stdin.close()


def killed_at(script: str, path: Path, line: str) -> None:
    """Run ``script`` on the store in another process and SIGKILL it once it printed
    ``line``."""
    with script_running(script, path, line):
        pass


def test_an_extent_file_a_killed_owner_was_making_is_removed_by_its_recovery(
        tmp_path: Path) -> None:
    killed_at(MAKER, tmp_path, "creating\n")
    made = os.listdir(tmp_path / "extents")
    assert made == [os.path.basename(layout.extent_path(str(tmp_path), 1))]  # not recorded
    with open_here(tmp_path) as store:
        assert parts(store).owner.recovered == 1
        assert os.listdir(tmp_path / "extents") == []  # its reserved id is skipped
        index = parts(store).index
        with index.begin() as txn:
            assert txn.stat(index.creating)["entries"] == 0
        store.put_many(keys(1), [torch.ones(4)])
        assert sorted(parts(store).fds) == [2]
    assert fsck.check(str(tmp_path)).findings == []


def test_a_lock_file_of_no_owner_is_swept_at_the_next_open(tmp_path: Path) -> None:
    with open_here(tmp_path):
        pass
    # What a registration or close killed between its transaction and the file's
    # removal leaves: a lock file, not held, with no owners row.
    left = Path(layout.owner_lock_path(str(tmp_path), 99))
    left.write_text("12345\n")
    with open_here(tmp_path) as store:
        assert not left.exists()
        assert lock_files(tmp_path) == [
            os.path.basename(layout.owner_lock_path(str(tmp_path), parts(store).owner.id))]


FORKER = textwrap.dedent("""
    import ctypes, os, sys, time, kvstore
    from tests.conformance import NS
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                                  engine="threads")
    # fork(2) as native code would call it: no at-fork hooks run, so the child keeps a
    # copy of the owner lock's descriptor (PyDLL: the GIL held across the call)
    child = ctypes.PyDLL(None).fork()
    if child == 0:
        time.sleep(600)  # killed by the test
        os._exit(0)
    print(child, flush=True)
    sys.stdin.readline()  # killed meanwhile
""")


def test_an_owner_whose_lock_only_a_native_fork_child_holds_is_recovered(
        tmp_path: Path) -> None:
    """The owner process is SIGKILLed; a child it forked without the at-fork hooks still
    holds its lock file, so the lock says alive: the next open tells by the row's pid
    (gone) and recovers it instead of refusing (DESIGN.md 10.2)."""
    proc = subprocess.Popen([sys.executable, "-c", FORKER, str(tmp_path)], cwd=ROOT,
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    child = 0
    try:
        child = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        [left] = lock_files(tmp_path)
        assert probe_owner(str(tmp_path), int(left[:8])) is None  # held: by the child
        with open_here(tmp_path) as store:
            assert parts(store).owner.recovered == 1
            assert list(owner_rows(store)) == [parts(store).owner.id]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        if child > 0:
            os.kill(child, signal.SIGKILL)
        proc.stdout.close()
        proc.stdin.close()


LIVE = textwrap.dedent("""
    import sys, torch, kvstore
    from tests.conformance import NS, keys
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                                  engine="threads")
    store.put_many(keys(1), [torch.ones(1000)])
    print("open", flush=True)
    sys.stdin.readline()
    store.put_many(keys(2)[1:], [torch.zeros(1000)])  # in the claims it kept
    store.close()
    print("done", flush=True)
""")


def test_a_live_owner_whose_lock_file_was_removed_is_not_recovered(tmp_path: Path
                                                                   ) -> None:
    """Another process's lock file is removed under it (an operator, a tmp cleaner): its
    lock is free, but its process runs with the recorded start time, so an open (and a
    live owner's probe, the same code) keeps it: its claims stay its own, and its next
    put, into them, is stored and reads back."""
    with script_running(LIVE, tmp_path, "open\n") as proc:
        [name] = lock_files(tmp_path)
        os.unlink(os.path.join(layout.owners_dir(str(tmp_path)), name))
        with open_here(tmp_path) as store:
            assert parts(store).owner.recovered == 0
            assert len(owner_rows(store)) == 2
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "done\n"
            assert store.contains_many(keys(2)) == [True, True]
    assert fsck.check(str(tmp_path)).findings == []
