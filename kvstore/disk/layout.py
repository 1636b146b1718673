"""Every file and directory name inside a store's directory, once (FORMAT.md, "Store directory").

::

    PATH/
      LOCK                  the store lock: shared by every open Store, exclusive for an
                            exclusive open and fsck (kvstore.disk.lock)
      index/                the LMDB index (kvstore.index)
        data.mdb, lock.mdb  LMDB's two files, created by the store, never links
      extents/              the extent files (kvstore.disk.extents)
        NNNNNNNN.kvx        one per extent id, 8 decimal digits
      owners/               the open Stores (owners) sharing the store (issue 43)
        NNNNNNNN.lock       one per owner id, flock'd by it for its life (its liveness)
        marks               the owners' read marks, mapped shared (kvstore.io.marks)
      index.broken-<time>   an index that ``fsck --rebuild-index`` moved aside
      .probe-<kind>-<pid>   a file the I/O probe writes and removes (one a kill left)
      kvstore-demo.json     the manifest of a store ``python -m kvstore demo`` made

Code that names one of these imports it from here, so that fsck, the demo, the probe
and the store cannot disagree on what belongs to a store.
"""

from __future__ import annotations

import os

__all__ = ["BROKEN_INDEX_PREFIX", "DEMO_MANIFEST", "EXTENT_DIR", "EXTENT_SUFFIX", "INDEX_DIR",
           "INDEX_FILES", "LOCK_FILE", "MARKS_FILE", "OWNERS_DIR", "OWNER_LOCK_SUFFIX", "PROBE_PREFIX",
           "STORE_NAMES", "broken_index_dir", "extent_id_of", "extent_name", "extent_path",
           "extents_dir", "index_dir", "is_extent_name", "lock_path", "marks_path", "owner_id_of",
           "owner_lock_path", "owners_dir", "probe_path"]

LOCK_FILE = "LOCK"
INDEX_DIR = "index"
INDEX_FILES = ("data.mdb", "lock.mdb")
"""LMDB's data and lock files inside ``index/`` (the names LMDB gives them)."""
EXTENT_DIR = "extents"
EXTENT_SUFFIX = ".kvx"
OWNERS_DIR = "owners"
OWNER_LOCK_SUFFIX = ".lock"
MARKS_FILE = "marks"
BROKEN_INDEX_PREFIX = "index.broken-"
PROBE_PREFIX = ".probe-"
DEMO_MANIFEST = "kvstore-demo.json"

STORE_NAMES = frozenset({LOCK_FILE, INDEX_DIR, EXTENT_DIR, OWNERS_DIR})
"""The entries every store's directory holds (besides the prefixed ones above)."""


def index_dir(store_path: str) -> str:
    return os.path.join(store_path, INDEX_DIR)


def extents_dir(store_path: str) -> str:
    return os.path.join(store_path, EXTENT_DIR)


def lock_path(store_path: str) -> str:
    return os.path.join(store_path, LOCK_FILE)


def owners_dir(store_path: str) -> str:
    return os.path.join(store_path, OWNERS_DIR)


def owner_lock_path(store_path: str, owner_id: int) -> str:
    """The lock file of owner ``owner_id`` (an open Store), 8 decimal digits."""
    return os.path.join(store_path, OWNERS_DIR, f"{owner_id:08d}{OWNER_LOCK_SUFFIX}")


def marks_path(store_path: str) -> str:
    """The owners' read marks (not durable state: kvstore.io.marks)."""
    return os.path.join(store_path, OWNERS_DIR, MARKS_FILE)


def owner_id_of(name: str) -> int | None:
    """The owner id in an owner lock file's name ``NNNNNNNN.lock``; None for another name."""
    stem = name.removesuffix(OWNER_LOCK_SUFFIX)
    if name.endswith(OWNER_LOCK_SUFFIX) and len(stem) == 8 and stem.isdigit():
        return int(stem)
    return None


def extent_name(extent_id: int) -> str:
    return f"{extent_id:08d}{EXTENT_SUFFIX}"


def extent_path(store_path: str, extent_id: int) -> str:
    return os.path.join(store_path, EXTENT_DIR, extent_name(extent_id))


def is_extent_name(name: str) -> bool:
    """``NNNNNNNN.kvx``: the only names the store gives files in ``extents/``."""
    stem = name.removesuffix(EXTENT_SUFFIX)
    return name.endswith(EXTENT_SUFFIX) and len(stem) == 8 and stem.isdigit()


def extent_id_of(name: str) -> int:
    """The extent id in an extent file's name (one :func:`is_extent_name` accepts)."""
    return int(name.removesuffix(EXTENT_SUFFIX))


def broken_index_dir(store_path: str, when: int) -> str:
    """Where ``fsck --rebuild-index`` keeps the index it replaces (``when``: Unix time)."""
    return os.path.join(store_path, f"{BROKEN_INDEX_PREFIX}{when}")


def probe_path(directory: str, kind: str) -> str:
    """The I/O probe's scratch file of ``kind`` (``direct``, ``uring``) for this process."""
    return os.path.join(directory, f"{PROBE_PREFIX}{kind}-{os.getpid()}")
