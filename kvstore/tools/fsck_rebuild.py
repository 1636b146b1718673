"""``python -m kvstore fsck PATH --rebuild-index``: the LMDB index recreated from the
extent files alone (every slot describes itself).

1. Refuse (creating nothing) a path with no extent files: there is nothing to rebuild
   from, and writing an index there would turn a foreign directory into a store.
2. Take the store lock.  Read every extent file's header.  A link or a file that is not
   regular is left out (never read through); so is a file whose header names another
   extent or, by majority, another store.  A header that cannot be read (an I/O error)
   is damage: the file is rebuilt all the same, as the extent its name says, of its
   file size, in the majority's store, so that its slots are not lost for one sector.
3. Scan every extent for slots whose header and payload verify (kvstore/tools/fsck_files.py,
   ``verified_slots``); the newest sequence number wins per key.  A range that cannot be
   read is damage, reported with its errno, and stays out of the free space: no put
   writes over it before a later rebuild, once it reads, can find what it holds.
4. Keep the old index directory aside (``index.broken-<time>``) and write the new one:
   meta records, the verified slots as blocks, everything else (less step 3's unreadable
   ranges) as free space.  Namespace records cannot be recovered; the next ``open``
   with a namespace records it.
"""

from __future__ import annotations

import errno
import os
import time
from collections import Counter

from kvstore.disk import layout
from kvstore.disk.format import (
    EXTENT_HEADER_BYTES,
    PAGE,
    ExtentHeader,
    IndexEntry,
    SlotHeader,
)
from kvstore.disk.layout import extent_path
from kvstore.disk.lock import StoreLock
from kvstore.disk.store_files import unsafe_reason
from kvstore.errors import KVStoreError
from kvstore.index.index import (
    MAP_LIMIT_BYTES,
    Index,
    IndexWriter,
    Txn,
    init_meta,
)
from kvstore.io.protocol import IOEngine
from kvstore.tools.fsck_files import ExtentReader, Unreadable, verified_slots
from kvstore.tools.fsck_report import DAMAGE, Finding, ProgressFn, Report

__all__ = ["rebuild_index"]


def _require_extents(path: str, directory: str) -> None:
    """Refuse to rebuild where there is no store (step 1)."""
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"no such directory: {path}")
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"{path} is a file, not a store directory")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if not any(layout.is_extent_name(n) for n in names):
        raise FileNotFoundError(errno.ENOENT, f"no kvstore at {path}: nothing to rebuild from "
                                f"(no extent files in {directory})")


class _Extent:
    """One extent file to rebuild from: its header, or (``header`` None) what its name
    and size say when the header cannot be read."""

    def __init__(self, path: str, extent_id: int, size: int, header: ExtentHeader | None):
        self.path, self.extent_id, self.size, self.header = path, extent_id, size, header
        self.unreadable: list[Unreadable] = []


def _read_headers(path: str, directory: str, reader: ExtentReader,
                  report: Report) -> dict[int, _Extent]:
    """Step 2 (less the majority's store, which needs them all)."""
    found: dict[int, _Extent] = {}
    for name in sorted(os.listdir(directory)):
        p = os.path.join(directory, name)
        if (reason := unsafe_reason(p)) is not None:  # never read through
            report.findings.append(Finding("unsafe-extent-file", DAMAGE, f"{p} is {reason}; "
                                           "left out", fixed=True))
            continue
        try:
            h = ExtentHeader.decode(reader.read(p, 0, EXTENT_HEADER_BYTES))
        except OSError as e:
            try:  # its size, through the descriptor the header read was tried on
                size = os.fstat(reader.fd(p)).st_size if layout.is_extent_name(name) else None
            except OSError:
                size = None
            if size is None:
                report.findings.append(Finding("unreadable", DAMAGE, f"{p} cannot be read "
                                               f"({e.strerror}); left out, left as it is",
                                               errno=e.errno))
                continue
            extent_id = layout.extent_id_of(name)
            report.findings.append(Finding(
                "unreadable", DAMAGE, f"{p}: its extent header cannot be read ({e.strerror}); "
                f"rebuilt as extent {extent_id} from its name and size, header left as it is",
                extent=extent_id, offset=0, length=PAGE, errno=e.errno))
            found[extent_id] = _Extent(p, extent_id, size, None)
            continue
        except KVStoreError as e:
            report.findings.append(Finding("bad-extent-header", DAMAGE,
                                           f"{p}: {e}; file left out", fixed=True))
            continue
        if name != os.path.basename(extent_path(path, h.extent_id)):
            report.findings.append(Finding("bad-extent-header", DAMAGE,
                                           f"{p} claims extent {h.extent_id}; left out",
                                           fixed=True))
            continue
        found[h.extent_id] = _Extent(p, h.extent_id, h.extent_bytes, h)
    return found


