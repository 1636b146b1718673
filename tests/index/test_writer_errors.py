"""How LMDB's errors reach the caller (kvstore.index.writer.lmdb_error): a short write on
a file system left full (LMDB's EIO) is a full disk; an EIO on a disk with room is an
I/O error, as it was.  The full-disk case on a real loop-mounted file system is
tests/test_nearly_full_disk.py; here only the mapping, on this machine's disk, which has
room."""

from __future__ import annotations

import errno
from pathlib import Path

import lmdb
import pytest

from kvstore.errors import StoreFullError, StoreIOError
from kvstore.index import writer


def _eio() -> lmdb.Error:
    e = lmdb.Error("mdb_txn_commit: Input/output error")
    e.code = errno.EIO  # py-lmdb's errno attribute
    return e


def test_an_eio_on_a_disk_with_room_stays_an_io_error(tmp_path: Path) -> None:
    got = writer.lmdb_error(_eio(), "commit", str(tmp_path))
    assert type(got) is StoreIOError and got.errno == errno.EIO


def test_an_eio_on_a_full_file_system_is_store_full(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The statvfs of a full file system: the only way to show it without a full disk.
    monkeypatch.setattr(writer, "_NEARLY_FULL_BYTES", 1 << 62)
    got = writer.lmdb_error(_eio(), "commit", str(tmp_path))
    assert isinstance(got, StoreFullError)


def test_enospc_is_store_full_whatever_the_free_space(tmp_path: Path) -> None:
    e = lmdb.Error("mdb_txn_commit: No space left on device")
    e.code = errno.ENOSPC
    assert isinstance(writer.lmdb_error(e, "commit", str(tmp_path)), StoreFullError)
