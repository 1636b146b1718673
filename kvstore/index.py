"""The LMDB index: block entries, the durable free map, extents, metadata, quarantine.

Tables (FORMAT.md, "Index"):

``meta``        format version, store uuid, extent size, namespaces, counters
``blocks``      16-byte key -> IndexEntry
``extents``     u32 BE extent id -> u64 LE extent size
``free``        (u32 BE extent, u64 BE offset) -> u64 LE length of a free run
``quarantine``  16-byte key -> IndexEntry of a block that failed its checksum

Every change of allocation happens in the same write transaction as the index change
it belongs to, so space is never both free and referenced after a crash.

LMDB allows one write transaction at a time, bound to the thread that began it
(py-lmdb ChangeLog 2.3.0).  All of kvstore's write transactions run on one dedicated
thread (:class:`IndexWriter`), which also does group commit: jobs that queue up while
a commit is being fsynced are applied together in the next transaction, each in a
nested transaction so one failing job cannot undo the others.  Reads use short
read-only transactions on the calling thread; LMDB reads never block on the writer.
"""

from __future__ import annotations

import json
import operator
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from itertools import compress, count
from typing import Any, TypeVar

import anyio
import lmdb

from kvstore import permissions
from kvstore.errors import (
    FormatVersionError,
    IndexCorruptionError,
    KVStoreError,
    StoreFullError,
    StoreIOError,
)
from kvstore.format import (
    FORMAT_VERSION,
    IndexEntry,
    decode_extent_key,
    decode_free_key,
    free_key,
    lru_key,
    pack_count,
    pack_u64,
    unpack_count,
    unpack_u64,
)

T = TypeVar("T")
Txn = Any  # lmdb.Transaction (untyped module)

_DBS = (b"meta", b"blocks", b"extents", b"free", b"quarantine", b"children", b"pins", b"lru")

META_FORMAT = b"format_version"
META_UUID = b"store_uuid"
META_EXTENT_BYTES = b"extent_bytes"
META_NEXT_EXTENT = b"next_extent"
META_SEQ = b"seq"
META_NAMESPACE_PREFIX = b"namespace:"