def _free_runs(size: int, used: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of ``[PAGE, size)`` that ``used`` (offset, length; disjoint) leaves."""
    free, cursor = [], PAGE
    for o, n in sorted(used):
        if o > cursor:
            free.append((cursor, o - cursor))
        cursor = max(cursor, o + n)
    if cursor < size:
        free.append((cursor, size - cursor))
    return free


def rebuild_index(path: str, *, progress: ProgressFn | None = None,
                  engine: IOEngine | None = None) -> Report:
    """Recreate the LMDB index from the extent files (see the module docstring), read
    through ``engine`` (as ``fsck.check`` reads them: kvstore/tools/fsck_files.py)."""
    path = os.path.abspath(path)
    started = time.perf_counter()
    report = Report(path=path, deep=True, repair=True)
    progress = progress or (lambda stage, done, total: None)
    directory = layout.extents_dir(path)
    _require_extents(path, directory)  # before the lock: a foreign directory gets nothing
    lock = StoreLock(path)  # exclusively: refused, naming them, while stores are open
    try:
        with ExtentReader(engine) as reader:
            _rebuild(path, directory, reader, report, progress)
    finally:
        lock.release()
    report.seconds = time.perf_counter() - started
    return report


def _rebuild(path: str, directory: str, reader: ExtentReader, report: Report,
             progress: ProgressFn) -> None:
    """Steps 2 to 4, under the store lock."""
    found = _read_headers(path, directory, reader, report)
    uuids = Counter(x.header.store_uuid for x in found.values() if x.header is not None)
    uuid = uuids.most_common(1)[0][0] if uuids else os.urandom(16)
    extents: dict[int, _Extent] = {}
    for extent_id, x in sorted(found.items()):
        if x.header is not None and x.header.store_uuid != uuid:
            report.findings.append(Finding("bad-extent-header", DAMAGE, f"{x.path} belongs "
                                           "to another store; left out", fixed=True))
        else:
            extents[extent_id] = x
    best: dict[bytes, tuple[int, int, SlotHeader]] = {}
    total, done = sum(x.size for x in extents.values()), 0
    for extent_id, x in extents.items():
        size = min(x.size, os.fstat(reader.fd(x.path)).st_size)
        for off, header in verified_slots(reader, x.path, PAGE, size - PAGE,
                                          x.unreadable.append):
            old = best.get(header.key)
            if old is None or old[2].seq < header.seq:
                best[header.key] = (extent_id, off, header)
        for bad in x.unreadable:
            report.findings.append(Finding(
                "unreadable", DAMAGE, f"{x.path}: {bad.describe()}; kept out of the free "
                "space (rebuild again once it reads)", extent=extent_id, offset=bad.offset,
                length=bad.length, errno=bad.error.errno))
        done += x.size
        progress("extents", done, total)
    _write_index(path, uuid, extents, best)
    report.blocks = len(best)
    report.extents = len(extents)
    report.payloads_verified = len(best)


def _write_index(path: str, uuid: bytes, extents: dict[int, _Extent],
                 keep: dict[bytes, tuple[int, int, SlotHeader]]) -> None:
    """Step 4 (slots found by the scan never overlap: see ``verified_slots``)."""
    index_dir = layout.index_dir(path)
    if os.path.isdir(index_dir):
        os.rename(index_dir, layout.broken_index_dir(path, int(time.time())))
    index = Index(index_dir, map_size=MAP_LIMIT_BYTES, sync=True)
    writer = IndexWriter(index)
    try:
        extent_bytes = max((x.size for x in extents.values()), default=1 << 30)

        def build(txn: Txn) -> None:
            init_meta(txn, index, store_uuid=uuid, extent_bytes=extent_bytes)
            index.meta_records.set_next_extent(txn, max(extents, default=0) + 1)
            index.meta_records.raise_seq(txn, max((v[2].seq for v in keep.values()), default=0))
            used: dict[int, list[tuple[int, int]]] = {
                extent_id: [(b.offset, b.length) for b in x.unreadable]
                for extent_id, x in extents.items()}
            for k, (e, o, hd) in keep.items():
                entry = IndexEntry(extent=e, offset=o, slot_len=hd.slot_len,
                                   payload_len=hd.payload_len, raw_len=hd.raw_len,
                                   codec=hd.codec, dtype=hd.dtype, payload_crc=hd.payload_crc,
                                   seq=hd.seq, last_use=0, parent=hd.parent)
                index.add_block(txn, k, entry)
                used[e].append((o, hd.slot_len))
            for extent_id, x in extents.items():
                index.repairs.record_extent(txn, extent_id, x.size, _free_runs(x.size, used[extent_id]))

        writer.run_sync(build)
    finally:
        writer.close()
        index.close()
