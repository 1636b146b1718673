"""The LMDB environment opened safely: ``index/`` and its two files are the store's own
(:mod:`kvstore.disk.store_files`), and the data file is checked before LMDB maps it
(:func:`open_environment`).

``data.mdb``, checked before LMDB maps it:

LMDB maps the whole file and trusts it: a page it follows that lies past the end of
the file is a ``SIGBUS`` that kills the process (a ``data.mdb`` truncated to 8 KiB did
that to ``open()`` and to fsck), and a damaged page is ``lmdb.CorruptedError`` at best.
An engine must never die because one file of its cache is damaged, so the file is read
with ``pread`` (which reports a short file instead of faulting) before it is mapped:

1. Missing or empty: a new index; LMDB initialises it.
2. Both meta pages (pages 0 and 1; LMDB's ``mdb.c``, ``MDB_meta`` after the 16-byte
   ``MDB_page`` header: ``mm_magic`` u32 ``0xBEEFC0DE``, ``mm_version`` u32 1,
   ``mm_address``, ``mm_mapsize``, two 48-byte ``MDB_db`` records (free and main; the
   free one's first u32 is the page size), ``mm_last_pg`` u64, ``mm_txnid`` u64) must
   parse, as ``mdb_env_read_header`` requires, with one plausible page size; the one
   with the larger ``mm_txnid`` is the one LMDB uses.
3. If ``(mm_last_pg + 1) * page_size <= file size``, every page the trees can name is
   in the file: LMDB never follows a page number past ``mm_last_pg``
   (``mdb_page_get``: ``MDB_PAGE_NOTFOUND``).  That is the whole check at ``open()``:
   two reads, no scan.
4. Otherwise, and always for fsck (``walk=True``), every page reachable from the roots
   (the free and main trees, every named table, overflow pages) is read and checked:
   inside the file, numbered as its parent says, of the right kind, with its nodes
   inside it.  A file can legitimately end before ``mm_last_pg``: LMDB never writes a
   page that was allocated and freed again in one transaction ("loose" pages,
   ``mdb_page_flush``), so the check cannot stop at step 3's inequality; such pages are
   free, and the walk shows that nothing reachable lies there.

What is not checked at open is the content of pages inside the file: garbage there is
an ``lmdb.Error`` when it is read (translated to :class:`IndexCorruptionError`), and
fsck's walk finds it up front.  Native byte order and 64-bit page numbers, as LMDB
writes them on this host (LMDB 0.9's layout, which py-lmdb builds).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lmdb

from kvstore.disk import permissions, store_files
from kvstore.disk.layout import INDEX_FILES
from kvstore.errors import IndexCorruptionError, from_os_error
from kvstore.index.writer import lmdb_error

__all__ = ["IndexMeta", "check_data_file", "open_environment"]

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGE_HEADER = 16  # MDB_page: pgno u64, pad u16, flags u16, lower u16, upper u16
NODE_HEADER = 8   # MDB_node: lo u16, hi u16, flags u16, ksize u16
DB_RECORD = 48    # MDB_db: pad u32, flags u16, depth u16, 4 x u64 counts, root u64
NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty tree
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MAX_DEPTH = 32  # LMDB's cursor stack

_U16 = struct.Struct("=H")
_PAGE = struct.Struct("=QHHHH")
_META = struct.Struct("=II8x8x")  # magic, version, (address, mapsize)
_TAIL = struct.Struct("=QQ")      # last_pg, txnid


@dataclass(frozen=True)
class IndexMeta:
    """The meta page LMDB will use."""

    page_size: int
    last_page: int
    txnid: int
    roots: tuple[int, int]  # free tree, main tree (NO_PAGE: empty)


class _Damaged(Exception):
    pass


def _read_meta(fd: int, offset: int) -> tuple[int, int, IndexMeta]:
    raw = os.pread(fd, PAGE_HEADER + _META.size + 2 * DB_RECORD + _TAIL.size, offset)
    if len(raw) < PAGE_HEADER + _META.size + 2 * DB_RECORD + _TAIL.size:
        raise _Damaged(f"meta page at {offset} is cut short")
    flags = _PAGE.unpack_from(raw)[2]
    magic, version = _META.unpack_from(raw, PAGE_HEADER)
    if not flags & P_META or magic != MAGIC:
        raise _Damaged(f"meta page at {offset} is not an LMDB meta page")
    dbs = PAGE_HEADER + _META.size
    psize = struct.unpack_from("=I", raw, dbs)[0]
    roots = (struct.unpack_from("=Q", raw, dbs + 40)[0],
             struct.unpack_from("=Q", raw, dbs + DB_RECORD + 40)[0])
    last_pg, txnid = _TAIL.unpack_from(raw, dbs + 2 * DB_RECORD)
    return version, psize, IndexMeta(psize, last_pg, txnid, roots)


def read_meta(fd: int, size: int) -> IndexMeta:
    """Step 2 of the module docstring."""
    version, psize, first = _read_meta(fd, 0)
    if psize & (psize - 1) or not 512 <= psize <= 32768:
        raise _Damaged(f"meta page 0 has an impossible page size {psize}")
    if version != DATA_VERSION:
        raise _Damaged(f"meta page 0 has LMDB data version {version}, not {DATA_VERSION}")
    version, psize1, second = _read_meta(fd, psize)
    if version != DATA_VERSION or psize1 != psize:
        raise _Damaged("the two meta pages disagree (version or page size)")
    meta = second if second.txnid > first.txnid else first
    pages = size // psize
    if meta.last_page < 1 or meta.last_page + 1 > pages + max(pages, 1 << 20):
        raise _Damaged(f"the meta page names {meta.last_page + 1} pages; the file holds {pages}")
    return meta


class _Walk:
    """Step 4: every page reachable from the roots, read with ``pread``."""

    def __init__(self, fd: int, size: int, meta: IndexMeta) -> None:
        self.fd, self.size, self.meta = fd, size, meta
        self.psize = meta.page_size
        self.seen: set[int] = set()

    def claim(self, pgno: int, pages: int, what: str) -> None:
        """Pages ``pgno`` .. ``pgno + pages - 1`` are named once, inside the file."""
        if pgno < 2 or pgno + pages - 1 > self.meta.last_page:
            raise _Damaged(f"{what} names page {pgno}, outside pages 2-{self.meta.last_page}")
        if (pgno + pages) * self.psize > self.size:
            raise _Damaged(f"{what}: page {pgno + pages - 1} lies past the end of the file "
                           f"({self.size} bytes: it was cut short)")
        named = range(pgno, pgno + pages)
        if not self.seen.isdisjoint(named):
            raise _Damaged(f"{what}: a page from {pgno} on is reachable twice")
        self.seen.update(named)

    def page(self, pgno: int, what: str) -> bytes:
        self.claim(pgno, 1, what)
        raw = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(raw) < self.psize or _PAGE.unpack_from(raw)[0] != pgno:
            raise _Damaged(f"{what}: page {pgno} does not hold page {pgno}")
        return raw

    def tree(self, root: int, what: str) -> None:
        if root == NO_PAGE:
            return
        stack = [(root, 0)]
        while stack:
            pgno, depth = stack.pop()
            if depth >= MAX_DEPTH:
                raise _Damaged(f"{what} is deeper than {MAX_DEPTH} levels")
            raw = self.page(pgno, what)
            _, _, flags, lower, upper = _PAGE.unpack(raw[:PAGE_HEADER])
            kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META)
            if kind not in (P_BRANCH, P_LEAF) or not PAGE_HEADER <= lower <= upper <= self.psize:
                raise _Damaged(f"{what}: page {pgno} is not a valid tree page")
            if flags & P_LEAF2:
                continue  # keys packed without nodes (DUPFIXED tables: kvstore has none)
            for i in range((lower - PAGE_HEADER) // 2):
                node = _U16.unpack_from(raw, PAGE_HEADER + 2 * i)[0]
                if not upper <= node <= self.psize - NODE_HEADER:
                    raise _Damaged(f"{what}: page {pgno} has a node outside it")
                lo, hi, nflags, ksize = struct.unpack_from("=HHHH", raw, node)
                if kind == P_BRANCH:
                    stack.append((lo | hi << 16 | nflags << 32, depth + 1))
                else:
                    self.leaf_value(raw, pgno, node, lo | hi << 16, nflags, ksize, what)

    def leaf_value(self, raw: bytes, pgno: int, node: int, dsize: int, flags: int, ksize: int,
                   what: str) -> None:
        data = node + NODE_HEADER + ksize
        if data + (8 if flags & F_BIGDATA else dsize) > self.psize:
            raise _Damaged(f"{what}: page {pgno} has a node running past it")
        if flags & F_BIGDATA:
            first = struct.unpack_from("=Q", raw, data)[0]
            head = self.page(first, what)
            npages = struct.unpack_from("=I", head, 12)[0]
            if not _PAGE.unpack_from(head)[2] & P_OVERFLOW or npages * self.psize < dsize:
                raise _Damaged(f"{what}: overflow page {first} is not one")
            if npages > 1:
                self.claim(first + 1, npages - 1, what)
        elif flags & F_SUBDATA and dsize == DB_RECORD:  # a named table (or a dup tree)
            self.tree(struct.unpack_from("=Q", raw, data + 40)[0], f"a table of {what}")


def check_data_file(path: str, *, walk: bool = False, fix: str = "") -> IndexMeta | None:
    """Steps 1-4 of the module docstring for the ``data.mdb`` at ``path``; None for a
    new index.  Damage is :class:`IndexCorruptionError`, naming it and ``fix``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        meta = read_meta(fd, size)
        if walk or (meta.last_page + 1) * meta.page_size > size:
            w = _Walk(fd, size, meta)
            w.tree(meta.roots[0], "the free-page tree")
            w.tree(meta.roots[1], "the main tree")
        return meta
    except _Damaged as e:
        raise IndexCorruptionError(f"the LMDB index {path} is damaged ({e}). {fix}") from None
    finally:
        os.close(fd)


