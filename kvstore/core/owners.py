"""The owners of a store (issue 43): every open ``Store`` is one, whichever process holds
it: a row in the index's ``owners`` table (:mod:`kvstore.index.owners`) and a lock file,
``PATH/owners/NNNNNNNN.lock``, it holds with ``flock`` for its whole life
(:class:`~kvstore.disk.lock.OwnerLock`): the kernel drops the lock when the process
dies, so a row whose lock file can be locked is a dead owner.

Registration (:func:`register`, one write transaction on the index writer, after
``PATH/LOCK`` is held and the index opened; issue 43's DESIGN.md, section 5.1 step 6):

1. Take an owner id (``next_owner``); create its lock file and lock it (held before the
   row exists, so a row whose lock is free always means a dead owner).
2. Probe every other row's lock file: a dead owner (its lock free; or held, but its
   process gone or its pid reused: a child forked by native code, without the at-fork
   hooks, keeps a copy of the lock's descriptor; told by pid and start time, in this
   PID namespace only) is recovered: its row deleted, and
   its ``creating`` rows (extent files it was making: their ids reserved, never
   recorded), and its claims go back to the free pool; once the transaction
   committed, those files and its lock file are removed.
   Lock files of no owner (a registration or close killed at the wrong moment) go too.
3. Options every owner must agree on: ``sync`` (:class:`~kvstore.errors.OptionMismatchError`
   naming the live owners' pids).
4. Without the native fence helper of the read marks (DESIGN 5.1 step 2), a live owner
   refuses the registration (:class:`~kvstore.errors.StoreLockedError`, naming it):
   without marks, an owner's reads are invisible to the others' reuse of freed space.
5. Take a mark slot in ``PATH/owners/marks`` (:mod:`kvstore.io.marks`): the lowest no
   live owner's row names (a dead owner's was cleared when it was recovered), its word
   cleared; write this owner's row (pid, its start time and PID namespace, ``sync``,
   the slot, when), and lease its first sequence numbers (:mod:`kvstore.core.seq_lease`).

A failure part-way aborts the transaction and releases every lock file it took.  Close
(:meth:`Owner.close`): one transaction deletes the row and returns its claims to the
pool, then the lock file goes; a crash
in between leaves a row whose lock is free, which the next registration recovers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from typing import Any

import anyio

from kvstore.core.read_marks import ReadMarks
from kvstore.core.seq_lease import SeqLease
from kvstore.disk import layout, permissions
from kvstore.disk.extents import remove_new_extent_file
from kvstore.disk.lock import OwnerLock, held_owner_locks, probe_owner
from kvstore.errors import OptionMismatchError, StoreLockedError
from kvstore.index.index import Index, IndexWriter
from kvstore.index.owners import OwnerRecord
from kvstore.io import marks as marks_file
from kvstore.io.marks import MarksFile

__all__ = ["Owner", "forget", "register"]

Txn = Any  # lmdb.Transaction (untyped module)


class Owner:
    """This ``Store``'s registration: its id and lock file, until :meth:`close`."""

    def __init__(self, path: str, owner_id: int, lock: OwnerLock, index: Index,
                 writer: IndexWriter, recovered: int, seqs: SeqLease,
                 marks: ReadMarks, file: MarksFile | None) -> None:
        self._path, self.id, self._lock = path, owner_id, lock
        self._index, self._writer = index, writer
        self.recovered = recovered  # dead owners this registration recovered
        self.seqs = seqs  # its sequence numbers (kvstore/core/seq_lease.py)
        self.marks = marks  # its reads' mark (kvstore/core/read_marks.py)
        self._file = file

    @property
    def file(self) -> MarksFile | None:
        """The store's marks file, mapped (None: no native helper, this owner is alone)."""
        return self._file

    async def recover_dead(self) -> int:
        """A live owner's recovery of the dead ones (DESIGN 5.4): the registration's
        probe (step 2) in one transaction of this owner's writer, then LMDB's
        ``reader_check`` (a process killed inside a read transaction leaves a reader
        slot that holds back page reuse); returns the owners recovered.  Called when a
        put finds no room while other owners hold claims (a dead owner's are space
        nobody can use until it is recovered)."""
        dead: list[OwnerLock] = []
        unmade: list[int] = []
        orphans: list[int] = []
        path, index, file, me = self._path, self._index, self._file, self.id
        record = OwnerRecord(pid=os.getpid(), sync=False, start_time=_start_time(),
                             pid_namespace=_pid_namespace(), opened_us=0)
        if not await anyio.to_thread.run_sync(self._any_dead, record):
            return 0  # (no write transaction: a waiting reserve probes every 100 ms)

        def job(txn: Txn) -> None:
            _release(dead)  # (a job the writer runs again after growing the map)
            unmade.clear()
            orphans.clear()
            try:
                _recover_dead(txn, path, index, record, file, dead, unmade, orphans, me)
            except BaseException:
                _release(dead)
                raise

        # Not cancellable once it began: a committed recovery whose files and locks
        # were left behind would leak them (the rows naming them are gone).
        with anyio.CancelScope(shield=True):
            try:
                await self._writer.run(job)
            except BaseException:
                _release(dead)  # (the commit failed: the next probe finds them again)
                raise
            await anyio.to_thread.run_sync(self._after_recovery, dead, unmade)
        found = len(dead) + len(orphans)
        self.recovered += found
        return found

    def _any_dead(self, mine: OwnerRecord) -> bool:
        """Whether some other owner looks dead (a look in a read transaction; the
        recovery's own transaction probes again)."""
        with self._index.begin() as txn:
            rows = self._index.owner_records.rows(txn)
        held = held_owner_locks(self._path)  # (read-only probes: nothing is made)
        return any((other_id not in held and not _still_running(other, mine))
                   or _orphaned(other, mine)
                   for other_id, other in rows.items() if other_id != self.id)

    def _after_recovery(self, dead: list[OwnerLock], unmade: list[int]) -> None:
        for extent_id in unmade:  # no entry names them, no live owner makes them
            remove_new_extent_file(self._path, extent_id)
        for other in dead:  # their rows are gone for good now
            other.remove()
        with suppress(Exception):  # (py-lmdb raises lmdb.Error; nothing to undo)
            self._index.env.reader_check()

    def close(self) -> None:
        """Delete the row (and ``creating`` rows of extents it failed to make; its claims
        go back to the pool), then the
        lock file (even if the transaction fails: the next registration then finds a
        row whose lock is free, and recovers it)."""
        if self._lock.fd < 0:
            return
        try:
            unmade = self._writer.run_sync(
                lambda txn: forget(txn, self._index, self.id, self._file))
            for extent_id in unmade:  # (a failed creation removed its file already)
                remove_new_extent_file(self._path, extent_id)
        finally:
            self._lock.remove()
            if self._file is not None:
                self.marks.detach()  # (never a store into an unmapped file)
                self._file.close()
                self._file = None


