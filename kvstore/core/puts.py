"""How a put travels (``Store.put_many``; guarantees G1/G3, FORMAT.md "Commit protocol").

1. validate every key, parent and value before any I/O; decide dedup; then, in the
   same step (before any await), take its place in line on its keys
   (``kvstore/core/key_order.py``: a delete started after it waits for it) and protect its
   keys and their parents from eviction, and take its backlog turn
   (``kvstore/core/backlog.py``: a background put is dropped whole, a foreground one waits
   its turn);
2. wait out the puts and deletes of the same keys that started before it, decide again
   without yielding; copy the values of the blocks it writes that lie on a GPU into
   page-locked host memory (stream-ordered, awaited:
   ``kvstore.io.device_copies.DeviceCopier.to_host``);
3. reserve space in the allocator (nothing durable changes);
4. stage header + payload in the arena, CRC32C over the staged bytes, and write every
   slot (O_DIRECT), encoding FP8 chunks as they are staged (``kvstore/io/transfers.py``);
5. fdatasync every extent written, shared with concurrent puts (``kvstore/io/group_sync.py``);
6. one LMDB write transaction: index entries (and the caller's tags) in, their ranges
   out of the durable free map (sequence numbers come from the owner's lease:
   kvstore/core/seq_lease.py); commit (fsync);
7. acknowledge; then queue the remote upload and cache the blocks in memory.

A crash before 6 leaves no index entry and the space still free in the index: the
written slots are orphans that fsck reclaims.  A failed write or fdatasync turns the
store read-only (G5), and no put whose bytes preceded it is acknowledged.  A put
cancelled at any await is either committed (6 had started: it is waited for) or absent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CODEC_RAW, CodecSpec
from kvstore.codecs.tensors import CODE_DTYPES, check_value, host_bytes
from kvstore.core.backlog import Backlog
from kvstore.core.deletes import DeleteWatch
from kvstore.core.key_order import KeyOrder, Turn
from kvstore.core.seq_lease import SeqLease
from kvstore.disk.format import PAGE, SLOT_HEADER_BYTES, IndexEntry, round_up
from kvstore.errors import BlockTooLargeError, StoreIOError
from kvstore.index.index import ChainCut, Skipped, Txn
from kvstore.index.tags import check_tags
from kvstore.io.slots import PlanMismatch, PutItem
from kvstore.keys import check_key, check_keys
from kvstore.stats import PutResult

if TYPE_CHECKING:
    from kvstore.core.allocator import Allocator, Changes
    from kvstore.core.extent_files import ExtentFiles
    from kvstore.core.operations import Health
    from kvstore.core.tier_ports import Tiers
    from kvstore.index.index import Index, IndexWriter
    from kvstore.io.group_sync import GroupSync
    from kvstore.io.transfers import Transfers

__all__ = ["PutPath", "SlotLimits"]

Sized = tuple[int, int]  # a value's bytes and its dtype code


@dataclass(frozen=True)
class SlotLimits:
    """The largest slot a store can hold: it must fit an extent and the staging arena."""

    extent_bytes: int
    arena_bytes: int

    def check(self, slot_len: int) -> None:
        """A slot of ``slot_len`` bytes fits (or a clear error saying which option to
        raise)."""
        if slot_len > self.extent_bytes - PAGE:
            raise BlockTooLargeError(
                f"a {slot_len}-byte slot does not fit a {self.extent_bytes}-byte extent; "
                "create the store with a larger extent_bytes")
        if slot_len > self.arena_bytes:
            raise BlockTooLargeError(
                f"a {slot_len}-byte slot does not fit the {self.arena_bytes}-byte staging "
                "arena; open the store with a larger staging_bytes")


class PutPath:
    """The puts of one open store (see the module docstring).  ``seqs``: this owner's
    lease of sequence numbers (kvstore/core/seq_lease.py: unique among the processes
    sharing the store); this path numbers every slot from it.  ``ride_along``: the
    store's writes that go in every transaction that commits puts or evicts (the
    persisted totals)."""

    def __init__(self, *, index: Index, writer: IndexWriter, allocator: Allocator,
                 transfers: Transfers, syncs: GroupSync, files: ExtentFiles, health: Health,
                 counters: dict[str, int], limits: SlotLimits,
                 ride_along: Callable[[Txn], None], seqs: SeqLease, codec: CodecSpec | None,
                 durable: bool, backlog_bytes: int, tiers: Tiers) -> None:
        self._index, self._writer, self._allocator = index, writer, allocator
        self._transfers, self._syncs, self._files = transfers, syncs, files
        self._health, self._counters, self._limits = health, counters, limits
        self._ride_along = ride_along
        self._seqs = seqs
        self.codec = codec  # the store's default
        self.durable = durable
        # puts in flight beyond backlog_bytes drop background puts (kvstore/core/backlog.py)
        self.backlog = Backlog(backlog_bytes)
        self._tiers = tiers  # the memory tier caches what is durable, the remote uploads it
        # puts and deletes in flight per key, in the order they started
        self.order = KeyOrder()

    async def put_many(self, keys: Sequence[bytes], values: Sequence[torch.Tensor],
                       parents: Sequence[bytes | None] | None,
                       codec: CodecSpec | None, background: bool = False,
                       skip_deleted: DeleteWatch | None = None,
                       tags: Sequence[bytes | None] | None = None) -> PutResult:
        """``Store.put_many``; ``skip_deleted`` (a promotion's): keys deleted since the
        watch began are not stored (reported as ``dropped``)."""
        keys = check_keys(keys)
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        tag_list = check_tags(tags, len(keys))
        # key -> tag, the first given for a key (the blocks a put writes take theirs in
        # its commit; a deduplicated key's stored tag stays: kvstore/index/tags.py)
        tag_of: dict[bytes, bytes] = {}
        if tag_list is not None:
            for key, tag in zip(keys, tag_list):
                if tag is not None:
                    tag_of.setdefault(key, tag)
        if parents is None:
            parent_list: list[bytes | None] = [None] * len(keys)
        else:
            parent_list = [None if p is None else check_key(p) for p in parents]
            if len(parent_list) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(parent_list)} parents")
        # Every value validated before any I/O; a value on a GPU is not copied yet: only
        # the blocks this put writes are (in _put_once), never a deduplicated one.
        sized = [check_value(v) for v in values]
        for n, _ in sized:
            self._limits.check(round_up(SLOT_HEADER_BYTES + n))
        # Blocks already stored are deduplicated, never dropped nor waited for: only the
        # rest count against the backlog (_put_once decides again, without yielding).
        present = self._index.present(keys)
        dedup = [k in present for k in keys]
        nbytes = sum(n for (n, _), p in zip(sized, dedup) if not p)
        if nbytes and background and not self.backlog.try_enter(nbytes):
            self._count_dedup(sum(dedup), sum(n for (n, _), p in zip(sized, dedup) if p))
            self._counters["dropped_puts"] += 1
            self._counters["dropped_blocks"] += len(keys) - sum(dedup)
            return PutResult(0, sum(dedup), 0, dropped=len(keys) - sum(dedup))
        # Registered before any await (the backlog wait included): a delete of these
        # keys started from now on waits for this put, and eviction leaves its keys and
        # their parents alone while it waits.  What it deduplicates against is among them.
        turn = self.order.register(keys)
        guarded = [*keys, *(p for p in parent_list if p is not None)]
        allocator = self._allocator
        allocator.protect(guarded)
        admitted = background or not nbytes  # (a background put entered above)
        try:
            if not admitted:
                await self.backlog.enter(nbytes, self._health.check_writable)
                admitted = True
            self._counters["puts"] += 1
            spec = codec if codec is not None else self.codec
            while True:
                try:
                    return await self._put_once(turn, keys, parent_list, sized, values, spec,
                                                skip_deleted, tag_of)
                except ChainCut:
                    # An eviction chose blocks this put deduplicated against before the
                    # put protected them, and committed after the put's decision: decide
                    # again (now they are absent, so this put writes them).  Rare;
                    # bounded by the evictions that were in flight when the put decided.
                    # (A block it writes that was indexed meanwhile, by another process
                    # or a restore from quarantine, is skipped by the commit: dedup_late.)
                    self._counters["put_retries"] += 1
        finally:
            self.order.finish(turn)
            allocator.unprotect(guarded)  # its blocks are evictable now
            if admitted and nbytes:
                self.backlog.leave(nbytes)

    async def _put_once(self, turn: Turn, keys: Sequence[bytes],
                        parent_list: Sequence[bytes | None], sized: Sequence[Sized],
                        values: Sequence[torch.Tensor], spec: CodecSpec | None,
                        skip_deleted: DeleteWatch | None, tag_of: dict[bytes, bytes]
                        ) -> PutResult:
        # Wait out the puts and deletes of these keys that started earlier, then decide
        # without yielding.
        await self.order.wait_earlier(turn, self._health.check_writable)
        # (parents outside the batch looked up with it: one gone at the commit was
        # evicted by another process meanwhile, Index.commit_puts)
        outside = {p for p in parent_list if p is not None}.difference(keys)
        present = self._index.present([*keys, *outside])
        seen = [p for p in outside if p in present]
        chosen: list[tuple[bytes, bytes | None, torch.Tensor, int]] = []
        deduplicated: dict[bytes, None] = {}
        dedup_bytes = 0
        # A promotion's keys deleted since its fetch began: not stored (a delete from
        # here on waits for this put: it started after it).
        skipped = set() if skip_deleted is None else skip_deleted.deleted & set(keys)
        taken: set[bytes] = set()  # (a key twice in the batch is written once)
        for key, parent, (nbytes, code), value in zip(keys, parent_list, sized, values):
            if key in skipped:
                continue
            if key in present or key in taken:
                dedup_bytes += nbytes
                if key in present:
                    deduplicated[key] = None
                continue
            chosen.append((key, parent, value, code))
            taken.add(key)
        # (a key twice in the batch and skipped counts once per occurrence)
        n_skipped = sum(k in skipped for k in keys)
        if not chosen:
            self._count_dedup(len(keys) - n_skipped, dedup_bytes)
            return PutResult(0, len(keys) - n_skipped, 0, dropped=n_skipped)
        items = await self._items(chosen)
        if spec is not None and codecs.codec_id(spec) != CODEC_RAW:
            # FP8 slots are sized from the shapes and each chunk is encoded as it is
            # staged, overlapped with the writes of the chunks before it; encoded up
            # front (over the cores, then placed) where the sizes depend on the values
            # (zstd), or when a block's values made FP8 fall back to raw.
            if not all([item.plan(spec) for item in items]):
                await self._encode(items, spec)
            try:
                late = await self._put_items(items, list(deduplicated), tag_of, seen)
            except PlanMismatch:
                self._counters["put_replans"] += 1
                await self._encode(items, spec)
                late = await self._put_items(items, list(deduplicated), tag_of, seen)
        else:
            late = await self._put_items(items, list(deduplicated), tag_of, seen)
        if late:  # indexed by another owner (or restored) since the decision: not ours
            self._counters["dedup_late"] += len(late)
            dedup_bytes += sum(item.raw_len for item in items if item.key in late)
            items = [item for item in items if item.key not in late]
        written = sum(item.payload_len for item in items)
        self._count_dedup(len(keys) - len(items) - n_skipped, dedup_bytes)
        self._counters["put_blocks"] += len(items)
        self._counters["put_bytes"] += sum(item.raw_len for item in items)
        self._counters["put_payload_bytes"] += written
        return PutResult(len(items), len(keys) - len(items) - n_skipped, written,
                         dropped=n_skipped)

    async def _items(self, chosen: Sequence[tuple[bytes, bytes | None, torch.Tensor, int]]
                     ) -> list[PutItem]:
        """The blocks to write (validated: ``check_value``), their values on the host: a
        value on a GPU is copied now (stream-ordered into page-locked memory, awaited,
        no synchronize: issue 33), once the put knows it writes it."""
        values = await self._transfers.copier.to_host([v for _, _, v, _ in chosen])
        return [PutItem(key, parent, host_bytes(host), code, tuple(value.shape))
                for (key, parent, value, code), host in zip(chosen, values)]

    async def _encode(self, items: list[PutItem], spec: CodecSpec) -> None:
        """Encode every block now (sizes known only then), checking each slot fits."""
        await self._transfers.encode(items, spec)
        for item in items:
            self._limits.check(item.slot_len)

    @asynccontextmanager
    async def turn(self, keys: Sequence[bytes]) -> AsyncIterator[None]:
        """A delete of ``keys``: in line behind the puts and deletes of them that started
        before it (registered when entered, before any await; waited for here), and
        ahead of those that start after it."""
        turn = self.order.register(keys)
        try:
            await self.order.wait_earlier(turn, self._health.check_writable)
            yield
        finally:
            self.order.finish(turn)

    def _count_dedup(self, blocks: int, raw_bytes: int) -> None:
        self._counters["dedup_blocks"] += blocks
        self._counters["dedup_bytes"] += raw_bytes

    async def _number(self, items: Sequence[PutItem]) -> None:
        """Give each slot the next sequence number of the lease (renewed first if it
        runs short; no await between the check and the numbering)."""
        await self._seqs.ensure(len(items), self._index, self._writer)
        for item, seq in zip(items, self._seqs.take(len(items))):
            item.seq = seq

    async def _reserve(self, items: Sequence[PutItem]) -> None:
        """The allocator places ``items`` (evicting, adding extents); this path acts on
        what it did, before its next await: opens the extents it added (before any slot
        in them is written: :class:`~kvstore.core.allocator.Changes`) and drops the
        blocks it evicted from the memory tier."""
        allocator = self._allocator
        try:
            changes = await allocator.reserve(items, ride_along=self._ride_along)
        except BaseException:
            self._apply(allocator.take_changes(), placed=())
            raise
        self._apply(changes, placed=items)

    def _apply(self, changes: Changes, placed: Sequence[PutItem]) -> None:
        if changes.evicted:
            # (the space is pending-free now: a lookup would not serve them anyway)
            self._tiers.forget(changes.evicted)
        for i, extent_id in enumerate(changes.new_extents):
            try:
                self._files.open(extent_id)
            except BaseException as e:
                _unopened(self._allocator, changes.new_extents[i:], placed, e)
                if isinstance(e, FileNotFoundError):
                    raise self._files.missing_error(extent_id) from e
                raise

    async def _put_items(self, items: list[PutItem], relies_on: list[bytes],
                         tag_of: dict[bytes, bytes], seen: list[bytes]) -> set[bytes]:
        """Reserve, number, write, sync and commit ``items``; returns the keys the
        commit skipped (indexed meanwhile: ``Index.commit_puts``), whose slots went back."""
        health, allocator, ride_along = self._health, self._allocator, self._ride_along
        await self._reserve(items)
        committed = False
        try:
            await self._number(items)
            await self._transfers.write(items)
            if self.durable:
                fds = self._files.fds
                await self._syncs.datasync(sorted({fds[i.extent] for i in items}))
            now = time.time_ns() // 1000
            entries = [(item.key, IndexEntry(
                extent=item.extent, offset=item.offset, slot_len=item.slot_len,
                payload_len=item.payload_len, raw_len=item.raw_len, codec=item.codec,
                dtype=item.dtype, payload_crc=item.crc, seq=item.seq, last_use=now,
                parent=item.parent)) for item in items]
            # G5: nothing is acknowledged once a write or a sync failed, even a put whose
            # own sync succeeded later (the kernel may have dropped pages the failed
            # sync covered); checked again on the writer thread, just before the commit.
            health.check_still_writable()
            touched = allocator.take_touched()
            index = self._index
            space = allocator.for_commit()  # (the claims' ride-alongs: kvstore/core/claiming.py)

            def commit(txn: Txn) -> Skipped | ChainCut:
                health.check_still_writable()
                # Freed ranges no read of ours can still copy leave ``pending`` (into
                # this owner's claims) first, even if this commit is cut: a commit
                # queued after this one may have placed slots in them.
                space.before(txn)
                try:
                    skipped = index.commit_puts(txn, entries, touched, relies_on, tag_of,
                                                space=space.owned, parents_seen=seen)
                except ChainCut as cut:  # (it wrote nothing: the ripening stays)
                    space.after(txn)
                    return cut
                space.after(txn)
                ride_along(txn)
                return skipped

            try:
                done = await self._writer.run(commit)
            except BaseException:
                space.failed()  # not committed: still pending, still claimed
                raise
            space.done()
            if isinstance(done, ChainCut):
                raise done
            late, cut = set(done.late), set(done.evicted)
            committed = True
            if late or cut:  # never indexed: their slots are free again (no reader holds them)
                allocator.unreserve([item for item in items if item.key in late | cut])
                _count_cut(self._counters, [item for item in items if item.key in cut])
                items = [item for item in items if item.key not in late | cut]
            allocator.committed(items)
            memory, remote = self._tiers.memory, self._tiers.remote
            if remote is not None:  # uploaded in the background
                remote.enqueue([item.key for item in items])
            if memory is not None:  # write-through: only what is durable
                await memory.fill([
                    (item.key, item.parent, item.data, CODE_DTYPES[item.dtype], item.shape,
                     item.seq) for item in items if codecs.is_lossless(item.codec)])
        except StoreIOError as e:
            health.fail_closed(f"I/O error while writing: {e}")
            raise
        finally:
            if not committed:
                allocator.unreserve(items)
        return late


def _count_cut(counters: dict[str, int], items: Sequence[PutItem]) -> None:
    """Blocks whose parent another process evicted before the commit: stored and
    evicted at once (no chain hole; not uploaded, not cached)."""
    counters["evicted_at_commit"] += len(items)
    counters["evicted_blocks"] += len(items)
    counters["evicted_bytes"] += sum(item.slot_len for item in items)


def _unopened(allocator: Allocator, extents: Sequence[int], placed: Sequence[PutItem],
              error: BaseException) -> None:
    """``extents[0]``, an extent the allocator reported, could not be opened (``error``):
    the put's slots (the only ones in them yet) go back, and ``extents`` (it and those
    after it, not opened) go out of use, as when growth itself fails.  A file that is
    gone (deleted while the store was open; another owner had added it) is lost for
    good, as one missing at open."""
    allocator.unreserve(placed)
    gone = isinstance(error, FileNotFoundError)
    for n, extent_id in enumerate(extents):
        allocator.withdraw_extent(extent_id, missing=gone and n == 0)
