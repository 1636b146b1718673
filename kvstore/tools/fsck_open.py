"""How fsck opens a store and shares it with live processes (kvstore/tools/fsck.py, steps
1 and 4): ``PATH/LOCK`` shared for a check, beside any live processes that have the
store open (no owner registered, nothing written), exclusively for a repair (refused
while a store is open, naming the pids); then the LMDB index.  Beside live owners, what
they may be doing after fsck's snapshot is not damage: an extent file being made
(:func:`being_made`), a slot reused or rewritten (:func:`changed_since`).

Under the exclusive lock nothing changes the index, so its data file is walked (every
page: kvstore/index/file.py) before LMDB maps it.  Beside live writers a walk without
a reader could follow pages another process frees and reuses meanwhile, so a check
opens the index with the two-read check an ``open()`` makes and walks it inside its
read transaction (:func:`walk_index`: the pages of every commit since that
transaction began stay as they are until it ends), reading again when a walk fails,
as a commit being written may have torn what it read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kvstore.disk import layout
from kvstore.disk.format import IndexEntry
from kvstore.disk.lock import StoreLock
from kvstore.disk.store_files import check_dir
from kvstore.errors import IndexCorruptionError, StoreLockedError
from kvstore.index import environments
from kvstore.index.file import check_data_file
from kvstore.index.index import MAP_LIMIT_BYTES, Index, IndexWriter
from kvstore.index.quarantine import same_slot

__all__ = ["WALK_TRIES", "being_made", "changed_since", "open_for_check", "walk_index"]

WALK_TRIES = 3  # walks of a store in use before a failure counts as damage


def open_for_check(path: str, repair: bool) -> tuple[Index, IndexWriter | None, StoreLock]:
    """The lock, the index and (``repair`` only) its writer; each released on failure."""
    if not repair and environments.is_open(layout.index_dir(path)):
        # LMDB forbids a second environment of one store in a process (closing it drops
        # the first's locks)
        raise StoreLockedError(11, f"store {path} is open in this process; run fsck from "
                               "another process (`python -m kvstore fsck`)")
    try:
        lock = StoreLock(path, exclusive=repair)
    except StoreLockedError as e:
        if not repair:
            raise
        raise StoreLockedError(e.errno, f"{e.strerror}; or run fsck without --repair "
                               "for a read-only check beside it") from None
    with lock.released_on_error():  # a link for extents/ or the index, damage: exit 2
        check_dir(layout.extents_dir(path), "Move the extents directory itself there.")
        index = Index(layout.index_dir(path), map_size=MAP_LIMIT_BYTES, sync=True,
                      verify=repair)
        if not repair:
            return index, None, lock
        try:
            return index, IndexWriter(index), lock
        except BaseException:
            index.close()
            raise


def walk_index(path: str) -> None:
    """Every page of the index's data file checked (kvstore/index/file.py), inside the
    caller's read transaction (the module docstring); IndexCorruptionError if it fails
    :data:`WALK_TRIES` times."""
    data = os.path.join(layout.index_dir(path), layout.INDEX_FILES[0])
    for tries in range(1, WALK_TRIES + 1):
        try:
            check_data_file(data, walk=True, fix=f"Close the store everywhere, then run "
                            f"`python -m kvstore fsck {path} --rebuild-index`.")
            return
        except IndexCorruptionError:
            if tries == WALK_TRIES:
                raise


def being_made(index: Index, beside_live: bool) -> Callable[[int], bool]:
    """Beside live owners: is an extent id, whose file fsck found unnamed in its
    snapshot, one an owner is making (a ``creating`` row names it: written before the
    file is made) or has added since, the index read now?  Under the exclusive lock
    none is: such a file is an orphan."""
    if not beside_live:
        return lambda extent_id: False
    with index.begin() as txn:
        making = set(index.owner_records.creating_owners(txn))
    named = set(index.extents_list())
    return lambda extent_id: extent_id in making or extent_id in named


def changed_since(index: Index, key: bytes, e: IndexEntry, *, quarantined: bool) -> bool:
    """Does ``key``'s entry (its quarantine record if ``quarantined``), read now, name
    another slot than ``e`` (read in fsck's snapshot)?  Then a slot that failed was
    freed and reused, or its key stored again, by a live owner: not damage."""
    if quarantined:
        now = index.quarantine_records.of([key]).get(key)
        current = now[0] if now is not None else None
    else:
        current = index.get_entries([key])[0]
    return current is None or not same_slot(current, e)