def open_environment(path: str, *, map_size: int, sync: bool, file_mode: int,
                     tables: Sequence[bytes], verify: bool) -> tuple[Any, list[Any]]:
    """LMDB's environment at ``path`` (``PATH/index``, created if missing) and its
    ``tables``.  The directory and its two files must be the store's own, not links;
    ``data.mdb`` is checked before it is mapped (``verify``: every page, fsck's);
    damage is :class:`IndexCorruptionError`; no ``lmdb.Error`` escapes."""
    rebuild = (f"Run `python -m kvstore fsck {os.path.dirname(path)} --rebuild-index` to "
               "rebuild the index from the extent files (the old one is kept aside).")
    store_files.check_dir(path, f"Move the index directory itself to {path}, or: {rebuild}")
    files = [os.path.join(path, name) for name in INDEX_FILES]
    try:
        permissions.make_dirs(path, file_mode)
        # Created here, not by LMDB: with exactly file_mode and without following a link
        # (O_EXCL, O_NOFOLLOW); LMDB then opens them as they are (an empty data.mdb is a
        # new index to it).
        before = [_own_file(f, file_mode, rebuild) for f in files]
    except OSError as e:
        raise from_os_error(e, f"cannot create the LMDB index at {path}") from e
    check_data_file(files[0], walk=verify, fix=rebuild)
    try:
        env = lmdb.open(path, map_size=map_size, subdir=True, max_dbs=len(tables), sync=sync,
                        metasync=sync, readahead=False, meminit=False, max_readers=256,
                        lock=True, mode=permissions.dir_mode(file_mode))
    except lmdb.Error as e:
        raise lmdb_error(e, f"cannot open the LMDB index at {path}", path) from e
    try:
        for f, st in zip(files, before):  # LMDB opened them by name: the same files?
            store_files.check_same(f, os.lstat(f), st, rebuild)
        return env, [env.open_db(name) for name in tables]
    except BaseException as e:
        env.close()
        if isinstance(e, lmdb.Error):
            raise lmdb_error(e, f"cannot open the tables of the LMDB index at {path}",
                             path) from e
        raise


def _own_file(path: str, file_mode: int, fix: str) -> os.stat_result:
    """``path`` as a regular file of the store (created empty with ``file_mode`` if
    missing), never through a link; its ``fstat``, to compare after LMDB opened it."""
    if store_files.check_file(path, fix) is None:
        fd = permissions.open_file(path, os.O_RDWR, file_mode)  # O_EXCL | O_NOFOLLOW
    else:
        fd = store_files.open_regular(path, os.O_RDONLY, fix)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    store_files.check_same(path, st, None, fix)
    return st
