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
lookup server and takes the minimum, :class:`~kvstore.integrations.vllm.lookup_socket.RankLookups`);
a block one rank lost after the lookup fails to load on that rank, which reports it, and
vLLM recomputes it on all ranks.

The world size is in the directory name (and TP rank and size in every key's namespace):
an engine restarted with another TP size starts with empty stores instead of reading
shards of another layout.  ``capacity_bytes`` and ``memory_bytes`` are totals for the
engine, split evenly between the ranks, by the rule every integration follows
(:func:`kvstore.integrations.common.ranks.rank_options`).  The directories are made
when each rank's store opens.

Imports no vLLM (unit-tested in the main test environment).
"""

from __future__ import annotations

import dataclasses
import os

from kvstore.integrations.common.ranks import rank_options
from kvstore.integrations.vllm.config import ConnectorConfig

__all__ = ["rank_config", "rank_dir", "rank_dirs"]


def rank_dir(path: str, rank: int, world_size: int) -> str:
    """The store directory of ``rank`` (``path`` itself for a single worker)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"kvstore connector: rank {rank} of world size {world_size}?")
    return path if world_size == 1 else os.path.join(path, f"rank-{rank}-of-{world_size}")


def rank_dirs(path: str, world_size: int) -> list[str]:
    return [rank_dir(path, r, world_size) for r in range(world_size)]


def rank_config(config: ConnectorConfig, rank: int, world_size: int) -> ConnectorConfig:
    """``config`` as ``rank``'s store is opened: its directory, its share of the
    capacity and of the memory tier."""
    own = rank_dir(config.path, rank, world_size)
    if world_size == 1:
        return config
    return dataclasses.replace(config, path=own, store=rank_options(
        config.store, own, world_size, "kvstore connector"))
