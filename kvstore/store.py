"""The async block store: the public ``open()`` and ``Store``, a coordinator.

``Store`` opens its parts (:mod:`kvstore.core.opening`), guards every call (closed,
read-only: :mod:`kvstore.core.operations`), and hands it to the path that does the work:

* puts: :mod:`kvstore.core.puts` (validate, dedup, backlog, reserve, stage + write,
  fdatasync, commit, acknowledge);
* gets: :mod:`kvstore.core.gets`, reading through :mod:`kvstore.core.reads` (every verified
  read of a slot, in a read epoch, quarantining what fails);
* the memory tier and prefetch: :mod:`kvstore.tiers.memory.tier`; the remote tier:
  :mod:`kvstore.tiers.remote` through its adapter; both reach the store only through the
  :class:`~kvstore.tiers.host.TierHost` it hands them, and the paths reach them only
  through :mod:`kvstore.core.tier_ports`;
* deletes, pins, lookups: here, a few lines each over the index.

Every public call runs as one tracked operation: ``aclose()`` refuses new ones
(``StoreClosedError``), waits for those in flight, then stops the engine and the writer.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import (
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
    suppress,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from kvstore._cuda_path import CUDA_COPIER, page_locker
from kvstore.codecs.pipeline import CodecSpec
from kvstore.core.deletes import DeleteWatches
from kvstore.core.gets import GetPath
from kvstore.core.latency import Latency
from kvstore.core.opening import INDEX_DIR, StoreParts
from kvstore.core.operations import Operations
from kvstore.core.puts import PutPath, SlotLimits
from kvstore.core.reads import VerifiedReads
from kvstore.core.rechecks import Rechecks
from kvstore.core.scrub import (
    DEFAULT_SCRUB_BYTES_PER_S,
    ProgressFn,
    Scrubber,
    ScrubReport,
    scrub_state,
)
from kvstore.core.tier_ports import Tiers
from kvstore.disk.format import PAGE
from kvstore.disk.lock import LOCK_FILE
from kvstore.errors import KVStoreError
from kvstore.events import StoreEvents
from kvstore.keys import check_keys
from kvstore.options import StoreOptions
from kvstore.stats import (
    PutResult,
    StoreStats,
    io_fields,
    ratios,
    scrub_fields,
)
from kvstore.tiers.host import TierHost
from kvstore.tiers.memory.prefetch import Prefetch
from kvstore.tiers.memory.tier import MemoryTier

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvstore.io.page_locking import PageLocker
    from kvstore.keys import Namespace
    from kvstore.tiers.remote.adapter import RemoteAdapter
    from kvstore.tiers.remote.config import RemoteConfig
    from kvstore.tiers.remote.tier import RemoteTier

__all__ = ["LOCK_FILE", "INDEX_DIR", "PutResult", "Store", "StoreStats", "open"]


class Store(StoreEvents):
    """An open store.  Get one from :func:`open`; every method is a coroutine except
    ``stats()`` and ``prefetch()``.  Use a store from the event loop that opened it."""

    def __init__(self, path: str, options: StoreOptions) -> None:
        self.options = opts = options
        self.path = os.path.abspath(path)
        self.namespace = opts.namespace
        self.durable = opts.sync
        self.codec: CodecSpec | None = opts.codec  # the default (``put_many(codec=)`` overrides)
        self.latency = Latency(("get", "put", "prefetch"))  # (kvstore.metrics exports them)
        self.remote: RemoteTier | None = None  # the remote tier, when there is one
        self._remote: RemoteAdapter | None = None
        self._background: TaskGroup | None = None  # open() runs background work here
        self._ops, self._deletes = Operations(self.path), DeleteWatches()
        # Private, like every part below: kvstore.testing shows them to tests.
        locker = page_locker()
        parts = self._parts = StoreParts(self.path, opts, CUDA_COPIER, locker)
        self._health = parts.health
        try:
            self._paths = _open_paths(parts, opts, self._ops, self._deletes, self.latency,
                                      lambda: self._background, locker)
            if opts.remote is not None:
                self._open_remote(opts.remote, opts.namespace)
        except BaseException:
            parts.close()
            raise

    # ------------------------------------------------------------------ remote tier

    def _open_remote(self, config: RemoteConfig, namespace: Namespace | None) -> None:
        """Remote tier: objects are named by namespace, so one is needed.  Checks the
        credentials now (kvstore/tiers/remote/tier.py ``check_access``)."""
        from kvstore.tiers.remote.adapter import RemoteAdapter
        from kvstore.tiers.remote.tier import RemoteTier

        if namespace is None:
            raise ValueError("open(remote=...) needs namespace=...: remote objects are "
                             "stored per namespace (<prefix>/v1/<namespace digest>/<key>)")
        paths = self._paths
        tier = RemoteTier(config, namespace.digest, paths.host.read_slot)
        tier.check_access()
        adapter = RemoteAdapter(tier, paths.host)
        paths.tiers.attach_remote(adapter)
        self.remote, self._remote = tier, adapter

    async def attach_remote(self, config: RemoteConfig, namespace: Namespace) -> None:
        """Put the shared remote tier behind this open store, for a caller that learns
        its namespace only after opening (the vLLM connector: from the KV tensors vLLM
        registers).  Same checks as ``open(remote=...)``; needs a store from
        :func:`open` (its background task group runs the uploads)."""
        self._ops.check_open()
        if self.remote is not None:
            raise ValueError(f"store {self.path} already has a remote tier")
        if self._background is None:
            raise ValueError("attach_remote needs a store opened with kvstore.open()")
        # check_access sends a request (blocking): off the event loop
        await anyio.to_thread.run_sync(self._open_remote, config, namespace)
        assert self.remote is not None
        await self._background.start(self.remote.run)

    # ------------------------------------------------------------------ open, close

    async def _start(self) -> None:
        # anyio primitives are made here, on the event loop, not in the opening thread.
        self._parts.allocator.start()
        await self._parts.engine.start()

    def _start_checks(self) -> None:
        """Background verification, once the background task group runs: the scrub if
        asked for (``open(scrub_bytes_per_s=...)``), and re-reads of the quarantine
        records an earlier open left (the table's size only: no scan)."""
        if self.options.scrub_bytes_per_s:
            self._paths.scrubber.start_background(self.options.scrub_bytes_per_s)
        if self._parts.index.counts()["quarantine"]:
            self._paths.rechecks.schedule()

    async def aclose(self) -> None:
        """Close the store: new calls raise ``StoreClosedError``; calls in flight (puts,
        gets, their quarantines, deletes) are waited for, then the engine, the index
        writer and the files are closed.  Idempotent; not cancellable midway."""
        if self._ops.closed:
            return
        self._ops.closed = True
        parts, paths = self._parts, self._paths
        if paths.memory_tier is not None:  # background reads: stopped, not waited out
            paths.memory_tier.cancel_prefetches()
        paths.scrubber.cancel()  # scrubs persist their cursor and return
        paths.rechecks.cancel()
        parts.events.close()  # subscriptions end once their consumers read what they hold
        with anyio.CancelScope(shield=True):
            await self._ops.drain()
            if self.remote is not None:  # remote tier: queued uploads, then its workers
                await self.remote.aclose()
            touched, ripe = parts.allocator.take_touched(), parts.allocator.epochs.take_ripe()
            if (touched or ripe) and not self.read_only:
                with suppress(KVStoreError):
                    await parts.writer.run(parts.last_writes(touched, ripe))
            await parts.engine.aclose()
            await anyio.to_thread.run_sync(parts.close)

    # ------------------------------------------------------------------ guards

    @contextmanager
    def _operation(self, *, write: bool = False) -> Iterator[None]:
        """One public call: refused once the store is closed, waited for by ``aclose``."""
        self._ops.check_open()
        if write:
            self._health.check_writable()
        with self._ops.track():
            yield

    def _foreground(self) -> AbstractContextManager[None]:
        """A get: the I/O scheduler holds background writes back for all of it."""
        scheduler = self._parts.scheduler
        return scheduler.foreground() if scheduler is not None else nullcontext()

    @property
    def read_only(self) -> bool:
        return self._health.read_only

    @property
    def used_bytes(self) -> int:
        """Bytes of slots indexed, quarantined, reserved by puts in flight, or freed but
        still waiting for earlier readers: what ``capacity_bytes`` bounds."""
        return self._parts.allocator.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._parts.allocator.capacity_bytes

    # ------------------------------------------------------------------ puts, gets

    async def put_many(self, keys: Sequence[bytes], values: Sequence[torch.Tensor], *,
                       parents: Sequence[bytes | None] | None = None,
                       codec: CodecSpec | None = None, background: bool = False,
                       tags: Sequence[bytes | None] | None = None) -> PutResult:
        """Store blocks durably; returns once they survive a crash (if ``sync=True``).

        ``parents[i]`` is the key of the block before ``keys[i]`` in its chain (or None):
        eviction uses it to keep chains free of holes, and fsck to rebuild them.
        ``tags[i]``: the caller's opaque bytes (at most 4096) that ``snapshot()`` and the
        events give back.  Stored keys (or being stored) are not written again, nor their
        tags.  ``codec`` overrides ``open(codec=...)`` for this batch; each block records
        the codec it was written with, so reads need no option.

        Backpressure: ``background=True`` says this save may be dropped.  When the puts
        in flight already hold ``backlog_bytes`` (``open()``), or a foreground put is
        waiting for room, such a put is dropped whole at once (``PutResult.dropped``,
        ``stats().dropped_puts``), never partly applied; a foreground put waits instead
        until the backlog is below the bound, in arrival order (a waiting put waits only
        for the puts admitted before it).  Blocks already stored need no room: they are
        reported as deduplicated, never dropped or waited for.
        """
        with self._operation(write=True), self.latency.time("put"):
            return await self._paths.puts.put_many(keys, values, parents, codec, background,
                                                   tags=tags)

    async def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor | None] | None = None
                       ) -> list[torch.Tensor | None]:
        """Read blocks; ``None`` for a key that is not stored or failed verification.

        With ``out``, block ``i`` is written into ``out[i]`` (same dtype and number of
        elements; any shape, contiguous or not, on any device) and that tensor is
        returned; ``out[i] = None`` allocates as usual.  New tensors of 256 KiB and more
        are in recycled memory (:mod:`kvstore.codecs.result_buffers`): ordinary writable CPU
        tensors whose storage cannot grow (``resize_`` past their size raises).
        """
        with self._operation(), self.latency.time("get"):
            keys = check_keys(keys)
            if self._paths.memory_tier is not None:  # only the prefetch reads of these keys
                await self._paths.memory_tier.landed(keys)
            with self._foreground():
                return await self._paths.gets.get_many(keys, out)

    def prefetch(self, keys: Sequence[bytes]) -> Prefetch:
        """Start bringing blocks into the memory tier and return at once; see
        :mod:`kvstore.tiers.memory.prefetch`.  Bounded: prefetched blocks not yet read by a get never
        take more than ``prefetch_share`` of ``memory_bytes``, and a prefetch never evicts
        a pinned block or one being read.  Needs ``open(memory_bytes=...)``."""
        self._ops.check_open()
        memory = self._paths.memory_tier
        if memory is None or self._background is None:
            raise ValueError("prefetch needs the memory tier: open the store with "
                             "memory_bytes=N (bytes of host RAM for cached blocks)")
        return memory.prefetch(list(dict.fromkeys(check_keys(keys))))

    # ------------------------------------------------------------------ queries, delete

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._operation():
            keys = check_keys(keys)
            present = self._parts.index.present(keys)
            return [k in present for k in keys]

    async def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are all stored (the usable cached prefix)."""
        with self._operation():
            keys = check_keys(keys)
            n = self._parts.index.prefix_length(keys)
            if self._remote is not None and n < len(keys):  # remote tier: the rest
                n += await self._remote.extend_prefix(keys[n:])
            return n

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete blocks (durably); returns how many were stored.

        A put of any of these keys that started before this call (a caller's, even one
        still waiting for backlog room or capacity, or the remote tier promoting a
        fetched block in the background) lands first, and one that starts after it
        lands after it: a delete that returned is never undone by a put that started
        before it (``kvstore/core/key_order.py``)."""
        with self._operation(write=True):
            keys = check_keys(keys)
            parts, paths = self._parts, self._paths
            self._deletes.deleting(keys)  # promotions fetching: skip these keys
            async with paths.puts.turn(keys):  # after the puts that started before it
                freed = await parts.writer.run(lambda txn: parts.index.delete_blocks(txn, keys))
                paths.tiers.forget(keys)
                parts.allocator.release(freed)
                parts.counters["deletes"] += len(freed)
                return len(freed)

    async def pin(self, keys: Sequence[bytes]) -> None:
        """Never evict these blocks (e.g. a system prompt's chain) until ``unpin``.  Pins
        count: pinning twice needs two unpins.  Keys need not be stored yet."""
        with self._operation(write=True):
            keys = check_keys(keys)
            await self._parts.writer.run(lambda txn: self._parts.index.pin(txn, keys, +1))

    async def unpin(self, keys: Sequence[bytes]) -> None:
        with self._operation(write=True):
            keys = check_keys(keys)
            await self._parts.writer.run(lambda txn: self._parts.index.pin(txn, keys, -1))

    # ------------------------------------------------------------------ single-block sugar

    async def put(self, key: bytes, value: torch.Tensor, *, parent: bytes | None = None,
                  tag: bytes | None = None) -> bool:
        """Store one block; True if it was written, False if it was already stored."""
        return (await self.put_many([key], [value], parents=[parent], tags=[tag])).written > 0

    async def get(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return (await self.get_many([key], None if out is None else [out]))[0]

    async def contains(self, key: bytes) -> bool:
        return (await self.contains_many([key]))[0]

    async def delete(self, key: bytes) -> bool:
        return await self.delete_many([key]) == 1

    async def scrub(self, *, rate_bytes_per_s: float | None = DEFAULT_SCRUB_BYTES_PER_S,
                    progress: ProgressFn | None = None, restart: bool = False) -> ScrubReport:
        """Verify every stored block (header and payload CRC32C, nothing decoded) beside
        live traffic, and every quarantined one again; see :mod:`kvstore.core.scrub`.

        Runs one pass, or the rest of the pass an earlier scrub (in this or an earlier
        open, or the background scrub) stopped in (``restart=True``: from the first
        key).  At most ``rate_bytes_per_s`` of reads (None: no bound), and gets go
        first.  A block that fails is quarantined (a miss from then on); a quarantined
        one that verifies is put back.  ``progress(done, total)`` is called after each
        batch, in blocks.  Cancelling it, or closing the store, stops it with its place
        saved (the report says ``complete=False``)."""
        if rate_bytes_per_s is not None and not rate_bytes_per_s > 0:
            raise ValueError(f"rate_bytes_per_s must be > 0 (None: no bound), "
                             f"got {rate_bytes_per_s!r}")
        with self._operation():
            return await self._paths.scrubber.run(rate_bytes_per_s, progress, restart)

    def stats(self) -> StoreStats:
        """A snapshot of the store's state and counters (:class:`kvstore.stats.StoreStats`)."""
        self._ops.check_open()
        parts, alloc, index, engine = self._parts, self._parts.allocator, self._parts.index, \
            self._parts.engine
        extents = index.extents_list()
        disk = sum(extents.values())
        counts = index.counts()
        remote = {"remote": self.remote.stats().as_dict()} if self.remote is not None else {}
        extra: dict[str, Any] = {**parts.counters, **ratios(parts.counters),
                                 **self._paths.tiers.stats_fields(), **io_fields(parts.scheduler),
                                 **scrub_fields(self._paths.scrubber.progress,
                                                scrub_state(index)[1]),
                                 **remote}
        return StoreStats(
            path=self.path, engine=engine.name, o_direct=engine.direct,
            engine_reason=parts.engine_reason, durable=self.durable, read_only=self.read_only,
            read_only_reason=self._health.read_only_reason, blocks=counts["blocks"],
            quarantined=counts["quarantine"], extents=len(extents),
            extent_bytes=parts.extent_bytes, disk_bytes=disk, free_bytes=(free := alloc.free_bytes),
            stored_bytes=disk - free - PAGE * len(extents),
            capacity_bytes=alloc.capacity_bytes, used_bytes=alloc.used_bytes,
            peak_used_bytes=alloc.peak_used_bytes, pinned_blocks=counts["pins"],
            commits=parts.writer.commits, cuda=parts.arena_lock.status,
            owner_id=parts.owner.id, owners_recovered=parts.owner.recovered,
            map_adoptions=index.map_adoptions,
            namespaces=list(index.namespaces().values()),
            totals=parts.totals.current(index), backlog_bytes=self._paths.puts.backlog.nbytes,
            events_published=parts.events.published, events_dropped=parts.events.dropped,
            event_subscribers=parts.events.subscribers,
            **extra)


@dataclass
class _Paths:
    """The call paths of one open store, over its parts (:class:`StoreParts`)."""

    reads: VerifiedReads
    rechecks: Rechecks
    scrubber: Scrubber
    tiers: Tiers  # the tiers attached (kvstore.core.tier_ports)
    memory_tier: MemoryTier | None
    puts: PutPath
    gets: GetPath
    host: TierHost  # what the tiers may ask of the store


def _open_paths(parts: StoreParts, opts: StoreOptions, ops: Operations, deletes: DeleteWatches,
                latency: Latency, task_group: Callable[[], TaskGroup | None],
                page_locker: PageLocker) -> _Paths:
    """Each path gets the parts it uses (``task_group``: the store's background work)."""
    index, writer, health, counters = parts.index, parts.writer, parts.health, parts.counters
    tiers = parts.tiers
    reads = VerifiedReads(
        path=parts.path, index=index, writer=writer, allocator=parts.allocator,
        transfers=parts.transfers, health=health, counters=counters, memory=tiers,
        marks=parts.owner.marks)
    # Quarantine is a suspicion: unreadable blocks are read again later
    # (kvstore/core/rechecks.py), every stored slot by the scrub (kvstore/core/scrub.py).
    rechecks = Rechecks(index=index, reads=reads, ops=ops, health=health, task_group=task_group)
    reads.on_unreadable = rechecks.schedule
    scrubber = Scrubber(path=parts.path, index=index, writer=writer, health=health,
                        scheduler=parts.scheduler, counters=counters, reads=reads, ops=ops,
                        task_group=task_group)
    limits = SlotLimits(extent_bytes=parts.extent_bytes, arena_bytes=parts.arena.size)
    puts = PutPath(
        index=index, writer=writer, allocator=parts.allocator, transfers=parts.transfers,
        syncs=parts.syncs, files=parts.files, health=health, counters=counters, limits=limits,
        ride_along=parts.flush_totals_in, seqs=parts.owner.seqs, codec=opts.codec,
        durable=opts.sync, backlog_bytes=opts.backlog_bytes, tiers=tiers)
    gets = GetPath(index=index, allocator=parts.allocator, limits=limits, counters=counters,
                   reads=reads, tiers=tiers, copier=parts.transfers.copier)
    host = TierHost(index=index, reads=reads, puts=puts, deletes=deletes, ops=ops,
                    health=health, task_group=task_group, counters=counters, latency=latency,
                    scheduler=parts.scheduler, tiers=tiers)
    memory = None
    if opts.memory_bytes:  # closed with the parts (StoreParts.tiers)
        memory = MemoryTier(host, opts.memory_bytes, opts.prefetch_share,
                            opts.page_lock_staging, page_locker)
        tiers.attach_memory(memory)
    return _Paths(reads, rechecks, scrubber, tiers, memory, puts, gets, host)


@asynccontextmanager
async def open(  # noqa: A001 - mirrors builtins.open / lmdb.open
    path: str | os.PathLike[str], options: StoreOptions | None = None, **fields: Any,
) -> AsyncIterator[Store]:
    """Open (creating if needed) the store at ``path``: ``async with open(p) as store``.

    Options are the fields of :class:`~kvstore.options.StoreOptions` (each documented
    there), given as keywords (``open(p, memory_bytes=1 << 30)``) or as one
    ``StoreOptions`` (``open(p, options)``; keywords beside it replace its fields).
    They are validated before anything is opened: a bad value raises ``ValueError`` or
    ``TypeError`` naming the option.
    """
    opts = StoreOptions.of(options, **fields)
    store = await anyio.to_thread.run_sync(Store, os.fspath(path), opts)
    # Prefetches and promotions run in this task group.  Entered and left by hand, not
    # with ``async with``: an exception from the caller's block then propagates as
    # itself, not wrapped in an ExceptionGroup (background tasks never raise: they hand
    # errors to their handles).
    background = anyio.create_task_group()
    await background.__aenter__()
    try:
        store._background = background
        await store._start()
        store._start_checks()
        if (requests := store._parts.allocator.requests) is not None:  # other owners ask
            background.start_soon(requests.listen, lambda: store._ops.closed)
        if store.remote is not None:  # remote tier: its upload workers
            await background.start(store.remote.run)
        yield store
    finally:
        try:
            await store.aclose()  # cancels prefetches, waits for every other call
        finally:
            store._background = None
            background.cancel_scope.cancel()
            await background.__aexit__(None, None, None)
