"""The ``owners`` table (issue 43; FORMAT.md, "Index"): one row per open ``Store`` of
the store directory, whichever process holds it, written in the transaction that
registers it and deleted when it closes or when another owner finds it dead.

Key: owner id, u32 big-endian (ids come from the ``next_owner`` meta record, never
reused).  Value, 40 bytes little-endian: version u8 (1), flags u8 (bit 0: opened with
``sync=True``), mark slot u16 (0: none yet), pid u32, the pid's start time u64 (clock
ticks since boot, ``/proc/<pid>/stat`` field 22; 0 if unknown), its PID namespace's
inode u64 (0 if unknown), opened u64 (microseconds since the epoch), reserved u64.

Whether an owner is alive is not in the table: its lock file says
(:func:`kvstore.disk.lock.probe_owner`).

The ``creating`` table: extent id (u32 BE) -> owner id (u32 LE) of an extent file that
owner is making (its id reserved, the file not recorded in ``extents`` yet): the row
goes in the transaction that records the extent; a dead owner's rows name the files
its recovery deletes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kvstore.errors import IndexCorruptionError
from kvstore.index.meta import MetaRecords

__all__ = ["OWNER_RECORD_VERSION", "OwnerRecord", "OwnersTable", "owner_key"]

Txn = Any  # lmdb.Transaction (untyped module)

OWNER_RECORD_VERSION = 1
_FLAG_SYNC = 0x01
_RECORD = struct.Struct("<BBHIQQQQ")
_KEY = struct.Struct(">I")
_OWNER = struct.Struct("<I")


def owner_key(owner_id: int) -> bytes:
    return _KEY.pack(owner_id)


@dataclass(frozen=True)
class OwnerRecord:
    """One open ``Store`` of the store (the module docstring's value)."""

    pid: int
    sync: bool
    start_time: int = 0
    pid_namespace: int = 0
    opened_us: int = 0
    mark_slot: int = 0

    def encode(self) -> bytes:
        return _RECORD.pack(OWNER_RECORD_VERSION, _FLAG_SYNC if self.sync else 0,
                            self.mark_slot, self.pid, self.start_time, self.pid_namespace,
                            self.opened_us, 0)

    @classmethod
    def decode(cls, raw: bytes) -> OwnerRecord:
        if len(raw) != _RECORD.size:
            raise IndexCorruptionError(f"an owners row has {len(raw)} bytes, not "
                                       f"{_RECORD.size}; run `python -m kvstore fsck`")
        version, flags, slot, pid, start, pidns, opened, _ = _RECORD.unpack(raw)
        if version != OWNER_RECORD_VERSION:
            raise IndexCorruptionError(f"an owners row has version {version}, not "
                                       f"{OWNER_RECORD_VERSION}; run `python -m kvstore fsck`")
        return cls(pid=pid, sync=bool(flags & _FLAG_SYNC), start_time=start,
                   pid_namespace=pidns, opened_us=opened, mark_slot=slot)


class OwnersTable:
    """The owners rows of an open index; every method runs in a transaction it is given."""

    def __init__(self, table: Any, creating: Any, meta: MetaRecords) -> None:
        self._table, self._creating, self._meta = table, creating, meta

    def take_id(self, txn: Txn) -> int:
        """A new owner id (``next_owner``, raised in ``txn``)."""
        return self._meta.take_next_owner(txn)

    def count(self, txn: Txn) -> int:
        """How many owners have a row (live ones, and dead ones not recovered yet)."""
        return int(txn.stat(self._table)["entries"])

    def rows(self, txn: Txn) -> dict[int, OwnerRecord]:
        with txn.cursor(self._table) as cur:
            return {_KEY.unpack(bytes(k))[0]: OwnerRecord.decode(bytes(v)) for k, v in cur}

    def add(self, txn: Txn, owner_id: int, record: OwnerRecord) -> None:
        txn.put(owner_key(owner_id), record.encode(), db=self._table)

    def remove(self, txn: Txn, owner_id: int) -> bool:
        """Delete the row (False if it was gone: another owner recovered it)."""
        return bool(txn.delete(owner_key(owner_id), db=self._table))

    def start_creating(self, txn: Txn, extent_id: int, owner_id: int) -> None:
        txn.put(_KEY.pack(extent_id), _OWNER.pack(owner_id), db=self._creating)

    def done_creating(self, txn: Txn, extent_id: int) -> None:
        txn.delete(_KEY.pack(extent_id), db=self._creating)

    def creating_owners(self, txn: Txn) -> dict[int, int]:
        """Every ``creating`` row: extent id -> owner id."""
        with txn.cursor(self._creating) as cur:
            return {_KEY.unpack(bytes(k))[0]: _OWNER.unpack(bytes(v))[0] for k, v in cur}

    def creating_of(self, txn: Txn, owner_id: int) -> list[int]:
        """The extents ``owner_id`` was making (reserved, not recorded)."""
        with txn.cursor(self._creating) as cur:
            return [_KEY.unpack(bytes(k))[0] for k, v in cur
                    if _OWNER.unpack(bytes(v))[0] == owner_id]
