"""Not public API: a window into an open store's parts, for kvstore's own tests and
benchmarks (and nothing else).  Nothing here is stable: names and shapes change with
the store's insides, without notice or deprecation.

``Store`` keeps its parts private; a test that must look inside (the index, the
allocator, the I/O engine and the open extent files, the call paths) asks for them here::

    from kvstore.testing import parts
    parts(store).index.get_entries([key])
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from kvstore.blocking import BlockingStore
from kvstore.store import Store, _Paths

if TYPE_CHECKING:
    from kvstore.core.allocator import Allocator
    from kvstore.core.events import EventHub
    from kvstore.core.free_space import FreeSpace
    from kvstore.core.key_order import KeyOrder
    from kvstore.core.owners import Owner
    from kvstore.index.index import Index, IndexWriter
    from kvstore.io.arena import Arena
    from kvstore.io.group_sync import GroupSync
    from kvstore.io.protocol import IOEngine
    from kvstore.io.scheduler import IoScheduler
    from kvstore.io.transfers import Transfers
    from kvstore.tiers.memory.cache import MemoryCache

__all__ = ["Parts", "free_runs", "parts", "rechecks_idle", "scrub_passes", "waiting_on",
           "waiting_reserves"]

@dataclass
class Parts(_Paths):
    """An open store's call paths (kvstore/store.py: ``reads``, ``rechecks``,
    ``scrubber``, ``tiers``, ``memory_tier``, ``puts``, ``gets``, ``host``) and its parts
    (kvstore/core/opening.py)."""

    index: Index
    writer: IndexWriter
    engine: IOEngine
    fds: dict[int, int]  # extent id -> open descriptor
    arena: Arena
    allocator: Allocator
    transfers: Transfers
    scheduler: IoScheduler | None
    syncs: GroupSync
    file_mode: int
    store_uuid: bytes
    extent_bytes: int
    lost_extents: set[int]
    memory: MemoryCache | None  # the memory tier's cache
    counters: dict[str, int]  # what stats() reports, live
    events: EventHub  # the event stream's subscriptions (kvstore/core/events.py)
    owner: Owner  # this store's registration among the store's owners (issue 43)


def parts(store: Store | BlockingStore) -> Parts:
    """The parts of ``store`` (a :class:`BlockingStore`'s: of the store it drives)."""
    s = store.store if isinstance(store, BlockingStore) else store
    p, paths = s._parts, s._paths  # noqa: SLF001 - the seam exists to reach them
    return Parts(
        **{f.name: getattr(paths, f.name) for f in fields(paths)},
        index=p.index, writer=p.writer, engine=p.engine, fds=p.files.fds, arena=p.arena,
        allocator=p.allocator, transfers=p.transfers, scheduler=p.scheduler, syncs=p.syncs,
        file_mode=p.file_mode, store_uuid=p.store_uuid, extent_bytes=p.extent_bytes,
        lost_extents=p.lost_extents, counters=p.counters, events=p.events, owner=p.owner,
        memory=None if paths.memory_tier is None else paths.memory_tier.cache)


# What tests watch that the store itself never asks: read from the parts' private state
# here, so the production classes carry no method only a test calls.

def waiting_reserves(allocator: Allocator) -> int:
    """Reserves in line (kvstore/core/allocator.py's module docstring)."""
    return len(allocator._waiting)  # noqa: SLF001


def next_ticket(allocator: Allocator) -> int:
    """The place in line the allocator's next reserve call will take."""
    return next(copy.copy(allocator._tickets))  # noqa: SLF001


def in_line(allocator: Allocator, ticket: int) -> bool:
    """Whether the reserve holding ``ticket`` waits in line now."""
    return ticket in allocator._waiting  # noqa: SLF001


def waiting_on(order: KeyOrder, key: bytes) -> int:
    """Puts and deletes of ``key`` waiting for earlier ones now (a delete queued up
    behind a put)."""
    return sum(t.waiting for t in order._lines.get(key, ()))  # noqa: SLF001


def free_runs(space: FreeSpace) -> list[tuple[int, int, int]]:
    """The free runs ``(extent, offset, length)``, sorted."""
    return sorted((e, o, n) for (e, o), n in space._by_start.items())  # noqa: SLF001


async def rechecks_idle(store: Store) -> None:
    """Until no re-read of unreadable blocks is scheduled or running."""
    await parts(store).rechecks.wait_idle()


async def scrub_passes(store: Store, n: int) -> None:
    """Until ``n`` scrub passes (the background scrub's or callers') completed since the
    store opened (``stats().scrub_passes``)."""
    await parts(store).scrubber.wait_passes(n)
