"""The ``meta`` table's records (FORMAT.md, "Meta records"), each read and written by a
method named for it: nothing outside this module names a meta key or the table.

``format_version``, ``store_uuid``, ``extent_bytes`` are written once (``init_meta``;
``format_version`` again by the upgrade of an older store); ``free_bytes``,
``claimed_bytes``, ``pending_bytes`` change with their tables
(kvstore/index/space_counters.py);
``next_extent``, ``next_owner`` and ``seq`` only grow (with the transaction that reserves an extent id
or commits puts, or a repair); ``namespace:<digest hex>`` records are JSON; ``file_mode``
is a u32 (absent: owner-only, :mod:`kvstore.disk.permissions`); ``scrub_cursor`` and
``scrub_completed`` are where the scrub is; ``total:<name>`` the persisted totals
(:mod:`kvstore.index.totals`).  ``Index.meta_records`` is the table of an open index;
writes run in a transaction of the index writer.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from kvstore.disk import permissions
from kvstore.disk.format import FORMAT_VERSION, KEY_BYTES, pack_u64, unpack_u64
from kvstore.errors import FormatVersionError, IndexCorruptionError

__all__ = ["SPACE_COUNTERS", "UPGRADABLE", "META_EXTENT_BYTES", "META_FORMAT", "META_NAMESPACE_PREFIX", "META_CAPACITY", "META_NEXT_EXTENT", "META_NEXT_OWNER",
           "META_SCRUB_COMPLETED", "META_SCRUB_CURSOR", "META_SEQ", "META_TOTAL_PREFIX",
           "META_UUID", "MetaRecords", "namespace_key"]

Txn = Any  # lmdb.Transaction (untyped module)

META_FORMAT = b"format_version"
META_UUID = b"store_uuid"
META_EXTENT_BYTES = b"extent_bytes"
META_NEXT_EXTENT = b"next_extent"
META_NEXT_OWNER = b"next_owner"
META_CAPACITY = b"capacity_bytes"
META_SEQ = b"seq"
META_NAMESPACE_PREFIX = b"namespace:"
META_SCRUB_CURSOR = b"scrub_cursor"
META_SCRUB_COMPLETED = b"scrub_completed"
META_TOTAL_PREFIX = b"total:"

META_FREE_BYTES = b"free_bytes"
META_CLAIMED_BYTES = b"claimed_bytes"
META_PENDING_BYTES = b"pending_bytes"
SPACE_COUNTERS = (META_FREE_BYTES, META_CLAIMED_BYTES, META_PENDING_BYTES)
"""Sums of the free, claims and pending tables (kvstore/index/space_counters.py)."""

UPGRADABLE = (1,)
"""Format versions an open upgrades to ``FORMAT_VERSION`` in place."""


def namespace_key(digest: bytes) -> bytes:
    return META_NAMESPACE_PREFIX + digest.hex().encode()


def _u64(raw: bytes | None) -> int:
    return unpack_u64(raw or pack_u64(0))


class MetaRecords:
    """The meta table of an open index: ``begin`` is the index's read transaction."""

    def __init__(self, begin: Callable[[], AbstractContextManager[Txn]], table: Any) -> None:
        self._begin, self._table = begin, table

    def _get(self, key: bytes) -> bytes | None:
        with self._begin() as txn:
            value = txn.get(key, db=self._table)
            return None if value is None else bytes(value)

    def _rows(self, txn: Txn, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        with txn.cursor(self._table) as cur:
            if cur.set_range(prefix):
                for k, v in cur:
                    if not bytes(k).startswith(prefix):
                        break
                    yield bytes(k), bytes(v)

    # ------------------------------------------------------------------ written once

    def init(self, txn: Txn, *, store_uuid: bytes, extent_bytes: int) -> None:
        """A new store's records."""
        txn.put(META_FORMAT, struct.pack("<I", FORMAT_VERSION), db=self._table)
        txn.put(META_UUID, store_uuid, db=self._table)
        txn.put(META_EXTENT_BYTES, pack_u64(extent_bytes), db=self._table)
        txn.put(META_NEXT_EXTENT, pack_u64(1), db=self._table)
        txn.put(META_SEQ, pack_u64(0), db=self._table)
        for name in SPACE_COUNTERS:  # every table they sum is empty
            txn.put(name, pack_u64(0), db=self._table)

    def check_format(self) -> int:
        """The store's format version: this build's, or one it upgrades
        (``UPGRADABLE``: kvstore/index/space_counters.py); any other is
        :class:`FormatVersionError`."""
        raw = self._get(META_FORMAT)
        if raw is None:
            raise IndexCorruptionError("index has no format_version record")
        if len(raw) != 4:
            raise IndexCorruptionError(f"format_version record of {len(raw)} bytes")
        version = int(struct.unpack("<I", raw)[0])
        if version != FORMAT_VERSION and version not in UPGRADABLE:
            raise FormatVersionError(
                f"store has on-disk format version {version}; this kvstore reads version "
                f"{FORMAT_VERSION}. Use a kvstore release that supports it; nothing was changed.")
        return version

    def format_in(self, txn: Txn) -> int | None:
        """The format version as of ``txn`` (None: no valid record)."""
        raw = txn.get(META_FORMAT, db=self._table)
        return None if raw is None or len(raw) != 4 else int(struct.unpack("<I", raw)[0])

    def set_format(self, txn: Txn) -> None:
        """This build's format version (an upgraded store)."""
        txn.put(META_FORMAT, struct.pack("<I", FORMAT_VERSION), db=self._table)

    def store_uuid(self) -> bytes | None:
        """None: a new index, not initialised yet."""
        return self._get(META_UUID)

    def extent_bytes(self) -> int:
        return _u64(self._get(META_EXTENT_BYTES))

    def extent_bytes_in(self, txn: Txn) -> int:
        return _u64(txn.get(META_EXTENT_BYTES, db=self._table))

    # ------------------------------------------------------------------ counters

    def seq(self) -> int:
        return _u64(self._get(META_SEQ))

    def lease_seq(self, txn: Txn, count: int) -> int:
        """``count`` sequence numbers for one owner (kvstore/core/seq_lease.py): ``seq``
        raised by ``count`` in ``txn``; returns the first of them."""
        prev = unpack_u64(txn.get(META_SEQ, db=self._table) or pack_u64(0))
        txn.put(META_SEQ, pack_u64(prev + count), db=self._table)
        return prev + 1

    def raise_seq(self, txn: Txn, seq: int) -> None:
        """The sequence counter to at least ``seq`` (a put's commit; fsck's repair)."""
        prev = unpack_u64(txn.get(META_SEQ, db=self._table) or pack_u64(0))
        txn.put(META_SEQ, pack_u64(max(prev, seq)), db=self._table)

    def next_extent(self) -> int:
        return _u64(self._get(META_NEXT_EXTENT))

    def take_next_extent(self, txn: Txn) -> int:
        """``next_extent`` as of ``txn``, raised by one in it (an id reserved)."""
        extent_id = _u64(txn.get(META_NEXT_EXTENT, db=self._table))
        txn.put(META_NEXT_EXTENT, pack_u64(extent_id + 1), db=self._table)
        return extent_id

    def take_next_owner(self, txn: Txn) -> int:
        """``next_owner`` as of ``txn`` (1 in a store that has none), raised by one in it:
        an owner id (kvstore/index/owners.py), never handed out twice."""
        owner_id = max(1, _u64(txn.get(META_NEXT_OWNER, db=self._table)))
        txn.put(META_NEXT_OWNER, pack_u64(owner_id + 1), db=self._table)
        return owner_id

    def set_next_extent(self, txn: Txn, extent_id: int) -> None:
        txn.put(META_NEXT_EXTENT, pack_u64(extent_id), db=self._table)

    # ------------------------------------------------------------------ namespaces

    def record_namespace(self, txn: Txn, digest: bytes, canonical_json: str) -> None:
        json.loads(canonical_json)  # only ever store valid JSON
        txn.put(namespace_key(digest), canonical_json.encode(), db=self._table)

    def namespace_rows(self) -> list[tuple[bytes, bytes]]:
        """Every namespace record as it is stored (key, JSON), for fsck to check."""
        with self._begin() as txn:
            return list(self._rows(txn, META_NAMESPACE_PREFIX))

    def namespaces(self) -> dict[bytes, str]:
        """Digest -> canonical JSON of every namespace recorded."""
        out = {}
        for k, v in self.namespace_rows():
            try:
                out[bytes.fromhex(k[len(META_NAMESPACE_PREFIX):].decode())] = v.decode()
            except (UnicodeDecodeError, ValueError):
                raise IndexCorruptionError(
                    f"namespace record {k!r} is damaged; run `python -m kvstore "
                    "fsck --repair` to drop it") from None
        return out

    def drop_namespace(self, txn: Txn, key: bytes) -> None:
        """Drop a namespace record by its key (fsck's repair of a damaged one)."""
        if not key.startswith(META_NAMESPACE_PREFIX):
            raise ValueError(f"{key!r} is not a namespace record")
        txn.delete(key, db=self._table)

    # ------------------------------------------------------------------ file mode

    def capacity(self) -> int | None:
        """The recorded ``capacity_bytes`` (None: never given; the default rule applies)."""
        raw = self._get(META_CAPACITY)
        return None if raw is None else _u64(raw)

    def record_capacity(self, txn: Txn, capacity: int) -> None:
        txn.put(META_CAPACITY, pack_u64(capacity), db=self._table)

    def file_mode(self) -> int | None:
        """The recorded file mode (None: never recorded, the default applies);
        :class:`IndexCorruptionError` if the record is damaged."""
        return permissions.decode_mode(self._get(permissions.META_FILE_MODE))

    def record_file_mode(self, txn: Txn, mode: int) -> None:
        txn.put(permissions.META_FILE_MODE, permissions.encode_mode(mode), db=self._table)

    def drop_file_mode(self, txn: Txn) -> None:
        """Back to the default mode (fsck's repair of a damaged record)."""
        txn.delete(permissions.META_FILE_MODE, db=self._table)

    # ------------------------------------------------------------------ the scrub

    def scrub_state(self) -> tuple[bytes | None, int | None]:
        """The last key of the scrub pass in progress (None: a pass starts from the
        first key) and when the last pass completed (microseconds since the epoch;
        None: never).  Damaged records read as absent."""
        cursor = self._get(META_SCRUB_CURSOR)
        completed = self._get(META_SCRUB_COMPLETED)
        return (cursor if cursor is not None and len(cursor) == KEY_BYTES else None,
                unpack_u64(completed) if completed is not None and len(completed) == 8
                else None)

    def save_scrub_state(self, txn: Txn, cursor: bytes | None, completed: int | None) -> None:
        """Where the pass is (``cursor``: its last key; None: the next pass starts from
        the first) and, when a pass just completed, when (``completed``)."""
        if cursor is None:
            txn.delete(META_SCRUB_CURSOR, db=self._table)
        else:
            txn.put(META_SCRUB_CURSOR, cursor, db=self._table)
        if completed is not None:
            txn.put(META_SCRUB_COMPLETED, pack_u64(completed), db=self._table)

    # ------------------------------------------------------------------ totals

    def totals(self, names: tuple[str, ...]) -> dict[str, int]:
        """The persisted totals ``names`` (absent or damaged: 0, they are statistics)."""
        with self._begin() as txn:
            return {name: _total(txn.get(META_TOTAL_PREFIX + name.encode(), db=self._table))
                    for name in names}

    def add_to_totals(self, txn: Txn, deltas: Mapping[str, int]) -> None:
        for name, delta in deltas.items():
            key = META_TOTAL_PREFIX + name.encode()
            txn.put(key, pack_u64(_total(txn.get(key, db=self._table)) + delta), db=self._table)


def _total(raw: Any) -> int:
    # absent (never written) or not 8 bytes (damaged: statistics only, so start over)
    return unpack_u64(bytes(raw)) if raw is not None and len(raw) == 8 else 0
