"""Where each rank of a tensor/pipeline-parallel vLLM engine keeps its KV shard.

Each rank (vLLM's global worker rank, TP x PP) computes and reads only its own shard of
every block: its KV heads (TP) or its layers (PP).  Each rank gets **a store directory
of its own**, ``PATH/rank-R-of-W``; with one worker (W = 1) the store is ``PATH`` itself,
as before.

Why directories, not per-rank namespaces in one store: a store directory is opened by
exactly one process (its lock, its LMDB write thread, its allocator), and the ranks are
processes of their own.  One shared store would need one rank to do every other rank's
I/O, moving each shard across processes twice; separate stores keep every rank's reads
and writes in that rank (in parallel, on its own io_uring), need no coordination, and
``fsck`` checks each shard on its own.  What a directory per rank costs: capacity and
eviction are per rank, so one rank may evict a block another still has.  The scheduler
therefore counts a block as a hit only when every rank has it (it asks every rank's
lookup server and takes the minimum, :class:`~kvstore.integrations.vllm.lookup.RankLookups`);
a block one rank lost after the lookup fails to load on that rank, which reports it, and
vLLM recomputes it on all ranks.

The world size is in the directory name (and TP rank and size in every key's namespace):
an engine restarted with another TP size starts with empty stores instead of reading
shards of another layout.  ``capacity_bytes`` and ``memory_bytes`` are totals for the
engine, split evenly; without ``capacity_bytes`` each rank may use what its directory
already holds plus its share of 90% of the file system's free space (the store's own
default, divided: W stores each claiming 90% would together claim far more than exists).

Imports no vLLM (unit-tested in the main test environment).
"""

from __future__ import annotations

import dataclasses
import os

from kvstore.disk import permissions
from kvstore.integrations.vllm.config import ConnectorConfig

__all__ = ["rank_config", "rank_dir", "rank_dirs"]


def rank_dir(path: str, rank: int, world_size: int) -> str:
    """The store directory of ``rank`` (``path`` itself for a single worker)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"kvstore connector: rank {rank} of world size {world_size}?")
    return path if world_size == 1 else os.path.join(path, f"rank-{rank}-of-{world_size}")


def rank_dirs(path: str, world_size: int) -> list[str]:
    return [rank_dir(path, r, world_size) for r in range(world_size)]


def _dir_bytes(path: str) -> int:
    """Bytes of the files directly in ``path`` (a store keeps its files there)."""
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    except FileNotFoundError:
        return 0


def rank_config(config: ConnectorConfig, rank: int, world_size: int) -> ConnectorConfig:
    """``config`` as ``rank``'s store is opened: its directory, its share of the
    capacity and of the memory tier.  Creates ``path`` (the parent of the rank
    directories) when W > 1, so that free space can be measured there."""
    if world_size == 1:
        rank_dir(config.path, rank, world_size)  # validates
        return config
    store = config.store
    permissions.make_dirs(config.path, store.file_mode or permissions.FILE_MODE)
    own = rank_dir(config.path, rank, world_size)
    if store.capacity_bytes is not None:
        capacity = store.capacity_bytes // world_size
    else:
        st = os.statvfs(config.path)
        capacity = _dir_bytes(own) + int(0.9 * st.f_bavail * st.f_frsize) // world_size
    if capacity < 4096:
        raise ValueError(f"kvstore connector: capacity_bytes={store.capacity_bytes} split "
                         f"between {world_size} ranks leaves each less than 4 KiB")
    return dataclasses.replace(config, path=own, store=dataclasses.replace(
        store, capacity_bytes=capacity, memory_bytes=store.memory_bytes // world_size))
