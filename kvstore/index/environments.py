"""One LMDB environment per store per process (issue 43; DESIGN.md 5.1 step 3).

LMDB forbids opening one environment twice in a process: closing either handle drops
the other's locks (py-lmdb: "a serious error").  So every ``Store`` of this process on
one store directory shares one :class:`~kvstore.index.index.Index` and its
:class:`~kvstore.index.index.IndexWriter` (one writer thread, group commit across them),
counted here: the first ``acquire`` opens them (with its ``map_size``, ``sync`` and
file mode: a later one's are not applied; ``sync`` must agree anyway, which the
owners' registration checks), the last ``release`` closes them.  Extent descriptors stay
per ``Store`` (they belong to its I/O engine).

A forked child starts with an empty registry (an LMDB environment must not be used in
a forked child): it opens its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from kvstore.disk import permissions
from kvstore.index.index import Index, IndexWriter
from kvstore.index.journal import JournalSink

__all__ = ["acquire", "is_open", "open_count", "release"]

S = TypeVar("S", bound=JournalSink)


@dataclass
class _Shared:
    index: Index
    writer: IndexWriter
    sink: Any  # the first acquirer's make_sink(): every Store of the path reads its events
    users: int


_LOCK = threading.Lock()
_OPEN: dict[tuple[int, int], _Shared] = {}


def _key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def acquire(path: str, *, map_size: int, sync: bool, make_sink: Callable[[], S],
            file_mode: int = permissions.FILE_MODE) -> tuple[Index, IndexWriter, S]:
    """The index at ``path`` (``PATH/index``), its writer and the sink of the writer's
    content events (``make_sink()``), made by the first caller of this process, shared
    with the later ones until each calls :func:`release`."""
    with _LOCK:
        key = _key(path)
        shared = _OPEN.get(key) if key is not None else None
        if shared is None:
            index = Index(path, map_size=map_size, sync=sync, file_mode=file_mode)
            sink = make_sink()
            try:
                writer = IndexWriter(index, sink=sink)
            except BaseException:
                index.close()
                raise
            key = _key(path)
            assert key is not None, "the index directory exists once it is open"
            shared = _OPEN[key] = _Shared(index, writer, sink, 0)
        shared.users += 1
        return shared.index, shared.writer, cast(S, shared.sink)


def release(index: Index) -> None:
    """One user fewer of ``index``; the last one closes its writer, then the index."""
    with _LOCK:
        for key, shared in _OPEN.items():
            if shared.index is index:
                shared.users -= 1
                if shared.users:
                    return
                del _OPEN[key]
                break
        else:
            return
    shared.writer.close()
    shared.index.close()


def is_open(path: str) -> bool:
    """Does this process have the index at ``path`` open through the registry (a
    ``Store`` of it is open here)?"""
    with _LOCK:
        key = _key(path)
        return key is not None and key in _OPEN


def open_count() -> int:
    """Environments this process has open through the registry (for tests)."""
    with _LOCK:
        return len(_OPEN)


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    _OPEN.clear()  # the parent's: never used here


os.register_at_fork(after_in_child=_after_fork_in_child)
