"""What a store holds, streamed in pages: the start of a consumer's view (``Store.snapshot``).

Each page is one short LMDB read transaction over the ``blocks`` table (``page_blocks``
rows after the last key of the previous page) and their tags (``tags``), read and decoded
on a worker thread, so a
store of millions of blocks is listed without holding a reader for minutes (which would
make every commit meanwhile take new pages) and without stalling the event loop.  Pages
are read at different moments, so a snapshot alone is not one instant of the store;
taken after ``Store.subscribe`` it needs not be: a key changed after the subscription
began has an event that comes later in the stream, and a key not changed since then is
read as it is (kvstore/core/events.py says how to fold the two).

``order="parents_first"`` lists every block after its parent (when the parent is
stored), as routers that reject a block whose parent they do not know need: all the
pages are read first (about 300 bytes of memory a block, plus its tag), then ordered.
A block whose parent is not stored comes out as a chain's start.

``tag_prefix`` keeps the blocks whose tag starts with those bytes (an engine puts its
scope first in its tags); untagged blocks are left out then.  The store does not read
tags: it compares bytes after each page is read, and the pages handed out are refilled
to ``page_blocks``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import anyio

from kvstore.disk.format import IndexEntry

__all__ = ["DEFAULT_PAGE_BLOCKS", "KEY_ORDER", "ORDERS", "PARENTS_FIRST", "StoredBlock",
           "check_snapshot", "parents_first", "read_page", "snapshot_pages"]

DEFAULT_PAGE_BLOCKS = 4096
KEY_ORDER, PARENTS_FIRST = "key", "parents_first"
ORDERS = (KEY_ORDER, PARENTS_FIRST)

PageReader = Callable[[bytes | None, int], Awaitable[list["StoredBlock"]]]


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block the store holds: its key, its parent's key (None: a chain's start) and
    the caller's tag (``put_many(tags=)``; None: it has none)."""

    key: bytes
    parent: bytes | None
    tag: bytes | None = None


class RowSource(Protocol):
    def tagged_rows_after(self, after: bytes | None, limit: int
                          ) -> list[tuple[bytes, bytes, bytes | None]]: ...


def read_page(tags: RowSource, after: bytes | None, limit: int) -> list[StoredBlock]:
    """Up to ``limit`` stored blocks after key ``after``, in key order, with their tags
    (one read transaction; blocking: run it on a worker thread)."""
    return [StoredBlock(key, IndexEntry.decode(row).parent, tag)
            for key, row, tag in tags.tagged_rows_after(after, limit)]


def check_snapshot(page_blocks: int, order: str, tag_prefix: bytes | None = None) -> None:
    """ValueError for a page size that is not a positive int, an unknown order or a
    ``tag_prefix`` that is not bytes."""
    if not isinstance(page_blocks, int) or isinstance(page_blocks, bool) or page_blocks < 1:
        raise ValueError(f"page_blocks must be a positive int, got {page_blocks!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if tag_prefix is not None and not isinstance(tag_prefix, bytes):
        raise ValueError(f"tag_prefix must be bytes or None, got {type(tag_prefix).__name__}")


async def snapshot_pages(read: PageReader, page_blocks: int, order: str,
                         tag_prefix: bytes | None = None) -> AsyncIterator[list[StoredBlock]]:
    """The store's blocks (those whose tag starts with ``tag_prefix``, if given) in
    pages of ``page_blocks`` (the last may be shorter; none for an empty store), in key
    order or parents first (arguments checked by :func:`check_snapshot`)."""
    if order == KEY_ORDER:
        async for page in _key_pages(read, page_blocks, tag_prefix):
            yield page
        return
    everything = [b async for page in _key_pages(read, page_blocks, tag_prefix) for b in page]
    ordered = await anyio.to_thread.run_sync(parents_first, everything)
    for start in range(0, len(ordered), page_blocks):
        yield ordered[start:start + page_blocks]


async def _key_pages(read: PageReader, page_blocks: int, tag_prefix: bytes | None
                     ) -> AsyncIterator[list[StoredBlock]]:
    after: bytes | None = None
    pending: list[StoredBlock] = []  # kept blocks not handed out yet
    while True:
        page = await read(after, page_blocks)
        if tag_prefix is None:
            pending.extend(page)
        else:
            pending.extend(b for b in page if b.tag is not None and b.tag.startswith(tag_prefix))
        while len(pending) >= page_blocks:
            yield pending[:page_blocks]
            del pending[:page_blocks]
        if len(page) < page_blocks:
            if pending:
                yield pending
            return
        after = page[-1].key


def parents_first(blocks: list[StoredBlock]) -> list[StoredBlock]:
    """``blocks`` reordered so that each comes after its parent if its parent is among
    them (chains' starts in the order given, then breadth first).  Nothing is lost:
    blocks caught in a cycle of parents (which chained keys cannot form) come last."""
    present = {b.key for b in blocks}
    children: dict[bytes, list[StoredBlock]] = {}
    out: list[StoredBlock] = []
    for b in blocks:
        if b.parent is None or b.parent not in present:
            out.append(b)
        else:
            children.setdefault(b.parent, []).append(b)
    i = 0
    while i < len(out):
        kids = children.pop(out[i].key, None)
        if kids:
            out.extend(kids)
        i += 1
    for rest in children.values():
        out.extend(rest)
    return out
