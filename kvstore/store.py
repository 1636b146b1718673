"""The async block store: the public ``open()`` and ``Store``, a coordinator.

``Store`` validates a call, asks the allocator (``kvstore/allocator.py``: space, eviction,
growth, read epochs), stages and verifies slots (``kvstore/slots.py``), moves bytes with
the I/O engine (``kvstore/io/``) and commits through the index (``kvstore/index.py``,
whose methods are every transaction the store runs).

Commit order of a put (guarantee G1/G3, FORMAT.md "Commit protocol"):

1. reserve space in the allocator (nothing durable changes);
2. stage header + payload in the arena, CRC32C computed over the staged bytes;
3. write every slot (O_DIRECT), wait for all completions;
4. fdatasync every extent written;
5. one LMDB write transaction: index entries in, their ranges out of the durable free
   map, sequence counter up; commit (fsync);
6. acknowledge.

A crash before 5 leaves no index entry and the space still free in the index: the
written slots are orphans that fsck reclaims.  A failed write or fdatasync turns the
store read-only (G5): the kernel may have dropped the dirty pages, so no later
acknowledgement could be trusted.  A put cancelled at any await is likewise either
committed (5 had started: it is waited for) or absent.

Reads look entries up in a read transaction, read whole slots into the arena, and check
the slot header (key, sequence, lengths) and the payload CRC32C before a byte reaches
the caller; a mismatch is counted, quarantined and answered as a miss (G2).

Every public call runs as one tracked operation: ``aclose()`` refuses new ones
(``StoreClosedError``), waits for those in flight, then stops the engine and the writer.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import (
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
    nullcontext,
    suppress,
)
from typing import TYPE_CHECKING, Any

import anyio
import torch

from kvstore import codecs, permissions, pinning, result_buffers
from kvstore.allocator import Allocator
from kvstore.backlog import Backlog
from kvstore.codecs import CODEC_RAW, CodecSpec
from kvstore.deletes import DeleteWatch
from kvstore.errors import (
    BlockTooLargeError,
    IndexCorruptionError,
    KVStoreError,
    NamespaceMismatchError,
    ReadOnlyError,
    StoreClosedError,
    StoreIOError,
)
from kvstore.extents import extent_path
from kvstore.format import (
    PAGE,
    SLOT_HEADER_BYTES,
    IndexEntry,
    new_store_uuid,
    round_up,
    unpack_u64,
)
from kvstore.group_sync import GroupSync
from kvstore.index import (
    META_EXTENT_BYTES,
    META_SEQ,
    META_UUID,
    ChainCut,
    Index,
    IndexWriter,
    Txn,
    init_meta,
    record_namespace,
)
from kvstore.io.arena import Arena
from kvstore.io.probe import probe
from kvstore.io.protocol import IOEngine
from kvstore.io.scheduler import PREFETCH, IoScheduler, as_class
from kvstore.io.threads import ThreadPoolEngine
from kvstore.keys import Namespace, check_key, check_keys
from kvstore.latency import Latency
from kvstore.lock import LOCK_FILE, StoreLock
from kvstore.memory_tier import Cached, MemoryTier
from kvstore.options import StoreOptions
from kvstore.prefetch import Prefetch
from kvstore.remote.config import RemoteConfig
from kvstore.slots import PlanMismatch, PutItem
from kvstore.stats import COUNTERS, PutResult, StoreStats, io_fields, memory_fields, ratios
from kvstore.tensors import CODE_DTYPES, check_out, check_writable_out, host_bytes
from kvstore.totals import Totals
from kvstore.transfers import Transfers, offloaded

if TYPE_CHECKING:
    from kvstore.remote.tier import RemoteTier

__all__ = ["LOCK_FILE", "INDEX_DIR", "PutResult", "Store", "StoreStats", "open"]

INDEX_DIR = "index"

logger = logging.getLogger(__name__)

class _Operations:
    """Calls in flight, so that ``aclose()`` can wait for every one of them."""

    def __init__(self) -> None:
        self.running = 0
        self.draining = False  # aclose() is waiting for the calls in flight
        self._idle: anyio.Event | None = None

    @contextmanager
    def track(self) -> Iterator[None]:
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if not self.running and self._idle is not None:
                self._idle.set()

    async def drain(self) -> None:
        self.draining = True
        while self.running:
            self._idle = anyio.Event()
            await self._idle.wait()
        self.draining = False


class Store:
    """An open store.  Get one from :func:`open`; every method is a coroutine except
    ``stats()``.  Use a store from the event loop that opened it."""

    def __init__(self, path: str, options: StoreOptions) -> None:
        opts = self.options = options
        namespace, memory_bytes, file_mode = opts.namespace, opts.memory_bytes, opts.file_mode
        self.path = os.path.abspath(path)
        # remote tier (kvstore/remote/): made at the end of _open, started by open()
        self._remote_config = opts.remote
        self.remote: RemoteTier | None = None
        self._memory_bytes = memory_bytes
        self._prefetch_share = opts.prefetch_share
        self._io_schedule = opts.io_schedule()
        # puts in flight beyond opts.backlog_bytes drop background puts (kvstore/backlog.py)
        self._backlog = Backlog(opts.backlog_bytes)
        self._prefetching: dict[bytes, anyio.Event] = {}  # key -> set when its read landed
        self._prefetches: set[Prefetch] = set()
        self._delete_watches: set[DeleteWatch] = set()  # promotions fetching (remote tier)
        self._background: anyio.abc.TaskGroup | None = None  # open() runs prefetches here
        # what new paths get until the store's recorded mode is known (in the index)
        self.file_mode = permissions.FILE_MODE if file_mode is None else file_mode
        self._strict_permissions = opts.strict_permissions
        self._requested_mode = file_mode
        if opts.create:
            permissions.make_dirs(self.path, self.file_mode)
        elif not os.path.isdir(os.path.join(self.path, INDEX_DIR)):
            raise FileNotFoundError(f"no kvstore at {self.path} (open with create=True to make one)")
        self.namespace = namespace
        self.codec: CodecSpec | None = opts.codec  # the store's default codec
        self.durable = opts.sync
        self._capacity_option = opts.capacity_bytes
        self._pin_staging = opts.pin_staging
        self._lock = StoreLock(self.path)
        self._closed = False
        self._ops = _Operations()
        self.latency = Latency(("get", "put", "prefetch"))  # call durations (kvstore.metrics exports them)
        self._cleanups: list[Any] = [self._lock.release]
        try:
            self._open(namespace, opts.allow_new_namespace, opts.engine, opts.sync,
                       opts.extent_bytes, opts.staging_bytes, opts.queue_depth,
                       opts.index_map_bytes)
        except BaseException:
            self._run_cleanups()
            raise

    # ------------------------------------------------------------------ opening

    def _open(self, namespace: Namespace | None, allow_new_namespace: bool, engine: str | IOEngine,
              sync: bool, extent_bytes: int, staging_bytes: int, queue_depth: int,
              index_map_bytes: int) -> None:
        self.index = Index(os.path.join(self.path, INDEX_DIR), map_size=index_map_bytes, sync=sync,
                           file_mode=self.file_mode)
        self._cleanups.append(self.index.close)
        self.writer = IndexWriter(self.index)
        self._cleanups.append(self.writer.close)
        if self.index.meta_get(META_UUID) is None:
            extents_dir = os.path.join(self.path, "extents")
            if os.path.isdir(extents_dir) and os.listdir(extents_dir):
                raise IndexCorruptionError(
                    f"store {self.path} has extent files but no index; run `python -m kvstore "
                    f"fsck {self.path} --rebuild-index` to rebuild it (nothing was changed)")
            self.writer.run_sync(lambda txn: init_meta(
                txn, self.index, store_uuid=new_store_uuid(), extent_bytes=extent_bytes))
        self.index.check_format()
        self.file_mode = permissions.settle(
            self.path, self._requested_mode, permissions.recorded_mode(self.index.meta_get),
            lambda mode: self.writer.run_sync(
                lambda txn: permissions.record_mode(txn, self.index.meta, mode)),
            strict=self._strict_permissions)
        self.store_uuid = self.index.meta_get(META_UUID) or b""
        self.extent_bytes = unpack_u64(self.index.meta_get(META_EXTENT_BYTES) or b"")
        self._seq = unpack_u64(self.index.meta_get(META_SEQ) or b"")
        self._check_namespace(namespace, allow_new_namespace)

        self.engine: IOEngine
        if not isinstance(engine, str):  # an IOEngine instance: the crash tests' seam
            self.engine, self.engine_reason = engine, "given by the caller"
        else:
            result = probe(self.path, engine)
            self.engine_reason = result.reason
            if result.engine == "io_uring":
                from kvstore.io.uring import UringEngine
                self.engine = UringEngine(direct=result.direct, queue_depth=queue_depth)
            else:
                self.engine = ThreadPoolEngine(direct=result.direct, queue_depth=queue_depth)

        self._fds: dict[int, int] = {}
        self._cleanups.append(self._close_fds)
        extents = self.index.extents_list()
        # An extent file that is gone (deleted while the store was closed) loses its
        # blocks, not the store: they are answered as misses and quarantined as they are
        # read, its space is never handed out again, and fsck reports it (missing-extent)
        # and drops it with --repair.  Refusing to open stopped the engine instead.
        self.lost_extents: set[int] = set()
        for extent_id in extents:
            try:
                self._open_extent(extent_id)
            except FileNotFoundError:
                self.lost_extents.add(extent_id)
        if self.lost_extents:
            logger.warning(
                "kvstore %s: extent file(s) %s named by the index are missing; their "
                "blocks are lost (answered as misses, quarantined when read). Run "
                "`python -m kvstore fsck %s` to see what is lost, --repair to drop them.",
                self.path, ", ".join(extent_path(self.path, e) for e in sorted(self.lost_extents)),
                self.path)
        self.arena = Arena(staging_bytes)
        self._cleanups.append(self.arena.close)
        # All of it resident before the first transfer (this runs on open()'s worker
        # thread): pages faulted in while transfers run cost far more than the zeroing
        # itself, whether by the transfers or by a thread racing ahead of them (4 callers
        # putting a fresh store's first 256 MiB of 2 MiB blocks: 0.85-1.28 GB/s at
        # 1.5-0.7 core-s/GB, against 2.0 GB/s at 0.24 with the arena populated here, which
        # takes ~20 ms for 256 MiB of huge pages).
        self.arena.populate()
        # Pinned for DMA; unregistered by the cleanup below, which runs before the unmap.
        self._cuda = pinning.default_pinner()(self.arena, self._pin_staging)
        self._cleanups.append(self._cuda.close)
        self.memory: MemoryTier | None = None
        if self._memory_bytes:
            self.memory = MemoryTier(self._memory_bytes, self.index.pinned)
            self._cleanups.append(self.memory.close)
            # Zero its pages now, off the get path (the first fill of a fresh region ran
            # at page-zeroing speed): it is a cache, it fills anyway.
            self.memory.region.prefault_all()
            # pinned like the arena, so a GPU load from memory goes by DMA
            self._memory_pin = pinning.default_pinner()(self.memory.region, self._pin_staging)
            self._cleanups.append(self._memory_pin.close)
        # Reads a caller awaits go before background writes and prefetches.
        schedule = self._io_schedule
        self.scheduler = IoScheduler(self.engine, schedule) if schedule is not None else None
        self.transfers = Transfers(self.scheduler or self.engine, self.arena, self._fds)
        self.syncs = GroupSync(self.scheduler or self.engine)  # concurrent puts share fdatasyncs
        self._inflight: dict[bytes, anyio.Event] = {}
        self._read_only_reason: str | None = None
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._totals = Totals(self._counters)
        # Counts since the last write transaction are flushed at close, on the cleanup
        # thread, before the writer stops (cleanups run last-registered first).
        self._cleanups.append(self._flush_totals)
        self.allocator = Allocator(
            path=self.path, index=self.index, writer=self.writer, extent_bytes=self.extent_bytes,
            store_uuid=self.store_uuid, extents=extents, free_runs=self.index.free_runs(),
            lost_extents=self.lost_extents,
            capacity_bytes=self._capacity_option, file_mode=self.file_mode,
            counters=self._counters, on_new_extent=self._open_extent,
            on_evicted=self._forget_in_memory,
            ride_along=self._flush_totals_in)
        if self._remote_config is not None:
            self._open_remote(self._remote_config, namespace)

    def _open_remote(self, config: RemoteConfig, namespace: Namespace | None) -> None:
        """Remote tier: objects are named by namespace, so one is needed.  Checks the
        credentials now (kvstore/remote/tier.py ``check_access``)."""
        from kvstore.remote import local
        from kvstore.remote.tier import RemoteTier

        if namespace is None:
            raise ValueError("open(remote=...) needs namespace=...: remote objects are "
                             "stored per namespace (<prefix>/v1/<namespace digest>/<key>)")
        tier = RemoteTier(config, namespace.digest,
                          lambda key, buffer: local.read_slot(self, key, buffer))
        tier.check_access()
        self.remote = tier

    async def attach_remote(self, config: RemoteConfig, namespace: Namespace) -> None:
        """Put the shared remote tier behind this open store, for a caller that learns
        its namespace only after opening (the vLLM connector: from the KV tensors vLLM
        registers).  Same checks as ``open(remote=...)``; needs a store from
        :func:`open` (its background task group runs the uploads)."""
        self._check_open()
        if self.remote is not None:
            raise ValueError(f"store {self.path} already has a remote tier")
        if self._background is None:
            raise ValueError("attach_remote needs a store opened with kvstore.open()")
        # check_access sends a request (blocking): off the event loop
        await anyio.to_thread.run_sync(self._open_remote, config, namespace)
        assert self.remote is not None
        await self._background.start(self.remote.run)

    def _flush_totals(self) -> None:
        if self._totals.pending() and not self.read_only:
            self.writer.run_sync(self._flush_totals_in)

    def _flush_totals_in(self, txn: Txn) -> None:
        """Persisted totals (issue 11) ride along in every transaction that commits puts,
        evicts or records last use."""
        self._totals.flush(txn, self.index.meta)

    def _with_totals(self, job: Callable[[Txn], None]) -> Callable[[Txn], None]:
        def with_totals(txn: Txn) -> None:
            job(txn)
            self._flush_totals_in(txn)

        return with_totals

    def _open_extent(self, extent_id: int) -> None:
        self._fds[extent_id] = self.engine.open_file(extent_path(self.path, extent_id),
                                                     create=False)

    def _check_namespace(self, namespace: Namespace | None, allow_new: bool) -> None:
        if namespace is None:
            return
        known = self.index.namespaces()
        if namespace.digest in known:
            return
        if known and not allow_new:
            names = "; ".join(known.values())
            raise NamespaceMismatchError(
                f"store {self.path} holds blocks of another namespace ({names}); this open asks "
                f"for {namespace.canonical_json()}. Open another path, or pass "
                "allow_new_namespace=True to keep both in one store.")
        self.writer.run_sync(lambda txn: record_namespace(
            txn, self.index, namespace.digest, namespace.canonical_json()))

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            self.engine.close_file(fd)
        self._fds.clear()

    def _run_cleanups(self) -> None:
        while self._cleanups:
            fn = self._cleanups.pop()
            with suppress(Exception):
                fn()

    async def _start(self) -> None:
        # anyio primitives are made here, on the event loop, not in the opening thread.
        self.allocator.start()
        await self.engine.start()

    async def aclose(self) -> None:
        """Close the store: new calls raise ``StoreClosedError``; calls in flight (puts,
        gets, their quarantines, deletes) are waited for, then the engine, the index
        writer and the files are closed.  Idempotent; not cancellable midway."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._prefetches):  # background reads: stop, do not wait them out
            handle.cancel()
        with anyio.CancelScope(shield=True):
            await self._ops.drain()
            if self.remote is not None:  # remote tier: queued uploads, then its workers
                await self.remote.aclose()
            touched = self.allocator.take_touched()
            if touched and not self.read_only:
                with suppress(KVStoreError):
                    await self.writer.run(self._with_totals(
                        lambda txn: self.index.apply_touched(txn, touched)))
            await self.engine.aclose()
            await anyio.to_thread.run_sync(self._run_cleanups)

    # ------------------------------------------------------------------ guards

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._read_only_reason is not None:
            raise ReadOnlyError(
                f"store {self.path} stopped accepting writes: {self._read_only_reason}. "
                "Reads still work; fix the device, run `python -m kvstore fsck`, and reopen.")

    @contextmanager
    def _operation(self, *, write: bool = False) -> Iterator[None]:
        """One public call: refused once the store is closed, waited for by ``aclose``."""
        if write:
            self._check_writable()
        else:
            self._check_open()
        with self._ops.track():
            yield

    def _foreground(self) -> AbstractContextManager[None]:
        """A get: the I/O scheduler holds background writes back for all of it."""
        return self.scheduler.foreground() if self.scheduler is not None else nullcontext()

    def _prefetch_awaited(self) -> AbstractContextManager[None]:
        """A get waiting for a prefetch: the scheduler lets prefetch reads go meanwhile."""
        return (self.scheduler.prefetch_awaited() if self.scheduler is not None
                else nullcontext())

    def _check_still_writable(self) -> None:
        """A put about to commit: refused if the store failed closed meanwhile."""
        if self._read_only_reason is not None:
            raise ReadOnlyError(
                f"store {self.path} stopped accepting writes while this put was in "
                f"flight: {self._read_only_reason}. The put is not stored.")

    def _fail_closed(self, why: str) -> None:
        if self._read_only_reason is None:
            self._read_only_reason = why

    @property
    def read_only(self) -> bool:
        return self._read_only_reason is not None

    # ------------------------------------------------------------------ space

    @property
    def used_bytes(self) -> int:
        """Bytes of slots indexed, quarantined, reserved by puts in flight, or freed but
        still waiting for earlier readers: what ``capacity_bytes`` bounds."""
        return self.allocator.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    def _check_fits(self, slot_len: int) -> None:
        if slot_len > self.extent_bytes - PAGE:
            raise BlockTooLargeError(
                f"a {slot_len}-byte slot does not fit a {self.extent_bytes}-byte extent; "
                "create the store with a larger extent_bytes")
        if slot_len > self.arena.size:
            raise BlockTooLargeError(
                f"a {slot_len}-byte slot does not fit the {self.arena.size}-byte staging "
                "arena; open the store with a larger staging_bytes")

    # ------------------------------------------------------------------ put

    async def put_many(self, keys: Sequence[bytes], values: Sequence[torch.Tensor], *,
                       parents: Sequence[bytes | None] | None = None,
                       codec: CodecSpec | None = None, background: bool = False) -> PutResult:
        """Store blocks durably; returns once they survive a crash (if ``sync=True``).

        ``parents[i]`` is the key of the block before ``keys[i]`` in its chain (or None):
        eviction uses it to keep chains free of holes, and fsck to rebuild them.  Keys
        that are already stored (or being stored by another task) are not written again.
        ``codec`` overrides the store's default codec (``open(codec=...)``) for this batch;
        each block records the codec it was written with, so reads need no option.

        Backpressure: ``background=True`` says this save may be dropped.  When the puts
        in flight already hold ``backlog_bytes`` (``open()``), or a foreground put is
        waiting for room, such a put is dropped whole at once (``PutResult.dropped``,
        ``stats().dropped_puts``), never partly applied; a foreground put waits instead
        until the backlog is below the bound, in arrival order (a waiting put waits only
        for the puts admitted before it).  Blocks already stored need no room: they are
        reported as deduplicated, never dropped or waited for.
        """
        with self._operation(write=True), self.latency.time("put"):
            return await self._put_many(keys, values, parents, codec, background)

    async def _put_many(self, keys: Sequence[bytes], values: Sequence[torch.Tensor],
                        parents: Sequence[bytes | None] | None,
                        codec: CodecSpec | None, background: bool = False,
                        skip_deleted: DeleteWatch | None = None) -> PutResult:
        """``put_many``; ``skip_deleted`` (a promotion's): keys deleted since the watch
        began are not stored (reported as ``dropped``)."""
        keys = check_keys(keys)
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if parents is None:
            parent_list: list[bytes | None] = [None] * len(keys)
        else:
            parent_list = [None if p is None else check_key(p) for p in parents]
            if len(parent_list) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(parent_list)} parents")
        staged = [host_bytes(v) for v in values]  # every value validated before any I/O
        for data, _ in staged:
            self._check_fits(round_up(SLOT_HEADER_BYTES + data.numel()))
        # Blocks already stored are deduplicated, never dropped nor waited for: only the
        # rest count against the backlog (_put_once decides again, without yielding).
        present = self.index.present(keys)
        dedup = [k in present for k in keys]
        nbytes = sum(d.numel() for (d, _), p in zip(staged, dedup) if not p)
        if not nbytes:
            pass  # nothing to write: no room needed
        elif background and not self._backlog.try_enter(nbytes):
            self._count_dedup(sum(dedup), sum(d.numel() for (d, _), p in zip(staged, dedup) if p))
            self._counters["dropped_puts"] += 1
            self._counters["dropped_blocks"] += len(keys) - sum(dedup)
            return PutResult(0, sum(dedup), 0, dropped=len(keys) - sum(dedup))
        elif not background:
            await self._backlog.enter(nbytes, self._check_writable)
        self._counters["puts"] += 1
        spec = codec if codec is not None else self.codec
        try:
            while True:
                try:
                    return await self._put_once(keys, parent_list, staged, values, spec,
                                                skip_deleted)
                except ChainCut:
                    # An eviction chose blocks this put deduplicated against before the
                    # put protected them, and committed after the put's decision: decide
                    # again (now they are absent, so this put writes them).  Rare; bounded
                    # by the evictions that were in flight when the put decided.
                    self._counters["put_retries"] += 1
        finally:
            self._backlog.leave(nbytes)

    async def _put_once(self, keys: Sequence[bytes], parent_list: Sequence[bytes | None],
                        staged: Sequence[tuple[torch.Tensor, int]],
                        values: Sequence[torch.Tensor], spec: CodecSpec | None,
                        skip_deleted: DeleteWatch | None = None) -> PutResult:
        # Wait out other tasks' puts of the same keys, then decide without yielding.
        await self._wait_for_puts_of(keys)
        present = self.index.present(keys)
        items: list[PutItem] = []
        deduplicated: dict[bytes, None] = {}
        dedup_bytes = 0
        # A promotion's keys deleted since its fetch began: not stored (from here on, a
        # delete waits for this put instead: its keys are in ``_inflight``).
        skipped = set() if skip_deleted is None else skip_deleted.deleted & set(keys)
        for key, parent, (data, code), value in zip(keys, parent_list, staged, values):
            if key in skipped:
                continue
            if key in present or key in self._inflight:
                dedup_bytes += data.numel()
                if key in present:
                    deduplicated[key] = None
                continue
            items.append(PutItem(key, parent, data, code, tuple(value.shape)))
            self._inflight[key] = anyio.Event()
        # (a key twice in the batch and skipped counts once per occurrence)
        n_skipped = sum(k in skipped for k in keys)
        if not items:
            self._count_dedup(len(keys) - n_skipped, dedup_bytes)
            return PutResult(0, len(keys) - n_skipped, 0, dropped=n_skipped)
        # Their parents and what they were deduplicated against stay until they are stored.
        guarded = [*(i.key for i in items), *(i.parent for i in items if i.parent is not None),
                   *deduplicated]
        self.allocator.protect(guarded)
        try:
            if spec is not None and codecs.codec_id(spec) != CODEC_RAW:
                # FP8 slots are sized from the shapes and each chunk is encoded as it is
                # staged, overlapped with the writes of the chunks before it; encoded
                # up front (over the cores, then placed) where the sizes depend on the
                # values (zstd), or when a block's values made FP8 fall back to raw.
                if not all([item.plan(spec) for item in items]):
                    await self._encode(items, spec)
                try:
                    await self._put_items(items, list(deduplicated))
                except PlanMismatch:
                    self._counters["put_replans"] += 1
                    await self._encode(items, spec)
                    await self._put_items(items, list(deduplicated))
            else:
                await self._put_items(items, list(deduplicated))
        finally:
            for item in items:
                self._inflight.pop(item.key).set()
            self.allocator.unprotect(guarded)  # its blocks are evictable now
        written = sum(item.payload_len for item in items)
        self._count_dedup(len(keys) - len(items) - n_skipped, dedup_bytes)
        self._counters["put_blocks"] += len(items)
        self._counters["put_bytes"] += sum(item.raw_len for item in items)
        self._counters["put_payload_bytes"] += written
        return PutResult(len(items), len(keys) - len(items) - n_skipped, written,
                         dropped=n_skipped)

    async def _encode(self, items: list[PutItem], spec: CodecSpec) -> None:
        """Encode every block now (sizes known only then), checking each slot fits."""
        await self.transfers.encode(items, spec)
        for item in items:
            self._check_fits(item.slot_len)

    async def _wait_for_puts_of(self, keys: Sequence[bytes]) -> None:
        """Until no put of any of ``keys`` is in flight (each waited for in turn)."""
        while (busy := next((self._inflight[k] for k in keys if k in self._inflight),
                            None)) is not None:
            await busy.wait()
            self._check_writable()

    def _count_dedup(self, blocks: int, raw_bytes: int) -> None:
        self._counters["dedup_blocks"] += blocks
        self._counters["dedup_bytes"] += raw_bytes

    async def _put_items(self, items: list[PutItem], relies_on: list[bytes]) -> None:
        await self.allocator.reserve(items)
        committed = False
        try:
            for item in items:
                self._seq += 1
                item.seq = self._seq
            await self.transfers.write(items)
            if self.durable:
                await self.syncs.datasync(sorted({self._fds[i.extent] for i in items}))
            now = time.time_ns() // 1000
            entries = [(item.key, IndexEntry(
                extent=item.extent, offset=item.offset, slot_len=item.slot_len,
                payload_len=item.payload_len, raw_len=item.raw_len, codec=item.codec,
                dtype=item.dtype, payload_crc=item.crc, seq=item.seq, last_use=now,
                parent=item.parent)) for item in items]
            # G5: nothing is acknowledged once a write or a sync failed, even a put whose
            # own sync succeeded later (the kernel may have dropped pages the failed
            # sync covered); checked again on the writer thread, just before the commit.
            self._check_still_writable()
            seq, touched = self._seq, self.allocator.take_touched()

            def commit(txn: Txn) -> None:
                self._check_still_writable()
                self.index.commit_puts(txn, entries, touched, seq, relies_on)

            await self.writer.run(self._with_totals(commit))
            committed = True
            self.allocator.committed(items)
            if self.remote is not None:  # remote tier: uploaded in the background
                self.remote.enqueue([item.key for item in items])
            if self.memory is not None:  # write-through: only what is durable
                await self._fill_memory([
                    (item.key, item.parent, item.data, CODE_DTYPES[item.dtype], item.shape,
                     item.seq) for item in items if codecs.is_lossless(item.codec)])
        except StoreIOError as e:
            self._fail_closed(f"I/O error while writing: {e}")
            raise
        finally:
            if not committed:
                self.allocator.unreserve(items)

    # ------------------------------------------------------------------ get

    async def get_many(self, keys: Sequence[bytes], out: Sequence[torch.Tensor | None] | None = None
                       ) -> list[torch.Tensor | None]:
        """Read blocks; ``None`` for a key that is not stored or failed verification.

        With ``out``, block ``i`` is written into ``out[i]`` (same dtype and number of
        elements; any shape, contiguous or not, on any device) and that tensor is
        returned; ``out[i] = None`` allocates as usual.  New tensors of 256 KiB and more
        are in recycled memory (:mod:`kvstore.result_buffers`): ordinary writable CPU
        tensors whose storage cannot grow (``resize_`` past their size raises).
        """
        with self._operation(), self.latency.time("get"):
            keys = check_keys(keys)
            if self._prefetching and any(k in self._prefetching for k in keys):
                # only the reads of these keys, then they come from memory
                # (before foreground(): prefetch reads wait while it lasts).  Awaited, the
                # prefetch reads go even while other gets run: a stream of them would
                # otherwise hold this get back for as long as it lasted.
                with self._prefetch_awaited():
                    for key in keys:
                        landed = self._prefetching.get(key)
                        if landed is not None:
                            await landed.wait()
            with self._foreground():
                return await self._get_many(keys, out)

    async def _get_many(self, keys: list[bytes], out: Sequence[torch.Tensor | None] | None
                        ) -> list[torch.Tensor | None]:
        outs: list[torch.Tensor | None] = [None] * len(keys) if out is None else list(out)
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} out tensors")
        entries = self.index.get_entries(keys)
        held = None
        if self.remote is not None:  # remote tier: what it holds of the misses, now
            from kvstore.remote.local import held_blocks
            held = held_blocks(self, keys, entries)
        for entry, o in zip(entries, outs):  # validate before any I/O
            if isinstance(o, torch.Tensor):  # (a local miss may be fetched: checked too)
                check_writable_out(o)
            if entry is not None:
                self._check_fits(entry.slot_len)
            if entry is not None and o is not None:
                check_out(o, entry.dtype, (entry.raw_len // CODE_DTYPES[entry.dtype].itemsize,))
        self._counters["gets"] += 1
        results: list[torch.Tensor | None] = [None] * len(keys)
        corrupt: list[tuple[bytes, IndexEntry, str]] = []
        unreadable: list[tuple[bytes, IndexEntry, str]] = []
        from_disk = entries
        in_memory: list[tuple[int, Cached]] = []
        if self.memory is not None:
            # Served from memory only if the index (read above, no await since) still
            # names the same block: a deleted, evicted or re-put key is never answered.
            from_disk = list(entries)
            for i, (key, entry) in enumerate(zip(keys, entries)):
                if entry is not None and (cached := self.memory.lookup(key, entry.seq)):
                    in_memory.append((i, cached))
                    from_disk[i] = None
            self._counters["memory_misses"] += sum(e is not None for e in from_disk)
        # No await between the lookup above and this: a block deleted or evicted after it
        # keeps its space until this read's epoch ends.
        epoch = self.allocator.begin_read()
        try:
            if in_memory:
                await self._copy_from_memory(in_memory, outs, results)
            errors, nbytes = await self.transfers.read(keys, from_disk, outs, results, corrupt,
                                                       unreadable)
            self._counters["read_errors"] += errors
            self._counters["read_bytes"] += nbytes
        finally:
            self.allocator.end_read(epoch)
        if corrupt or unreadable:
            await self._quarantine(corrupt, unreadable)
        if self.remote is not None:  # remote tier: local misses, fetched and promoted
            from kvstore.remote.local import fill_misses
            assert held is not None
            await fill_misses(self, keys, outs, results, held)
        if self.memory is not None:
            # Only blocks read into new tensors: they carry the stored shape (an ``out``
            # tensor has the caller's) and live on the CPU.
            await self._fill_memory([
                (keys[i], e.parent, r.reshape(-1).view(torch.uint8), r.dtype,
                 tuple(r.shape), e.seq)
                for i, (e, r) in enumerate(zip(from_disk, results))
                if e is not None and r is not None and outs[i] is None])
        self.allocator.touch((k for k, r in zip(keys, results) if r is not None),
                             time.time_ns() // 1000)
        hits = sum(r is not None for r in results)
        self._counters["hits"] += hits
        self._counters["misses"] += len(keys) - hits
        return results

    async def _quarantine(self, corrupt: Sequence[tuple[bytes, IndexEntry, str]],
                          unreadable: Sequence[tuple[bytes, IndexEntry, str]] = ()) -> None:
        """Move blocks that failed verification (``corrupt``) or could not be read at all
        (``unreadable``: I/O error, short read, missing extent) out of the index, in the
        same pass that found them, so that no lookup promises them again (a lookup that
        promised what a load cannot deliver made vLLM retry the load for ever).  Their
        space stays allocated for fsck, which reports them.  One warning per pass names
        the store and the first cause."""
        bad = [*corrupt, *unreadable]
        self._counters["corrupt_blocks"] += len(corrupt)
        self._counters["quarantined_blocks"] += len(bad)
        self._forget_in_memory([key for key, _, _ in bad])
        logger.warning(
            "kvstore %s: %d block(s) failed verification and %d could not be read; "
            "quarantined (answered as misses from now on; `python -m kvstore fsck %s` "
            "lists them). First: key %s: %s", self.path, len(corrupt), len(unreadable),
            self.path, bad[0][0].hex()[:32], bad[0][2])
        if self.read_only:
            return
        moved = list({key: entry for key, entry, _ in bad}.items())
        with suppress(KVStoreError):
            await self.writer.run(lambda txn: self.index.quarantine_blocks(txn, moved))

    # ------------------------------------------------------------------ memory tier

    def _forget_in_memory(self, keys: Sequence[bytes]) -> None:
        if self.memory is not None:
            self.memory.discard(keys)

    async def _copy_from_memory(self, hits: list[tuple[int, Cached]],
                                outs: list[torch.Tensor | None],
                                results: list[torch.Tensor | None]) -> None:
        """Copy memory hits out (into ``out`` tensors or new ones); a worker thread when
        large.  The copies are marked as read, so they are not evicted meanwhile."""
        memory = self.memory
        assert memory is not None

        def copy_all() -> None:
            for i, cached in hits:
                src, o = cached.view(), outs[i]
                if o is None:  # recycled memory, as every get's new tensors
                    results[i] = result_buffers.empty(tuple(src.shape), src.dtype).copy_(src)
                else:
                    results[i] = o.copy_(src.reshape(o.shape))

        for _, cached in hits:
            memory.begin_read(cached)
        try:
            await offloaded(sum(c.nbytes for _, c in hits), copy_all)
        finally:
            for _, cached in hits:
                memory.end_read(cached)
        self._counters["memory_hits"] += len(hits)
        self._counters["memory_read_bytes"] += sum(c.nbytes for _, c in hits)

    async def _fill_memory(self, blocks: list[tuple[bytes, bytes | None, torch.Tensor,
                                                    torch.dtype, tuple[int, ...], int]],
                           *, prefetched: bool = False, limit: int | None = None) -> int:
        """Cache verified (or just durable) blocks: room is taken on the event loop, the
        bytes copied on a worker thread when large, then published unless a delete or an
        eviction discarded the key meanwhile.  Returns how many were cached."""
        memory = self.memory
        if memory is None or not blocks:
            return 0
        fills = []
        for key, parent, data, dtype, shape, seq in blocks:
            got = memory.reserve(key, data.numel(), () if parent is None else (parent,),
                                 prefetch_limit=limit)
            if got is not None:
                fills.append((got, key, parent, data, dtype, shape, seq))

        def copy_all() -> None:
            for (_, run), _k, _p, data, *_ in fills:
                run.tensor[:data.numel()].copy_(data)

        try:
            await offloaded(sum(f[3].numel() for f in fills), copy_all)
        except BaseException:
            for (token, run), key, *_ in fills:
                memory.abandon(token, run, key)
            raise
        return sum(memory.publish(token, run, key=key, parent=parent, nbytes=data.numel(),
                                  dtype=dtype, shape=shape, seq=seq, prefetched=prefetched)
                   for (token, run), key, parent, data, dtype, shape, seq in fills)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, keys: Sequence[bytes]) -> Prefetch:
        """Start bringing blocks into the memory tier and return at once; see
        :mod:`kvstore.prefetch`.  Bounded: prefetched blocks not yet read by a get never
        take more than ``prefetch_share`` of ``memory_bytes``, and a prefetch never evicts
        a pinned block or one being read.  Needs ``open(memory_bytes=...)``."""
        self._check_open()
        if self.memory is None or self._background is None:
            raise ValueError("prefetch needs the memory tier: open the store with "
                             "memory_bytes=N (bytes of host RAM for cached blocks)")
        keys = list(dict.fromkeys(check_keys(keys)))
        want = [k for k in keys if k not in self.memory and k not in self._prefetching]
        handle = Prefetch(len(keys), awaited=self._prefetch_awaited)
        for key in want:
            self._prefetching[key] = anyio.Event()
        self._prefetches.add(handle)
        self._background.start_soon(self._run_prefetch, handle, want)
        return handle

    async def _run_prefetch(self, handle: Prefetch, keys: list[bytes]) -> None:
        memory = self.memory
        assert memory is not None
        try:
            with anyio.CancelScope() as scope, self._ops.track(), \
                    self.latency.time("prefetch"):
                handle._scope = scope
                if handle.cancelled:
                    scope.cancel()
                await anyio.lowlevel.checkpoint()
                if self.remote is not None:  # remote tier: absent blocks promoted first
                    from kvstore.remote.local import fetch_missing
                    await fetch_missing(self, keys)
                entries = self.index.get_entries(keys)
                handle.scheduled = sum(e is not None for e in entries)
                results: list[torch.Tensor | None] = [None] * len(keys)
                corrupt: list[tuple[bytes, IndexEntry, str]] = []
                unreadable: list[tuple[bytes, IndexEntry, str]] = []
                epoch = self.allocator.begin_read()
                try:
                    with as_class(PREFETCH):  # behind gets and (mostly) behind puts
                        errors, nbytes = await self.transfers.read(
                            keys, entries, [None] * len(keys), results, corrupt, unreadable)
                    self._counters["read_errors"] += errors
                    self._counters["prefetch_read_bytes"] += nbytes
                finally:
                    self.allocator.end_read(epoch)
                if corrupt or unreadable:
                    await self._quarantine(corrupt, unreadable)
                handle.arrived = await self._fill_memory(
                    [(k, e.parent, r.reshape(-1).view(torch.uint8), r.dtype, tuple(r.shape),
                      e.seq) for k, e, r in zip(keys, entries, results)
                     if e is not None and r is not None],
                    prefetched=True, limit=int(memory.capacity_bytes * self._prefetch_share))
                self._counters["prefetch_blocks"] += handle.arrived
        except Exception as e:  # noqa: BLE001 - handed to whoever awaits the handle
            handle.error = e
        finally:
            for key in keys:
                landed = self._prefetching.pop(key, None)
                if landed is not None:
                    landed.set()
            self._prefetches.discard(handle)
            handle._finish()

    # ------------------------------------------------------------------ queries, delete

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._operation():
            keys = check_keys(keys)
            present = self.index.present(keys)
            return [k in present for k in keys]

    async def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are all stored (the usable cached prefix)."""
        with self._operation():
            keys = check_keys(keys)
            n = self.index.prefix_length(keys)
            if self.remote is not None and n < len(keys):  # remote tier: the rest
                from kvstore.remote.local import extend_prefix
                n += await extend_prefix(self, keys[n:])
            return n

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete blocks (durably); returns how many were stored.

        A put of any of these keys that is in flight (a caller's, or the remote tier
        promoting a fetched block in the background) lands first: a delete that returned
        is never undone by a put that started before it."""
        with self._operation(write=True):
            keys = check_keys(keys)
            for watch in self._delete_watches:  # promotions fetching: skip these keys
                watch.deleted.update(k for k in keys if k in watch.keys)
            await self._wait_for_puts_of(keys)
            freed = await self.writer.run(lambda txn: self.index.delete_blocks(txn, keys))
            self._forget_in_memory(keys)
            self.allocator.release(freed)
            self._counters["deletes"] += len(freed)
            return len(freed)

    def _watch_deletes(self, keys: Sequence[bytes]) -> DeleteWatch:
        """Register keys about to be fetched for a promotion (remote tier); pass the
        watch to ``_put_many(skip_deleted=...)`` and end it with ``_unwatch_deletes``."""
        watch = DeleteWatch(keys)
        self._delete_watches.add(watch)
        return watch

    def _unwatch_deletes(self, watch: DeleteWatch) -> None:
        self._delete_watches.discard(watch)

    async def pin(self, keys: Sequence[bytes]) -> None:
        """Never evict these blocks (e.g. a system prompt's chain) until ``unpin``.  Pins
        count: pinning twice needs two unpins.  Keys need not be stored yet."""
        with self._operation(write=True):
            keys = check_keys(keys)
            await self.writer.run(lambda txn: self.index.pin(txn, keys, +1))

    async def unpin(self, keys: Sequence[bytes]) -> None:
        with self._operation(write=True):
            keys = check_keys(keys)
            await self.writer.run(lambda txn: self.index.pin(txn, keys, -1))

    # ------------------------------------------------------------------ single-block sugar

    async def put(self, key: bytes, value: torch.Tensor, *, parent: bytes | None = None) -> bool:
        """Store one block; True if it was written, False if it was already stored."""
        return (await self.put_many([key], [value], parents=[parent])).written == 1

    async def get(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return (await self.get_many([key], None if out is None else [out]))[0]

    async def contains(self, key: bytes) -> bool:
        return (await self.contains_many([key]))[0]

    async def delete(self, key: bytes) -> bool:
        return await self.delete_many([key]) == 1

    # ------------------------------------------------------------------ stats

    def stats(self) -> StoreStats:
        """A snapshot of the store's state and counters (:class:`kvstore.stats.StoreStats`)."""
        self._check_open()
        extents = self.index.extents_list()
        disk = sum(extents.values())
        counts = self.index.counts()
        alloc = self.allocator
        free = alloc.space.free_bytes
        remote = {"remote": self.remote.stats().as_dict()} if self.remote is not None else {}
        extra: dict[str, Any] = {**self._counters, **ratios(self._counters),
                                 **memory_fields(self.memory), **io_fields(self.scheduler),
                                 **remote}
        return StoreStats(
            path=self.path, engine=self.engine.name, o_direct=self.engine.direct,
            engine_reason=self.engine_reason, durable=self.durable, read_only=self.read_only,
            read_only_reason=self._read_only_reason, blocks=counts["blocks"],
            quarantined=counts["quarantine"], extents=len(extents),
            extent_bytes=self.extent_bytes, disk_bytes=disk,
            free_bytes=free, stored_bytes=disk - free - PAGE * len(extents),
            capacity_bytes=alloc.capacity_bytes, used_bytes=alloc.used_bytes,
            peak_used_bytes=alloc.peak_used_bytes, pinned_blocks=counts["pins"],
            commits=self.writer.commits, cuda=self._cuda.status,
            namespaces=list(self.index.namespaces().values()),
            totals=self._totals.current(self.index), backlog_bytes=self._backlog.nbytes, **extra)


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
    # Prefetches run in this task group.  Entered and left by hand, not with ``async
    # with``: an exception from the caller's block then propagates as itself, not
    # wrapped in an ExceptionGroup (prefetch tasks never raise: they hand errors to
    # their handles).
    background = anyio.create_task_group()
    await background.__aenter__()
    try:
        store._background = background
        await store._start()
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
