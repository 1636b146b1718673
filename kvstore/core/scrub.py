"""Scrub: every stored slot read again and verified, at a bounded rate, beside live
traffic (``Store.scrub``, ``open(scrub_bytes_per_s=...)``, ``python -m kvstore scrub``).

Bits rot at rest; a block nobody reads for a month is found bad only when an engine
needs it.  A pass:

1. reads every quarantine record again (both kinds: could not be read, failed
   verification) and puts back what verifies (:meth:`VerifiedReads.recheck`);
2. walks the ``blocks`` table in key order from where the last pass stopped, a batch
   at a time: looks a batch up and, in the same step, checks it
   (:meth:`VerifiedReads.verify`: header against entry, payload CRC32C, nothing
   decoded, inside a read epoch, so a delete or eviction meanwhile cannot hand the
   space to a put mid-read); what fails is quarantined at once, as a get would;
3. paces itself: a batch of ``n`` bytes starts no sooner than ``n / rate`` after the one
   before (no bursts to catch up);
4. lets gets go first: its reads are background reads (the I/O scheduler's prefetch
   class: none while a get is being served).  A batch that waited :data:`PATIENCE_S`
   goes anyway beside the gets (at the prefetch bound), so a store under constant load
   is still scrubbed, one batch per ``PATIENCE_S``;
5. persists its cursor (the last key checked; meta record ``scrub_cursor``) every
   :data:`PERSIST_S` and when it stops (finished, cancelled, store closing), so a scrub
   after a restart resumes there; at the end of the pass it records the time
   (``scrub_completed``) and the next pass starts from the first key.

Keys are content hashes, so the cursor's place in the key space is the pass's progress.
Blocks put after the cursor passed their key are checked by the next pass; a block
deleted or evicted mid-batch is checked against its old entry and whatever it shows is
dropped (quarantine only moves an entry that is still current).  One walker at a time:
a ``Store.scrub`` call pauses the background scrub (same cursor) until it returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from kvstore.disk.format import IndexEntry
from kvstore.index.index import Index, Txn

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from kvstore.core.operations import Health, Operations
    from kvstore.core.reads import VerifiedReads
    from kvstore.index.index import IndexWriter
    from kvstore.io.scheduler import IoScheduler

__all__ = ["DEFAULT_SCRUB_BYTES_PER_S", "ScrubReport", "Scrubber", "key_fraction",
           "save_scrub_state", "scrub_state"]

DEFAULT_SCRUB_BYTES_PER_S = 64 << 20
"""``Store.scrub``'s rate unless told (and the CLI's): a 1 TiB store in ~4.5 hours, at
~2% of a core of CRC32C; benchmarks/scrub_cost.py measures what it costs gets."""
BATCH_BLOCKS = 256  # most blocks per batch (one lookup, one verify)
MAX_BATCH_BYTES = 4 << 20  # most bytes per batch (at least one block), 1/10 s of rate
PATIENCE_S = 0.25  # how long a batch waits for gets to pause before it goes beside them
PERSIST_S = 10.0  # the cursor is written at most this often (one index commit each)
BACKGROUND_PASS_S = 60.0  # the background scrub starts a pass at most this often

logger = logging.getLogger("kvstore.store")

ProgressFn = Callable[[int, int], None]
"""``progress(blocks done, blocks in the pass)``: after each batch of the walk."""


@dataclass
class ScrubReport:
    """What one ``Store.scrub`` call did."""

    checked_blocks: int = 0  # blocks of the walk read and checked
    checked_bytes: int = 0
    failed_blocks: int = 0  # of which failed (now quarantined)
    rechecked_blocks: int = 0  # quarantine records read again
    restored_blocks: int = 0  # of which verified: back in the index
    resumed: bool = False  # began where an earlier (interrupted) pass stopped
    complete: bool = False  # reached the end of the pass (False: cancelled, store closing)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def key_fraction(key: bytes | None) -> float:
    """How far into the key space ``key`` is (0 for None): a pass's progress."""
    return 0.0 if key is None else int.from_bytes(key[:8], "big") / 2.0 ** 64