class Index:
    """An open LMDB environment and its tables."""

    def __init__(self, path: str, *, map_size: int, sync: bool,
                 file_mode: int = permissions.FILE_MODE) -> None:
        permissions.make_dirs(path, file_mode)
        # py-lmdb creates data.mdb and lock.mdb with ``mode & ~0o111`` (less the umask):
        # never more open than file_mode; fix_created restores what a umask took away.
        fix_modes = permissions.fix_created(
            [os.path.join(path, "data.mdb"), os.path.join(path, "lock.mdb")], file_mode)
        try:
            self.env = lmdb.open(
                path, map_size=map_size, subdir=True, max_dbs=len(_DBS), sync=sync,
                metasync=sync, readahead=False, meminit=False, max_readers=256, lock=True,
                mode=permissions.dir_mode(file_mode))
        except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                lmdb.VersionMismatchError) as e:
            raise IndexCorruptionError(
                f"the LMDB index at {path} is damaged ({e}); run `python -m kvstore fsck "
                f"{os.path.dirname(path)} --rebuild-index` to rebuild it from the extents"
            ) from e
        except lmdb.Error as e:
            raise StoreIOError(getattr(e, "errno", 5) or 5,
                               f"cannot open the LMDB index at {path}: {e}") from e
        fix_modes()
        (self.meta, self.blocks, self.extents, self.free, self.quarantine, self.children,
         self.pins, self.lru) = (self.env.open_db(name) for name in _DBS)

    def close(self) -> None:
        self.env.close()

    # ------------------------------------------------------------------ reads

    def read(self) -> Any:
        return self.env.begin(buffers=False)

    def get_entries(self, keys: Sequence[bytes]) -> list[IndexEntry | None]:
        """Index entries for ``keys`` in order (None where absent), one C-level batch."""
        with self.env.begin() as txn, txn.cursor(self.blocks) as cur:
            found = dict(cur.getmulti(keys))
        return [IndexEntry.decode(found[k]) if k in found else None for k in keys]

    def present(self, keys: Sequence[bytes]) -> set[bytes]:
        # Cursor.set_key only positions the cursor: unlike getmulti it copies no value
        # (an IndexEntry per key), which made lookups of long chains 3-5x slower.
        with self.env.begin(buffers=True) as txn, txn.cursor(self.blocks) as cur:
            find = cur.set_key
            return {k for k in keys if find(k)}

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are indexed; stops at the first miss."""
        with self.env.begin(buffers=True) as txn, txn.cursor(self.blocks) as cur:
            # lazy C-level iterators: stops at the first miss, no Python frame per key
            misses = compress(count(), map(operator.not_, map(cur.set_key, keys)))
            return next(misses, len(keys))

    def count_blocks(self) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self.blocks)["entries"])

    def iter_entries(self, table: Any = None) -> Iterator[tuple[bytes, IndexEntry]]:
        with self.env.begin() as txn, txn.cursor(table or self.blocks) as cur:
            for k, v in cur:
                yield k, IndexEntry.decode(v)

    def extents_list(self) -> dict[int, int]:
        with self.env.begin() as txn, txn.cursor(self.extents) as cur:
            return {decode_extent_key(k): unpack_u64(v) for k, v in cur}

    def free_runs(self) -> list[tuple[int, int, int]]:
        with self.env.begin() as txn, txn.cursor(self.free) as cur:
            return [(*decode_free_key(k), unpack_u64(v)) for k, v in cur]

    def meta_get(self, key: bytes) -> bytes | None:
        with self.env.begin() as txn:
            value = txn.get(key, db=self.meta)
            return None if value is None else bytes(value)

    def namespaces(self) -> dict[bytes, str]:
        with self.env.begin() as txn, txn.cursor(self.meta) as cur:
            out = {}
            if cur.set_range(META_NAMESPACE_PREFIX):
                for k, v in cur:
                    if not k.startswith(META_NAMESPACE_PREFIX):
                        break
                    try:
                        out[bytes.fromhex(k[len(META_NAMESPACE_PREFIX):].decode())] = v.decode()
                    except (UnicodeDecodeError, ValueError):
                        raise IndexCorruptionError(
                            f"namespace record {bytes(k)!r} is damaged; run `python -m kvstore "
                            "fsck --repair` to drop it") from None
            return out

    def check_format(self) -> None:
        raw = self.meta_get(META_FORMAT)
        if raw is None:
            raise IndexCorruptionError("index has no format_version record")
        if len(raw) != 4:
            raise IndexCorruptionError(f"format_version record of {len(raw)} bytes")
        version = struct.unpack("<I", raw)[0]
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"store has on-disk format version {version}; this kvstore reads version "
                f"{FORMAT_VERSION}. Use a kvstore release that supports it; nothing was changed.")

    # ------------------------------------------------------------------ writes (writer thread)

    def _neighbours(self, txn: Txn, extent: int, offset: int) -> tuple[
            tuple[int, int, int] | None, tuple[int, int, int] | None]:
        """Free runs (extent, offset, length) at-or-after and before ``(extent, offset)``."""
        cur = txn.cursor(self.free)
        at_or_after = before = None
        if cur.set_range(free_key(extent, offset)):
            at_or_after = (*decode_free_key(cur.key()), unpack_u64(cur.value()))
            moved = cur.prev()
        else:
            moved = cur.last()
        if moved:
            before = (*decode_free_key(cur.key()), unpack_u64(cur.value()))
        return at_or_after, before

    def take_range(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Remove [offset, offset+length) from the durable free map (it must be free)."""
        at_or_after, before = self._neighbours(txn, extent, offset)
        run = at_or_after if at_or_after is not None and at_or_after[:2] == (extent, offset) \
            else before
        if run is None or run[0] != extent or not \
                run[1] <= offset < offset + length <= run[1] + run[2]:
            raise _drift(extent, offset, length)
        _, run_offset, run_len = run
        txn.delete(free_key(extent, run_offset), db=self.free)
        if run_offset < offset:
            txn.put(free_key(extent, run_offset), pack_u64(offset - run_offset), db=self.free)
        end, run_end = offset + length, run_offset + run_len
        if end < run_end:
            txn.put(free_key(extent, end), pack_u64(run_end - end), db=self.free)

    # ------------------------------------------------------------------ chains, LRU, pins

    def add_block(self, txn: Txn, key: bytes, entry: IndexEntry) -> None:
        """Index a block: entry, LRU row, and one more stored child for its parent."""
        txn.put(key, entry.encode(), db=self.blocks)
        txn.put(lru_key(entry.last_use, key), b"", db=self.lru)
        if entry.parent is not None:
            self.bump(txn, self.children, entry.parent, +1)

    def remove_block(self, txn: Txn, key: bytes, entry: IndexEntry, *, quarantine: bool) -> None:
        """Unindex a block; its space returns to the free map unless it is quarantined
        (kept allocated so fsck can look at it)."""
        txn.delete(key, db=self.blocks)
        txn.delete(lru_key(entry.last_use, key), db=self.lru)
        if entry.parent is not None:
            self.bump(txn, self.children, entry.parent, -1)
        if quarantine:
            txn.put(key, entry.encode(), db=self.quarantine)
        else:
            self.give_range(txn, entry.extent, entry.offset, entry.slot_len)

    def touch(self, txn: Txn, key: bytes, last_use: int) -> None:
        raw = txn.get(key, db=self.blocks)
        if raw is None:
            return
        entry = IndexEntry.decode(raw)
        if last_use <= entry.last_use:
            return
        txn.delete(lru_key(entry.last_use, key), db=self.lru)
        txn.put(lru_key(last_use, key), b"", db=self.lru)
        txn.put(key, replace(entry, last_use=last_use).encode(), db=self.blocks)

    def bump(self, txn: Txn, table: Any, key: bytes, delta: int) -> int:
        raw = txn.get(key, db=table)
        n = (unpack_count(raw) if raw is not None else 0) + delta
        if n < 0:
            raise IndexCorruptionError(f"count of {key.hex()} would drop below zero; run "
                                       "`python -m kvstore fsck` on the store")
        if n:
            txn.put(key, pack_count(n), db=table)
        else:
            txn.delete(key, db=table)
        return n

    def evict(self, txn: Txn, need: int, protect: set[bytes],
              scan_limit: int = 1 << 20) -> list[tuple[bytes, IndexEntry]]:
        """Unindex least-recently-used blocks that have no stored children and are not
        pinned or protected, until ``need`` bytes are freed (or nothing more qualifies)."""
        chosen: list[tuple[bytes, IndexEntry]] = []
        freed = 0
        with txn.cursor(self.lru) as cur:
            for n, (row, _) in enumerate(cur):
                if freed >= need or n >= scan_limit:
                    break
                key = bytes(row[8:])
                if key in protect or txn.get(key, db=self.children) is not None \
                        or txn.get(key, db=self.pins) is not None:
                    continue
                raw = txn.get(key, db=self.blocks)
                if raw is None:
                    continue
                entry = IndexEntry.decode(raw)
                chosen.append((key, entry))
                freed += entry.slot_len
        for key, entry in chosen:
            self.remove_block(txn, key, entry, quarantine=False)
        return chosen

    def give_range(self, txn: Txn, extent: int, offset: int, length: int) -> None:
        """Add [offset, offset+length) to the durable free map, merging neighbours."""
        nxt, prev = self._neighbours(txn, extent, offset)
        end = offset + length
        if nxt is not None and nxt[0] == extent:
            if nxt[1] < end:
                raise _drift(extent, offset, length)
            if nxt[1] == end:
                txn.delete(free_key(extent, end), db=self.free)
                length += nxt[2]
        if prev is not None and prev[0] == extent:
            if prev[1] + prev[2] > offset:
                raise _drift(extent, offset, length)
            if prev[1] + prev[2] == offset:
                txn.delete(free_key(extent, prev[1]), db=self.free)
                offset, length = prev[1], length + prev[2]
        txn.put(free_key(extent, offset), pack_u64(length), db=self.free)


