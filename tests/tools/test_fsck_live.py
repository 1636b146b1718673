"""fsck beside live processes (issue 43): the check shares ``LOCK`` with a real process
that holds the store open, registers no owner and writes nothing; it reports a clean
store clean (the live owner a note, never a dead one) and real damage as damage; a slot
that fails because the live owner changed its key after fsck's snapshot is not damage;
``--repair`` and ``--rebuild-index`` are refused, naming the pid."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.tools import fsck
from tests.conformance import NS, keys
from tests.tools.test_fsck import N, build, flip, kinds

ROOT = Path(__file__).resolve().parents[2]

# A live owner: opens the store, then deletes the keys it is sent (hex, one a line)
# and answers "deleted"; an empty line closes it.
OWNER = textwrap.dedent("""
    import sys, kvstore
    from tests.conformance import NS
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                                  engine="threads")
    print("open", kvstore.__file__, flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        store.delete_many([bytes.fromhex(line.strip())])
        print("deleted", flush=True)
    store.close()
""")


class Owner:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def delete(self, key: bytes) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(key.hex() + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "deleted\n"


@contextmanager
def live_owner(path: Path) -> Iterator[Owner]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(path)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["open"], line
        assert line[1] == kvstore.__file__  # this checkout's kvstore, not another one
        yield Owner(proc)
    finally:
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        proc.stdout.close()


def store_state(path: Path) -> dict[str, str]:
    """Every file of the store and a digest of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != "lock.mdb"}


def test_a_check_beside_a_live_owner_is_clean_and_writes_nothing(tmp_path: Path) -> None:
    build(tmp_path)
    with live_owner(tmp_path) as owner:
        before = store_state(tmp_path)
        report = fsck.check(str(tmp_path), deep=True)
        assert store_state(tmp_path) == before  # (LMDB's lock.mdb: its reader table)
    assert report.problems == [] and report.exit_code == 0
    assert kinds(report) == {"live-owners"}  # a note: the owner is live, not dead
    assert report.live_owners == [owner.proc.pid]
    assert f"pid {owner.proc.pid}" in report.findings[0].detail
    assert report.blocks == N and report.payloads_verified == N


def test_damage_under_an_unchanged_entry_is_found_beside_a_live_owner(tmp_path: Path) -> None:
    entries = build(tmp_path)
    flip(extent_path(str(tmp_path), entries[3].extent), entries[3].offset + 5)
    with live_owner(tmp_path):
        report = fsck.check(str(tmp_path))
    assert kinds(report) == {"live-owners", "bad-slot"} and report.exit_code == 1
    assert [f.key for f in report.damage] == [keys(N)[3].hex()]
    assert report.slots_changed == 0


def test_a_slot_whose_entry_changed_after_the_snapshot_is_not_damage(tmp_path: Path) -> None:
    """Two damaged slots; the live owner deletes one of their keys after fsck read the
    tables and before it reads the slots (as a reuse of the slot would): that failure is
    judged by the entry read again (gone) and counted, the other is damage."""
    entries = build(tmp_path)
    for i in (2, 5):
        flip(extent_path(str(tmp_path), entries[i].extent), entries[i].offset + 5)
    with live_owner(tmp_path) as owner:
        sent: list[bytes] = []

        def progress(stage: str, done: int, total: int) -> None:
            if stage == "slots" and not sent:
                sent.append(keys(N)[2])
                owner.delete(keys(N)[2])

        report = fsck.check(str(tmp_path), progress=progress)
    assert sent
    assert [f.key for f in report.damage] == [keys(N)[5].hex()]
    assert report.slots_changed == 1


def test_repair_and_rebuild_are_refused_naming_the_live_owner(tmp_path: Path) -> None:
    build(tmp_path)
    with live_owner(tmp_path) as owner:
        before = store_state(tmp_path)
        with pytest.raises(kvstore.StoreLockedError, match=f"pid {owner.proc.pid}.*without "
                           "--repair for a read-only check"):
            fsck.check(str(tmp_path), repair=True)
        with pytest.raises(kvstore.StoreLockedError, match=f"pid {owner.proc.pid}"):
            fsck.rebuild_index(str(tmp_path))
        assert store_state(tmp_path) == before
    assert fsck.check(str(tmp_path)).findings == []  # closed now: nothing left behind


def test_a_check_in_a_process_that_has_the_store_open_is_refused(tmp_path: Path) -> None:
    """LMDB forbids a second environment of one store in a process."""
    build(tmp_path)
    with kvstore.open_blocking(tmp_path, namespace=NS, engine="threads"):
        with pytest.raises(kvstore.StoreLockedError, match="open in this process"):
            fsck.check(str(tmp_path))
    assert fsck.check(str(tmp_path)).findings == []  # closed: checked as usual


# A live owner that keeps writing: puts (with evictions under its capacity, new extents
# until it is reached) and deletes, on a thread, until told to stop; then says how many
# rounds it made.
CHURN = textwrap.dedent("""
    import sys, threading, torch, kvstore
    from tests.conformance import NS, keys
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                                  engine="threads", capacity_bytes=3 << 20)
    stop, rounds = threading.Event(), [0]

    def churn():
        while not stop.is_set():
            i = rounds[0]
            ks = keys(4, 1000 + 4 * i)
            store.put_many(ks, [torch.full((16384,), (i + j) % 251, dtype=torch.uint8)
                                for j in range(4)], parents=kvstore.chain_parents(ks))
            if i % 3 == 0:
                store.delete_many(ks[2:])
            rounds[0] += 1

    worker = threading.Thread(target=churn)
    worker.start()
    print("open", kvstore.__file__, flush=True)
    sys.stdin.readline()
    stop.set()
    worker.join()
    store.close()
    print(rounds[0], flush=True)
""")


def test_checks_beside_an_owner_that_keeps_writing_find_nothing(tmp_path: Path) -> None:
    """Every table is read as of one commit, so a live owner's puts, deletes, evictions
    and new extents meanwhile never look like damage or leftovers."""
    build(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().split()[:1] == ["open"]
        reports = [fsck.check(str(tmp_path), deep=i % 2 == 1) for i in range(10)]
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
    rounds = int(proc.stdout.read().split()[-1])
    proc.stdout.close()
    assert rounds >= 4  # it wrote while the checks ran
    for report in reports:
        assert report.problems == [], report.findings
        assert report.live_owners == [proc.pid]
    assert fsck.check(str(tmp_path)).findings == []  # closed: clean, nothing left