class Scrubber:
    """The scrub of one open store (see the module docstring)."""

    def __init__(self, *, path: str, index: Index, writer: IndexWriter, health: Health,
                 scheduler: IoScheduler | None, counters: dict[str, int],
                 reads: VerifiedReads, ops: Operations,
                 task_group: Callable[[], TaskGroup | None]) -> None:
        self._path, self._index, self._writer, self._health = path, index, writer, health
        self._scheduler = scheduler
        self._reads, self._ops, self._task_group = reads, ops, task_group
        self._counters = counters
        self.cursor, _ = scrub_state(index)  # last key checked of the pass
        self._saved = self.cursor
        self._saved_at = time.monotonic()
        self._next_at = 0.0  # monotonic time the next batch may start
        self._lock: anyio.Lock | None = None  # one walker at a time (made on the loop)
        self._callers = 0  # Store.scrub calls running: the background one waits
        self._resume: anyio.Event | None = None
        self._scopes: set[anyio.CancelScope] = set()
        self._passed: anyio.Event | None = None  # set when a pass completes

    @property
    def progress(self) -> float:
        return key_fraction(self.cursor)

    async def wait_passes(self, n: int) -> None:
        """Until ``n`` passes (the background scrub's or callers') completed since the
        store opened (``stats().scrub_passes``): for callers that must know a background
        pass completed (an event, not a poll)."""
        while self._counters["scrub_passes"] < n:
            if self._passed is None:
                self._passed = anyio.Event()
            await self._passed.wait()

    def cancel(self) -> None:
        """Stop every walker (the store is closing); each persists its cursor."""
        for scope in self._scopes:
            scope.cancel()

    async def run(self, rate: float | None, progress: ProgressFn | None = None,
                  restart: bool = False) -> ScrubReport:
        """One pass, or the rest of the one in progress (``restart``: from the first key).
        ``rate``: bytes per second (None: as fast as gets allow)."""
        report = ScrubReport(resumed=self.cursor is not None and not restart)
        started = time.perf_counter()
        self._callers += 1
        if self._resume is None:
            self._resume = anyio.Event()
        try:
            with self._scoped():
                async with self._walker():
                    if restart:
                        self.cursor = None
                    await self._recheck_quarantine(report)
                    total = self._index.count_blocks()
                    base = int(self.progress * total)
                    while not await self._step(rate, report):
                        if progress is not None:
                            progress(min(base + report.checked_blocks, total), total)
                    report.complete = True
                    if progress is not None:
                        progress(total, total)
        finally:
            self._callers -= 1
            if not self._callers and self._resume is not None:
                self._resume.set()
                self._resume = None
            report.seconds = time.perf_counter() - started
        return report

    def start_background(self, rate: float) -> None:
        """Scrub for as long as the store is open, at ``rate`` bytes/s, a pass at most
        every :data:`BACKGROUND_PASS_S` (an empty store costs nothing)."""
        group = self._task_group()
        if group is not None:
            group.start_soon(self._background, rate)

    async def _background(self, rate: float) -> None:
        try:
            with self._scoped(), self._ops.track():
                while True:
                    began = time.monotonic()
                    report = ScrubReport()
                    await self._recheck_quarantine(report, background=True)
                    while True:
                        await self._callers_done()
                        async with self._walker():
                            if await self._step(rate, report):
                                break
                    await anyio.sleep(max(0.0, began + BACKGROUND_PASS_S - time.monotonic()))
        except Exception:  # background work never raises into the store's task group
            logger.exception("kvstore %s: the background scrub stopped", self._path)

    async def _callers_done(self) -> None:
        """The background walker waits while a caller's scrub walks instead."""
        while self._resume is not None:
            await self._resume.wait()

    # ------------------------------------------------------------------ internals

    @contextmanager
    def _scoped(self) -> Iterator[None]:
        """A scope :meth:`cancel` stops (its walker returns, the cursor persisted)."""
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                yield
            finally:
                self._scopes.discard(scope)

    @asynccontextmanager
    async def _walker(self) -> AsyncIterator[None]:
        """Held while a walker takes steps; the cursor is persisted when it lets go."""
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self._persist(force=True)

    async def _recheck_quarantine(self, report: ScrubReport, background: bool = False) -> None:
        """Step 1: every quarantine record read again, a batch at a time."""
        records = self._index.quarantine_records
        after: bytes | None = None
        while not self._health.read_only:
            if background:
                await self._callers_done()
            with self._reads.marked():
                rows, after = records.rows(after, BATCH_BLOCKS)
                if rows:
                    done = await self._reads.recheck([(k, e) for k, e, _ in rows])
                    report.rechecked_blocks += len(rows)
                    report.restored_blocks += len(done.restored)
            if after is None:
                return

    async def _step(self, rate: float | None, report: ScrubReport) -> bool:
        """Check the next batch; True when the pass is complete (nothing after the
        cursor)."""
        now = time.monotonic()
        if self._next_at > now:
            await anyio.sleep(self._next_at - now)
        else:  # a cancellation point (the engine's waits are shielded), and others run
            await anyio.lowlevel.checkpoint()
        index = self._index
        limit = MAX_BATCH_BYTES if rate is None else max(4096, min(MAX_BATCH_BYTES, rate / 10))
        scheduler = self._scheduler
        nbytes = failed = 0
        async with anyio.create_task_group() as tg:
            if scheduler is not None:
                tg.start_soon(self._impatient, scheduler)
            # no await from the lookup to verify's read epoch; the read mark before it
            with self._reads.marked():
                batch = _batch(index.block_rows_after(self.cursor, BATCH_BLOCKS), limit)
                if batch:
                    nbytes, failed = await self._reads.verify([k for k, _ in batch],
                                                              [e for _, e in batch])
            tg.cancel_scope.cancel()
        if not batch:
            await self._pass_complete()
            return True
        self.cursor = batch[-1][0]
        report.checked_blocks += len(batch)
        report.checked_bytes += nbytes
        report.failed_blocks += failed
        counters = self._counters
        counters["scrubbed_blocks"] += len(batch)
        counters["scrubbed_bytes"] += nbytes
        counters["scrub_failed_blocks"] += failed
        if rate is not None:
            self._next_at = max(self._next_at, now) + sum(e.slot_len for _, e in batch) / rate
        await self._persist()
        return False

    @staticmethod
    async def _impatient(scheduler: IoScheduler) -> None:
        """Step 4: after PATIENCE_S, the batch's reads go beside the gets."""
        await anyio.sleep(PATIENCE_S)
        with scheduler.prefetch_awaited():
            await anyio.sleep_forever()

    async def _persist(self, *, force: bool = False) -> None:
        """Step 5: the cursor, if it moved and PERSIST_S passed (or ``force``)."""
        if self.cursor == self._saved or self._health.read_only or not (
                force or time.monotonic() - self._saved_at >= PERSIST_S):
            return
        cursor = self.cursor
        index = self._index
        await self._writer.run(lambda txn: save_scrub_state(index, txn, cursor, None))
        self._saved, self._saved_at = cursor, time.monotonic()

    async def _pass_complete(self) -> None:
        self.cursor = self._saved = None
        if not self._health.read_only:
            when = time.time_ns() // 1000
            index = self._index
            await self._writer.run(lambda txn: save_scrub_state(index, txn, None, when))
        self._counters["scrub_passes"] += 1
        if self._passed is not None:
            self._passed.set()
            self._passed = None


def scrub_state(index: Index) -> tuple[bytes | None, int | None]:
    """The scrub's persisted state (meta records ``scrub_cursor``, ``scrub_completed``,
    FORMAT.md): :meth:`kvstore.index.meta.MetaRecords.scrub_state`."""
    return index.meta_records.scrub_state()


def save_scrub_state(index: Index, txn: Txn, cursor: bytes | None, completed: int | None
                     ) -> None:
    """:meth:`kvstore.index.meta.MetaRecords.save_scrub_state`."""
    index.meta_records.save_scrub_state(txn, cursor, completed)


def _batch(rows: list[tuple[bytes, bytes]], limit: float) -> list[tuple[bytes, IndexEntry]]:
    """The rows that fit ``limit`` bytes of slots (at least one), decoded."""
    out: list[tuple[bytes, IndexEntry]] = []
    total = 0
    for key, raw in rows:
        entry = IndexEntry.decode(raw)
        if out and total + entry.slot_len > limit:
            break
        out.append((key, entry))
        total += entry.slot_len
    return out