def _drift(extent: int, offset: int, length: int) -> KVStoreError:
    return IndexCorruptionError(
        f"allocation map disagrees with the index at extent {extent} offset {offset} "
        f"length {length}; run `python -m kvstore fsck` on the store")


class IndexWriter:
    """The one thread that runs LMDB write transactions, with group commit."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._jobs: queue.SimpleQueue[tuple[Callable[[Txn], Any], Future[Any]] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvstore-lmdb-writer", daemon=True)
        self._thread.start()
        self.commits = 0

    def _run(self) -> None:
        env = self._index.env
        while True:
            first = self._jobs.get()
            if first is None:
                return
            batch = [first]
            while True:  # group commit: take everything that queued meanwhile
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)
                    break
                batch.append(nxt)
            results: list[tuple[Future[Any], Any, BaseException | None]] = []
            try:
                with env.begin(write=True) as txn:
                    for fn, fut in batch:
                        child = env.begin(write=True, parent=txn)
                        try:
                            value = fn(child)
                        except BaseException as e:  # noqa: BLE001 - handed to the caller
                            child.abort()
                            results.append((fut, None, e))
                        else:
                            child.commit()
                            results.append((fut, value, None))
                self.commits += 1
            except lmdb.MapFullError as e:
                err: BaseException = StoreFullError(
                    28, f"the LMDB index is full ({e}); reopen with a larger index_map_bytes")
                results = [(fut, None, err) for _, fut in batch]
            except lmdb.Error as e:
                err = StoreIOError(5, f"LMDB commit failed: {e}")
                results = [(fut, None, err) for _, fut in batch]
            for fut, value, exc in results:
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(value)

    def submit(self, fn: Callable[[Txn], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def run_sync(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a write transaction and wait (for use off the event loop)."""
        return self.submit(fn).result()

    async def run(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a write transaction; returns after it is durably committed.

        Not cancellable midway: a commit that has started is waited for, so the caller
        never mistakes an applied change for an absent one.
        """
        fut = self.submit(fn)
        return await anyio.to_thread.run_sync(fut.result)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def namespace_key(digest: bytes) -> bytes:
    return META_NAMESPACE_PREFIX + digest.hex().encode()


def init_meta(txn: Txn, index: Index, *, store_uuid: bytes, extent_bytes: int) -> None:
    txn.put(META_FORMAT, struct.pack("<I", FORMAT_VERSION), db=index.meta)
    txn.put(META_UUID, store_uuid, db=index.meta)
    txn.put(META_EXTENT_BYTES, pack_u64(extent_bytes), db=index.meta)
    txn.put(META_NEXT_EXTENT, pack_u64(1), db=index.meta)
    txn.put(META_SEQ, pack_u64(0), db=index.meta)


def record_namespace(txn: Txn, index: Index, digest: bytes, canonical_json: str) -> None:
    json.loads(canonical_json)  # only ever store valid JSON
    txn.put(namespace_key(digest), canonical_json.encode(), db=index.meta)
