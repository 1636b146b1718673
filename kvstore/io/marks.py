"""``PATH/owners/marks``: the read marks of the owners sharing a store (issue 43; FORMAT.md,
"owners/marks"), a small file every owner maps shared.

Slot ``i`` (1 to :data:`SLOTS`) belongs to the live owner whose ``owners`` row names it
(``mark_slot``); its word is the oldest LMDB snapshot id a disk read of that owner in
flight may have looked its entries up under, 0 when none is in flight.  A freed range
whose ``pending`` row was written by transaction ``t`` may go back to the free pool only
when ``t <= min(marks)`` (the *horizon*): no reader of any owner can still copy it.

Only the slot's owner publishes into it; whoever finds the owner dead clears it.  One
header word counts claim requests: an owner whose put finds no room while other owners
hold claims raises it, and every owner's listener gives its unused claims back when it
sees it change (kvstore/core/claim_requests.py).  The file
is not durable state: nothing is synced, its words mean nothing after every owner is gone,
and an exclusive operation (fsck ``--repair``, ``--rebuild-index``) may delete it.

The stores and loads go through the native helper (``kvstore/_native/marks.c``): a
publish is a store plus a full fence, the minimum a fence plus loads (why: that file's
header).  Without it :func:`native` says why and the store cannot be shared.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

from kvstore._native import lib as native_lib
from kvstore.disk import permissions
from kvstore.disk.layout import marks_path
from kvstore.disk.store_files import open_regular
from kvstore.errors import FormatVersionError, StoreLockedError

__all__ = ["HEADER_BYTES", "MAGIC", "MARKS_VERSION", "NO_MARK", "SLOTS", "MarksFile",
           "marks_path", "native"]

MAGIC = b"KVSMARKS"
MARKS_VERSION = 1
SLOTS = 1024
HEADER_BYTES = 64  # magic, version u32 LE, slots u32 LE, durable txnid u64 LE,
# claim requests u64 LE (kvstore/core/claim_requests.py), zeros
_REQUESTS = 24  # (the claim requests word's offset)
NO_MARK = 2**64 - 1  # the minimum when no read is in flight anywhere
_HEADER = struct.Struct("<8sII")
_ABI = 1

_lib, _reason = native_lib.load(
    "_marks", "KVSTORE_NATIVE_MARKS", "kvs_marks_abi", _ABI,
    "kvstore/_native/_marks*.so is not built (a C compiler at install: `pip install -e .`)")
if _lib is not None:
    _lib.kvs_mark_publish.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    _lib.kvs_mark_publish.restype = None
    _lib.kvs_marks_min.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _lib.kvs_marks_min.restype = ctypes.c_uint64


def native() -> tuple[bool, str]:
    """Whether the fence helper is loaded, and (if not) why."""
    return _lib is not None, _reason


class MarksFile:
    """The marks file of one store, mapped shared (see the module docstring).  Made (or
    adopted) by :meth:`open`, which needs the native helper."""

    def __init__(self, fd: int, mapped: mmap.mmap) -> None:
        self._fd, self._map = fd, mapped
        self._words = ctypes.c_uint64.from_buffer(mapped, HEADER_BYTES)
        self._base = ctypes.addressof(self._words)

    @classmethod
    def open(cls, store_path: str, mode: int = 0o600) -> MarksFile:
        """Map ``PATH/owners/marks``, making it if it is missing (several openers at once
        write the same header).  :class:`FormatVersionError` if it holds another format
        (delete it while no process has the store open)."""
        if _lib is None:  # (without it a store is not shared: DESIGN 5.1 step 2)
            raise StoreLockedError(11, f"sharing {store_path} with another owner needs "
                                   f"the native fence helper: {_reason}")
        path = marks_path(store_path)
        # made with exactly the store's mode (whatever the umask), then opened as a
        # regular file of the store's own (never through a link)
        os.close(permissions.open_file(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK, mode))
        fd = open_regular(path, os.O_RDWR, "remove it; kvstore makes it again")
        try:
            size = HEADER_BYTES + 8 * SLOTS
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # (zeros: no marks; a larger file is never cut)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        header = _HEADER.unpack_from(mapped, 0)
        if header == (bytes(8), 0, 0):
            _HEADER.pack_into(mapped, 0, MAGIC, MARKS_VERSION, SLOTS)
        elif header != (MAGIC, MARKS_VERSION, SLOTS):
            mapped.close()
            os.close(fd)
            raise FormatVersionError(
                f"{path} is not a version-{MARKS_VERSION} marks file of {SLOTS} slots; "
                "it holds no durable state: delete it while no process has the store open")
        return cls(fd, mapped)

    def publish(self, slot: int, value: int) -> None:
        """Slot ``slot``'s word := ``value`` (0: no mark), then a full fence."""
        assert _lib is not None and 1 <= slot <= SLOTS
        _lib.kvs_mark_publish(self._base + 8 * (slot - 1), value)

    def clear_all(self) -> None:
        """Every slot's word := 0 (no owner is live: what dead ones left means nothing)."""
        for slot in range(1, SLOTS + 1):
            if self.mark(slot):
                self.publish(slot, 0)

    def minimum(self) -> int:
        """After a full fence, the smallest mark of any slot (:data:`NO_MARK` if none)."""
        assert _lib is not None
        return int(_lib.kvs_marks_min(self._base, SLOTS))

    def mark(self, slot: int) -> int:
        """Slot ``slot``'s word, as last seen (tests, fsck)."""
        return int(struct.unpack_from("<Q", self._map, HEADER_BYTES + 8 * (slot - 1))[0])

    def claim_requests(self) -> int:
        """The claim requests word: raised by an owner whose put found no room while
        other owners held claims (kvstore/core/claim_requests.py)."""
        return int(struct.unpack_from("<Q", self._map, _REQUESTS)[0])

    def request_claims(self) -> int:
        """Write a new, random value into the claim requests word; returns it.  A
        listener compares it with the value it saw last, so two owners writing at once
        are both seen (the later value differs from whatever a listener saw before);
        a counter raised by read-modify-write could write a value already seen."""
        value = int.from_bytes(os.urandom(8), "little") or 1
        struct.pack_into("<Q", self._map, _REQUESTS, value)
        return value

    def close(self) -> None:
        del self._words  # (the mapping cannot close while a ctypes view holds it)
        self._map.close()
        os.close(self._fd)
