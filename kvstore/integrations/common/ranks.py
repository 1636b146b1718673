"""The store options of one rank of an engine whose ranks (processes) keep a store
each, side by side under one directory: the same rule for every integration.

A store directory is opened by exactly one process (its lock, its LMDB write thread,
its allocator), so every rank process of an engine (vLLM's TP x PP workers, SGLang's
TP x PP x CP scheduler processes) has a directory of its own below the configured
one.  Those stores share one file system, so the configured sizes are the engine's, not
each rank's: ``capacity_bytes`` and ``memory_bytes`` are split evenly between the
ranks.  Without ``capacity_bytes`` a rank may use what its directory already holds
plus its share of 90% of the file system's free space (the store's own default,
divided: N stores each claiming 90% would together claim far more than exists).
"""

from __future__ import annotations

import dataclasses
import os

from kvstore.options import StoreOptions

__all__ = ["FREE_SHARE", "MIN_CAPACITY", "rank_options"]

FREE_SHARE = 0.9  # of the free space, without capacity_bytes (the store's own default)
MIN_CAPACITY = 4096  # one page: a rank with less could store nothing


def _dir_bytes(path: str) -> int:
    """Bytes of the files directly in ``path`` (a store keeps its files there)."""
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    except FileNotFoundError:
        return 0


def _free_bytes(path: str) -> int:
    """Free bytes of the file system ``path`` is (or will be, once made) on."""
    p = os.path.abspath(path)
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def rank_options(options: StoreOptions, own_dir: str, ranks: int, who: str) -> StoreOptions:
    """``options`` as one of ``ranks`` rank processes opens its store in ``own_dir``
    (module docstring): ``options`` itself for a single rank.  A split that leaves a
    rank less than a page is a ``ValueError`` starting with ``who``."""
    if ranks < 1:
        raise ValueError(f"{who}: {ranks} ranks?")
    if ranks == 1:
        return options
    if options.capacity_bytes is not None:
        capacity = options.capacity_bytes // ranks
    else:
        capacity = _dir_bytes(own_dir) + int(FREE_SHARE * _free_bytes(own_dir)) // ranks
    if capacity < MIN_CAPACITY:
        raise ValueError(f"{who}: capacity_bytes={options.capacity_bytes} split between "
                         f"{ranks} ranks leaves each less than 4 KiB")
    return dataclasses.replace(options, capacity_bytes=capacity,
                               memory_bytes=options.memory_bytes // ranks)