def register(path: str, index: Index, writer: IndexWriter, *, sync: bool,
             file_mode: int) -> Owner:
    """Register a new owner of the store at ``path`` (the module docstring's steps)."""
    record = OwnerRecord(pid=os.getpid(), sync=sync, start_time=_start_time(),
                         pid_namespace=_pid_namespace(), opened_us=time.time_ns() // 1000)
    dead: list[OwnerLock] = []
    unmade: list[int] = []  # extent files dead owners were making
    orphans: list[int] = []  # dead owners whose lock a forked child still holds
    file = _open_marks(path, file_mode)
    try:
        owner_id, lock, first_seq, slot = writer.run_sync(
            _registration(path, index, record, file_mode, dead, unmade, orphans, file))
    except BaseException:
        if file is not None:
            file.close()
        raise
    for extent_id in unmade:  # no entry names them, no live owner makes them
        remove_new_extent_file(path, extent_id)
    for other in dead:  # their rows are gone for good now
        other.remove()
    marks = ReadMarks(file, slot, lambda: int(index.env.info()["last_txnid"]))
    return Owner(path, owner_id, lock, index, writer, len(dead) + len(orphans),
                 SeqLease(first_seq), marks, file)


def _open_marks(path: str, file_mode: int) -> MarksFile | None:
    """The store's marks file, mapped; None without the native helper (then this owner
    can only be alone: step 4)."""
    if not marks_file.native()[0]:
        return None
    permissions.make_dirs(layout.owners_dir(path), file_mode)
    return MarksFile.open(path, file_mode)


def _registration(path: str, index: Index, record: OwnerRecord, file_mode: int,
                  dead: list[OwnerLock], unmade: list[int], orphans: list[int],
                  file: MarksFile | None) -> Callable[[Txn], tuple[int, OwnerLock, int, int]]:
    table = index.owner_records

    def job(txn: Txn) -> tuple[int, OwnerLock, int, int]:
        _release(dead)  # (a job the writer runs again after growing the map)
        unmade.clear()
        orphans.clear()
        owner_id = table.take_id(txn)
        lock = OwnerLock(path, owner_id, file_mode, wait_s=1.0)  # (probers: briefly)
        try:
            live = _recover_dead(txn, path, index, record, file, dead, unmade, orphans)
            if not live:  # (runs freed by an owner that closed beside others, or fsck)
                index.space.ripen_all(txn, index.free_map)
                if file is not None:  # (marks of owners fsck recovered, if any)
                    file.clear_all()
            _sweep(path, {owner_id, *live})
            _check_agreement(path, record, live, file)
            slot = _mark_slot(path, live, file)
            table.add(txn, owner_id, replace(record, mark_slot=slot))
            first_seq = SeqLease.lease_in(txn, index)
        except BaseException:
            lock.remove()  # (inside the transaction: nobody else registers meanwhile)
            _release(dead)
            raise
        return owner_id, lock, first_seq, slot

    return job


def _recover_dead(txn: Txn, path: str, index: Index, mine: OwnerRecord,
                  file: MarksFile | None, dead: list[OwnerLock], unmade: list[int],
                  orphans: list[int], skip: int | None = None) -> dict[int, OwnerRecord]:
    """Probe every owner row but ``skip``'s (step 2): the dead ones are forgotten (their
    locks into ``dead``, or their ids into ``orphans``; the extent files they were
    making into ``unmade``); returns the live ones."""
    live: dict[int, OwnerRecord] = {}
    for other_id, other in index.owner_records.rows(txn).items():
        if other_id == skip:
            continue
        probe = probe_owner(path, other_id)
        if probe is not None and _still_running(other, mine):
            # Its lock is free but its process runs on (its lock file was removed or
            # replaced under it): alive.  Forgetting it would hand its claims, slots
            # it is writing included, to others.
            probe.release()
            probe = None
        if probe is None and not _orphaned(other, mine):
            live[other_id] = other
            continue
        if probe is None:  # its lock file stays (held), swept once free
            orphans.append(other_id)
        else:
            dead.append(probe)
        unmade.extend(forget(txn, index, other_id, file))
    return live


def _sweep(path: str, owners: set[int]) -> None:
    """Lock files of no owner (a registration or a close killed at the wrong moment
    left them): removed unless held (an owner between its closing transaction and its
    removal of the file).  Called inside the registration transaction: no other
    registration can be making one meanwhile."""
    try:
        names = os.listdir(layout.owners_dir(path))
    except FileNotFoundError:
        return
    for name in names:
        other_id = layout.owner_id_of(name)
        if other_id is not None and other_id not in owners:
            left = probe_owner(path, other_id)
            if left is not None:
                left.remove()


def forget(txn: Txn, index: Index, owner_id: int, file: MarksFile | None = None
           ) -> list[int]:
    """Delete an owner's row and its ``creating`` rows, clear its mark slot in ``file``
    (None: fsck, which deletes the file), and return its claims to the pool
    (kvstore/index/space_counters.py); returns those extent ids (files to delete once
    the transaction committed).  The last owner gone, no read of a pending run is
    left: every one ripens."""
    table = index.owner_records
    row = table.rows(txn).get(owner_id)
    if file is not None and row is not None and row.mark_slot:
        # (before the commit: if it aborts, the owner is dead anyway, its reads gone)
        file.publish(row.mark_slot, 0)
    table.remove(txn, owner_id)
    index.space.return_claims(txn, index.free_map, owner_id)
    if not table.rows(txn):
        index.space.ripen_all(txn, index.free_map)
    unmade = table.creating_of(txn, owner_id)
    for extent_id in unmade:
        table.done_creating(txn, extent_id)
    return unmade


def _check_agreement(path: str, mine: OwnerRecord, live: dict[int, OwnerRecord],
                     file: MarksFile | None) -> None:
    if not live:
        return
    pids = ", ".join(str(r.pid) for r in live.values())
    differ = [r for r in live.values() if r.sync != mine.sync]
    if differ:
        raise OptionMismatchError(
            f"store {path} is open with sync={differ[0].sync} (pid "
            f"{', '.join(str(r.pid) for r in differ)}); every process sharing a store must "
            f"open it with the same sync, and this open asks for sync={mine.sync}")
    if file is None:
        raise StoreLockedError(
            11, f"store {path} is open (pid {pids}) and sharing it needs the native fence "
            f"helper of the read marks: {marks_file.native()[1]}. Close it there first, "
            "or open another path")


def _mark_slot(path: str, live: dict[int, OwnerRecord], file: MarksFile | None) -> int:
    """The lowest mark slot no live owner names, its word cleared (0: no file)."""
    if file is None:
        return 0
    taken = {r.mark_slot for r in live.values()}
    slot = next((i for i in range(1, marks_file.SLOTS + 1) if i not in taken), 0)
    if not slot:
        raise StoreLockedError(11, f"store {path} has {len(live)} owners: every mark slot "
                               "is taken. Close some first")
    file.publish(slot, 0)
    return slot


def _release(locks: list[OwnerLock]) -> None:
    for other in locks:
        other.release()
    locks.clear()


def _still_running(other: OwnerRecord, mine: OwnerRecord) -> bool:
    """Whether the process that registered ``other`` provably runs (:func:`_running`).
    What cannot be told is not running (the lock alone decides, as before), and so is
    this process: a Store of its own that still runs holds its lock (``flock`` locks of
    two open files conflict in one process too), so a free one was closed without its
    row (a close whose transaction failed)."""
    return other.pid != os.getpid() and _running(other, mine) is True


def _orphaned(other: OwnerRecord, mine: OwnerRecord) -> bool:
    """An owner whose lock file is held, yet whose process is gone: a child forked
    without the at-fork hooks (by native code) keeps a copy of the lock's descriptor
    (DESIGN.md 10.2).  What cannot be told counts as alive (:func:`_running`)."""
    return _running(other, mine) is False


def _running(other: OwnerRecord, mine: OwnerRecord) -> bool | None:
    """Whether the process that registered ``other`` runs (True), is gone (False: its
    pid is gone, or reused: another start time), or None when that cannot be told: no
    record, another PID namespace (or a ``/proc`` that is not this namespace's), a
    start time that cannot be read (another user's process hidden by ``hidepid``)."""
    if not other.start_time or not other.pid_namespace or not _own_proc() \
            or other.pid_namespace != mine.pid_namespace:
        return None
    try:
        os.kill(other.pid, 0)  # (signal 0: only whether the pid exists)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it exists, another user's
    now = _start_time(other.pid)
    return None if not now else now == other.start_time


def _own_proc() -> bool:
    """Whether ``/proc`` shows this process's PID namespace (a process moved into a new
    one without remounting ``/proc`` reads another namespace's pids there)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _start_time(pid: int | str = "self") -> int:
    """A process's start time in clock ticks since boot (``/proc/PID/stat`` field 22):
    with the pid, it names the process even after the pid is reused; 0 if it cannot
    be read."""
    with suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    return 0


def _pid_namespace() -> int:
    with suppress(OSError):
        return os.stat("/proc/self/ns/pid").st_ino
    return 0
