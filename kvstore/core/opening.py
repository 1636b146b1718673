"""Opening a store's parts, in order, and closing them in reverse: what ``Store``
coordinates once it is open.

:class:`StoreParts` takes the lock (shared unless ``exclusive``), opens (or initialises)
the index, settles the file mode and the namespace, registers the store as one of its
owners (:mod:`kvstore.core.owners`), picks the I/O engine, opens the extent files, maps and
page-locks the staging arena, holds the tiers the store attaches, builds the allocator,
the transfers and the shared fdatasync; a store that uses more than ``capacity_bytes``
evicts down to it before it serves.  Every file it opens is the store's own, never a
link (:mod:`kvstore.disk.store_files`).  Every step that acquires something registers
its release; a failure part-way releases what was acquired, last first.  Runs on a
worker thread (``open()`` calls it there): the LMDB open and the arena's page faults
take milliseconds the event loop should not wait for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from kvstore.core.allocator import Allocator
from kvstore.core.claim_requests import ClaimRequests
from kvstore.core.events import EventHub
from kvstore.core.extent_files import ExtentFiles
from kvstore.core.operations import Health
from kvstore.core.owners import register
from kvstore.core.tier_ports import Tiers
from kvstore.disk import permissions, store_files
from kvstore.disk.format import FORMAT_VERSION, new_store_uuid
from kvstore.disk.layout import EXTENT_DIR, INDEX_DIR, extent_path
from kvstore.disk.lock import StoreLock
from kvstore.disk.network_fs import network_fs
from kvstore.errors import (
    IndexCorruptionError,
    NamespaceMismatchError,
    StoreLockedError,
    from_os_error,
)
from kvstore.index import environments
from kvstore.index.index import Touched, Txn, init_meta, record_namespace
from kvstore.index.totals import Totals
from kvstore.io.arena import Arena
from kvstore.io.device_copies import DeviceCopier
from kvstore.io.group_sync import GroupSync
from kvstore.io.page_locking import PageLocker
from kvstore.io.probe import probe
from kvstore.io.protocol import IOEngine
from kvstore.io.scheduler import IoScheduler
from kvstore.io.threads import ThreadPoolEngine
from kvstore.io.transfers import Transfers
from kvstore.keys import Namespace
from kvstore.options import StoreOptions
from kvstore.stats import COUNTERS

__all__ = ["INDEX_DIR", "StoreParts"]

logger = logging.getLogger("kvstore.store")


def _lock(path: str, exclusive: bool) -> StoreLock:
    """``PATH/LOCK``, shared unless ``exclusive``, or on a network file system, where a
    store is never shared (kvstore/disk/network_fs.py)."""
    network = network_fs(path)
    if network is None:
        return StoreLock(path, exclusive=exclusive)
    if not exclusive:
        logger.warning("kvstore %s: on a network file system (%s), the store is opened in "
                       "this process alone (exclusive=True)", path, network)
    try:
        return StoreLock(path, exclusive=True)
    except StoreLockedError as e:
        raise StoreLockedError(
            11, f"{e.strerror}. The store is on a network file system ({network}), where kvstore "
            "opens it in one process at a time: LMDB's locks, the read marks and flock do "
            "not hold across hosts there. Keep a shared store on a local disk") from None


class StoreParts:
    """The open parts of one store (see the module docstring); ``close()`` releases
    them.  Attributes are the parts themselves (``Store`` keeps them private;
    :mod:`kvstore.testing` shows them to tests).  ``copier`` and ``page_locker``: the
    optional GPU path, handed in by the store (core/ never loads it)."""

    def __init__(self, path: str, opts: StoreOptions, copier: DeviceCopier,
                 page_locker: PageLocker) -> None:
        self.path = path
        self._copier, self._page_locker = copier, page_locker
        # what new paths get until the store's recorded mode is known (in the index)
        self.file_mode = permissions.FILE_MODE if opts.file_mode is None else opts.file_mode
        if opts.create:
            try:
                permissions.make_dirs(path, self.file_mode)
            except OSError as e:
                raise from_os_error(e, f"cannot create the store directory {path}") from e
        elif not os.path.isdir(os.path.join(path, INDEX_DIR)):
            raise FileNotFoundError(f"no kvstore at {path} (open with create=True to make one)")
        lock = _lock(path, opts.exclusive)
        self._cleanups: list[Callable[[], Any]] = [lock.release]
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.health = Health(path)
        try:
            self._open_index(opts)
            self._open_engine(opts)
            self._open_tiers()
            self._open_paths(opts)
        except BaseException:
            self.close()
            raise

    def _open_index(self, opts: StoreOptions) -> None:
        # Shared with the other Stores of this process on this path (one LMDB
        # environment per process: kvstore/index/environments.py), and so is the event
        # stream its writer feeds.
        self.index, self.writer, self.events = environments.acquire(
            os.path.join(self.path, INDEX_DIR), map_size=opts.index_map_bytes,
            sync=opts.sync, file_mode=self.file_mode, make_sink=EventHub)
        self._cleanups.append(lambda: environments.release(self.index))
        extents_dir = os.path.join(self.path, EXTENT_DIR)
        store_files.check_dir(extents_dir, f"Move the extents directory itself to {extents_dir}.")
        meta = self.index.meta_records
        if meta.store_uuid() is None:
            if os.path.isdir(extents_dir) and os.listdir(extents_dir):
                raise IndexCorruptionError(
                    f"store {self.path} has extent files but no index; run `python -m kvstore "
                    f"fsck {self.path} --rebuild-index` to rebuild it (nothing was changed)")
            self.writer.run_sync(lambda txn: init_meta(
                txn, self.index, store_uuid=new_store_uuid(), extent_bytes=opts.extent_bytes))
        # An older format is upgraded in place (kvstore/index/space_counters.py), under
        # LOCK held shared: an older build takes it exclusively, so none is in.
        if meta.check_format() != FORMAT_VERSION and \
                self.writer.run_sync(self.index.space.upgrade):
            logger.info("kvstore %s: upgraded to on-disk format %d", self.path, FORMAT_VERSION)
        # One of the store's owners (kvstore/core/owners.py) until it closes: registered
        # before anything else is written, so a refused open changes nothing.
        # (Its lock file gets the store's recorded mode: a group-shared store's other
        # users must be able to probe it.)
        self.owner = register(self.path, self.index, self.writer, sync=opts.sync,
                              file_mode=meta.file_mode() or self.file_mode)
        self._cleanups.append(self.owner.close)
        self.file_mode = permissions.settle(
            self.path, opts.file_mode, meta.file_mode(),
            lambda mode: self.writer.run_sync(lambda txn: meta.record_file_mode(txn, mode)),
            strict=opts.strict_permissions)
        self.store_uuid = meta.store_uuid() or b""
        self.extent_bytes = meta.extent_bytes()
        self._check_namespace(opts.namespace, opts.allow_new_namespace)
        self.totals = Totals(self.counters)
        # Counts since the last write transaction are flushed at close, on the cleanup
        # thread, before the writer stops (cleanups run last-registered first).
        self._cleanups.append(self.flush_totals)

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

    def _open_engine(self, opts: StoreOptions) -> None:
        engine = opts.engine
        self.engine: IOEngine
        if not isinstance(engine, str):  # an IOEngine instance: the crash tests' seam
            self.engine, self.engine_reason = engine, "given by the caller"
        else:
            result = probe(self.path, engine)
            self.engine_reason = result.reason
            if result.engine == "io_uring":
                from kvstore.io.uring import UringEngine
                self.engine = UringEngine(direct=result.direct, queue_depth=opts.queue_depth)
            else:
                self.engine = ThreadPoolEngine(direct=result.direct, queue_depth=opts.queue_depth)
        self.files = ExtentFiles(self.path, self.engine)
        self._cleanups.append(self.files.close)
        self.extents = self.index.extents_list()
        # An extent file that is gone (deleted while the store was closed) loses its
        # blocks, not the store: they are answered as misses and quarantined as they are
        # read, its space is never handed out again, and fsck reports it (missing-extent)
        # and drops it with --repair.  Refusing to open stopped the engine instead.
        self.lost_extents: set[int] = set()
        for extent_id in self.extents:
            try:
                self.files.open(extent_id)
            except FileNotFoundError:
                self.lost_extents.add(extent_id)
        if self.lost_extents:
            logger.warning(
                "kvstore %s: extent file(s) %s named by the index are missing; their "
                "blocks are lost (answered as misses, quarantined when read). Run "
                "`python -m kvstore fsck %s` to see what is lost, --repair to drop them.",
                self.path, ", ".join(extent_path(self.path, e) for e in sorted(self.lost_extents)),
                self.path)
        self.arena = Arena(opts.staging_bytes)
        self._cleanups.append(self.arena.close)
        # All of it resident before the first transfer (this runs on open()'s worker
        # thread): pages faulted in while transfers run cost far more than the zeroing
        # itself, whether by the transfers or by a thread racing ahead of them (4 callers
        # putting a fresh store's first 256 MiB of 2 MiB blocks: 0.85-1.28 GB/s at
        # 1.5-0.7 core-s/GB, against 2.0 GB/s at 0.24 with the arena populated here, which
        # takes ~20 ms for 256 MiB of huge pages).
        self.arena.populate()
        # Page-locked for DMA; unregistered by the cleanup below, which runs before the unmap.
        self.arena_lock = self._page_locker(self.arena, opts.page_lock_staging)
        self._cleanups.append(self.arena_lock.close)

    def _open_tiers(self) -> None:
        # The store attaches them (kvstore.core.tier_ports); a memory tier is closed
        # here, before the engine and the arena.
        self.tiers = Tiers()
        self._cleanups.append(self.tiers.close)

    def _open_paths(self, opts: StoreOptions) -> None:
        # Reads a caller awaits go before background writes and prefetches.
        schedule = opts.io_schedule()
        self.scheduler = IoScheduler(self.engine, schedule) if schedule is not None else None
        self.transfers = Transfers(self.scheduler or self.engine, self.arena, self.files.fds,
                                   copier=self._copier, open_extent=self.files.open_known)
        self.syncs = GroupSync(self.scheduler or self.engine)  # concurrent puts share fdatasyncs
        recorded = self.index.meta_records.capacity()
        capacity = recorded if opts.capacity_bytes is None else opts.capacity_bytes
        self.allocator = Allocator(
            path=self.path, index=self.index, writer=self.writer,
            engine=self.scheduler or self.engine, extent_bytes=self.extent_bytes,
            store_uuid=self.store_uuid, lost_extents=self.lost_extents,
            capacity_bytes=capacity, file_mode=self.file_mode,
            counters=self.counters, owner_id=self.owner.id)
        # Freed space is reused once no read of any owner can hold it (read marks)
        marks = self.owner.marks
        if marks.enabled:
            self.allocator.epochs.horizon, self.allocator.epochs.newest = \
                marks.horizon, marks.newest
        # Other owners' idle claims come back when a put needs them, and this owner's
        # go back when another one asks (its listener runs once the store serves).
        self.allocator.requests = ClaimRequests(
            claims=self.allocator.claims, file=self.owner.file,
            recover=self.owner.recover_dead)
        # Capacity is a bound at every instant: a store reopened with a smaller one
        # evicts down to it now, before it serves (or refuses to open: pinned blocks).
        self.allocator.fit_capacity(ride_along=self.flush_totals_in)
        self._record_capacity(opts.capacity_bytes, recorded)
        # What it evicted is in no cache yet (the memory tier is empty until the store
        # serves), and it adds no extent: nothing to act on.
        self.allocator.take_changes()

    def _record_capacity(self, given: int | None, recorded: int | None) -> None:
        """``capacity_bytes`` is the store's, recorded in the index, so every process
        sharing it applies one (issue 43): one given is recorded once the store fits it
        (the last explicit setter wins); an open without one took the recorded one (or,
        none recorded, the default rule: what the store holds plus 90% of the free disk
        space)."""
        if given is None or given == recorded:
            return
        if recorded is not None:
            logger.info("kvstore %s: capacity_bytes %d replaces the recorded %d",
                        self.path, given, recorded)
        meta = self.index.meta_records
        self.writer.run_sync(lambda txn: meta.record_capacity(txn, given))

    # ------------------------------------------------------------------ totals

    def flush_totals_in(self, txn: Txn) -> None:
        """Persisted totals (issue 11) ride along in every transaction that commits puts,
        evicts or records last use."""
        self.totals.flush(txn, self.index)

    def last_writes(self, touched: Touched, ripe: list[tuple[int, int, int]]
                    ) -> Callable[[Txn], None]:
        """The closing transaction, once every call ended: what this owner freed back to
        the pool (``ripe``: no read of it is left), gets' last uses, the totals."""
        index = self.index

        def last(txn: Txn) -> None:
            index.space.ripen(txn, index.free_map, ripe)
            index.apply_touched(txn, touched)
            self.flush_totals_in(txn)

        return last

    def flush_totals(self) -> None:
        if self.totals.pending() and not self.health.read_only:
            self.writer.run_sync(self.flush_totals_in)

    def close(self) -> None:
        """Release every part, last acquired first (a failing release does not stop
        the rest)."""
        while self._cleanups:
            fn = self._cleanups.pop()
            with suppress(Exception):
                fn()
