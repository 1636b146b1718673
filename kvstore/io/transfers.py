"""Staged transfers between blocks and extent files, a chunk (a few MiB) at a time: while
the device moves one chunk, the next is staged (copy + CRC32C) or verified and copied
out, on a worker thread when it is large.

Each chunk's staging is one arena run (``Arena.acquire`` of the chunk, ``Arena.split`` per
block), so a transfer never holds part of its staging while waiting for the rest; a chunk
never exceeds the arena.  Arena runs go back only after the engine returned, i.e. after
the kernel is done with them, even when the caller is cancelled.

A read of an entry naming an extent this process has no descriptor for (another process
sharing the store added it, issue 43) calls ``open_extent(id)``, which opens it into
``fds``; it answers False if the file does not exist: only then is the extent missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, TypeVar

import anyio
import torch

from kvstore.codecs.pipeline import CODEC_RAW, CodecSpec
from kvstore.disk.format import PAGE, SLOT_HEADER_BYTES, IndexEntry, SlotHeader, round_up
from kvstore.errors import CorruptionError, FormatVersionError
from kvstore.io import native_slots
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.arena import Arena, ArenaRun
from kvstore.io.coalesce import reread_failed
from kvstore.io.device_copies import HOST_COPIER, DeviceCopier
from kvstore.io.protocol import IOEngine, IoOp
from kvstore.io.slots import (
    PutItem,
    ToDevice,
    check_payload,
    check_slot,
    check_values_held,
    encode_all,
    stage_all,
    stage_header,
    stage_slot_range,
    verify_copy_all,
)

T = TypeVar("T")
Failed = list[tuple[bytes, IndexEntry, str]]  # key, its entry, why

# Staging and verification of chunks at least this large run on a worker thread, so the
# event loop keeps serving other tasks while megabytes are copied and checksummed...
OFFLOAD_BYTES = 1 << 20
# ...unless the chunk is below this and the only one in flight in the store (any task's):
# nothing else waits on the loop then, and the thread hop (handing the call over, waking
# the loop on return, the GIL back and forth) cost more than the ~0.4 ms of compiled copy
# + CRC32C of a 64 KiB batch's 2 MiB: done in place, one caller's 64 KiB gets took 24% less wall time
# and ~20% less CPU per batch.  With other transfers in flight it still goes to a thread
# (in place, it held up their submissions: 4 callers' 64 KiB gets 13% slower).
LONE_OFFLOAD_BYTES = 4 << 20
# Pieces a large block is staged and written in: small enough that the device starts
# a few milliseconds into staging, large enough to be an efficient device request and
# that a thread hop per piece is noise (~3-4 GB/s of copy + CRC32C per core here).
PIECE_BYTES = 8 << 20


async def offloaded(nbytes: int, fn: Callable[..., T], *args: Any, alone: bool = False,
                    limiter: anyio.CapacityLimiter | None = None) -> T:
    """``fn(*args)`` on a worker thread when it touches ``nbytes`` >= OFFLOAD_BYTES (or,
    ``alone``: the caller's chunk is the only one in flight, >= LONE_OFFLOAD_BYTES), else
    right here (a thread hop costs more than copying a small chunk).  ``limiter``: the
    threads it may take (default: anyio's)."""
    if nbytes >= (LONE_OFFLOAD_BYTES if alone else OFFLOAD_BYTES):
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
    return fn(*args)


class Transfers:
    """Moves slots between the caller's blocks, the staging arena and the extent files."""

    def __init__(self, engine: IOEngine, arena: Arena, fds: dict[int, int], *,
                 piece_bytes: int = PIECE_BYTES, copier: DeviceCopier = HOST_COPIER,
                 open_extent: Callable[[int], bool] = lambda extent_id: False) -> None:
        self.engine, self.arena = engine, arena
        self.copier = copier  # device copies: the store's (kvstore/io/device_copies.py)
        self._fds, self._open_extent = fds, open_extent  # extent id -> fd (module docstring)
        # Chunks of a few MiB (staging the next overlaps the device moving this one); a raw
        # block of at least two pieces is staged and written a piece at a time.
        self._chunk_bytes = max(min(arena.size // 4, 8 << 20), PAGE)
        self._piece_bytes = round_up(piece_bytes)
        self._cores = max(1, len(os.sched_getaffinity(0)))
        self._chunks_active = 0  # chunks being staged/written or read/verified (any task)
        self._stagers: anyio.CapacityLimiter | None = None  # made on first use (in a loop)

    def _staging_threads(self) -> anyio.CapacityLimiter:
        """Staging threads for the put path: one per core, taken in order.  With anyio's
        40, every chunk a batch's arena room allowed was staged at once, all sharing
        the cores: they finished together and the device idled until then (one caller's
        32 MiB FP8 puts, 8 chunks encoded side by side, ran at 0.85x encoding the batch
        first).  One per core: the first chunks finish first and are written while the
        later ones are staged."""
        if self._stagers is None:
            self._stagers = anyio.CapacityLimiter(self._cores)
        return self._stagers

    def _chunks(self, items: Sequence[T], size: Callable[[T], int],
                work: Callable[[T], int] | None = None) -> list[list[T]]:
        """Split ``items`` into runs of about ``_chunk_bytes`` of ``work`` (default: their
        ``size``; at least one item each), never more than the arena holds (in
        ``size``): each chunk is staged in one arena run."""
        chunks: list[list[T]] = []
        current: list[T] = []
        pending = done = 0
        for item in items:
            n = size(item)
            if current and pending + n > self.arena.size:
                chunks.append(current)
                current, pending, done = [], 0, 0
            current.append(item)
            pending += n
            done += n if work is None else work(item)
            if done >= self._chunk_bytes:
                chunks.append(current)
                current, pending, done = [], 0, 0
        if current:
            chunks.append(current)
        return chunks

    async def _acquire_runs(self, lengths: list[int]) -> tuple[ArenaRun, list[ArenaRun]]:
        """One arena run for a whole chunk, split per block: a task never holds part of
        its staging while it waits for the rest (that deadlocked on a small arena)."""
        whole = await self.arena.acquire(sum(lengths))
        return whole, self.arena.split(whole, lengths)

    async def encode(self, items: list[PutItem], spec: CodecSpec) -> None:
        """Encode a batch's blocks (FP8, zstd): on the event loop when small, else spread
        over the cores, one worker thread per group of blocks of about equal size (the
        codecs' NumPy/torch/native work releases the GIL).  One thread did the whole batch
        before, so FP8 puts ran at one core's encode speed (~1.7 GB/s), below a fast disk."""
        total = sum(item.raw_len for item in items)
        if total < OFFLOAD_BYTES:
            encode_all(items, spec)
            return
        groups: list[list[PutItem]] = [[] for _ in range(min(self._cores, len(items)))]
        loads = [0] * len(groups)
        for item in sorted(items, key=lambda it: -it.raw_len):  # largest first, to the
            i = loads.index(min(loads))                          # least loaded group
            groups[i].append(item)
            loads[i] += item.raw_len
        async with anyio.create_task_group() as tg:
            for group in groups:
                tg.start_soon(partial(anyio.to_thread.run_sync, encode_all, group, spec))

    async def write(self, items: list[PutItem]) -> None:
        """Stage and write slots a chunk (a few MiB) at a time: while the device writes one
        chunk, the next is copied and checksummed (on a worker thread when it is large)."""
        check_values_held(items)
        errors: list[BaseException] = []

        async def write_chunk(whole: ArenaRun, chunk: list[tuple[PutItem, ArenaRun]]) -> None:
            self._chunks_active += 1
            try:
                # A planned block is encoded here too: its raw bytes are read once more.
                work = whole.length + sum(item.raw_len for item, _ in chunk
                                          if item.planned is not None)
                await offloaded(work, stage_all, chunk, alone=self._chunks_active == 1,
                                limiter=self._staging_threads())
                await self.engine.write([IoOp(self._fds[item.extent], item.offset, run)
                                         for item, run in chunk])
            except Exception as e:  # re-raised below, unwrapped from the task group
                errors.append(e)
            finally:
                self._chunks_active -= 1
                self.arena.release(whole)

        async def write_in_pieces(whole: ArenaRun, item: PutItem) -> None:
            self._chunks_active += 1  # its pieces go out beside anything staged in place
            try:
                await self._write_in_pieces(whole, item)
            except Exception as e:
                errors.append(e)
            finally:
                self._chunks_active -= 1
                self.arena.release(whole)

        async with anyio.create_task_group() as tg:
            # A planned block's staging reads its raw bytes twice (amax, then the codes):
            # chunks of that work, not of slot bytes (half of it for FP8), so a batch
            # of 1 MiB blocks is four chunks, not two finishing together.
            for chunk in self._chunks(items, lambda item: item.slot_len, lambda item:
                                      item.raw_len if item.planned is not None
                                      else item.slot_len):
                whole, runs = await self._acquire_runs([item.slot_len for item in chunk])
                if errors:
                    self.arena.release(whole)
                    break
                if len(chunk) == 1 and self._in_pieces(chunk[0]):
                    tg.start_soon(write_in_pieces, whole, chunk[0])
                else:
                    tg.start_soon(write_chunk, whole, list(zip(chunk, runs)))
                await anyio.lowlevel.checkpoint()  # let the chunk start before staging more
        if errors:
            raise errors[0]

    def _in_pieces(self, item: PutItem) -> bool:
        """A raw block of at least two pieces is staged and written a piece at a time."""
        return item.encoded is None and item.codec == CODEC_RAW and \
            item.slot_len >= 2 * self._piece_bytes

    async def _write_in_pieces(self, run: ArenaRun, item: PutItem) -> None:
        """Stage and write one large raw block a piece at a time, each piece written as
        soon as it is staged, the first page (with the header, which holds the payload's
        CRC32C) last.  Staged whole, a 32 MiB block kept the device idle for the whole
        copy + CRC of the block (~10-25 ms here) before its first byte went out, at the
        start of every batch: one caller's durable 32 MiB puts ran at 0.59x fio, 0.86x in
        pieces (``benchmarks/results/large_pieces_vs_9bfe73b_at_6c5bf3f.md``)."""
        fd = self._fds[item.extent]
        bounds = [0, PAGE, *range(PAGE + self._piece_bytes, item.slot_len, self._piece_bytes),
                  item.slot_len]
        pieces = self.arena.split(run, [end - start for start, end in zip(bounds, bounds[1:])])
        errors: list[Exception] = []

        async def write_piece(op: IoOp) -> None:
            try:
                await self.engine.write([op])
            except Exception as e:  # re-raised below, unwrapped from the task group
                errors.append(e)

        crc = 0
        async with anyio.create_task_group() as tg:
            for (start, end), piece in zip(zip(bounds, bounds[1:]), pieces):
                if errors:
                    break
                crc = await offloaded(end - start, stage_slot_range, run, item, start, end, crc,
                                      limiter=self._staging_threads())
                if start:
                    tg.start_soon(write_piece, IoOp(fd, item.offset + start, piece))
            if not errors:
                stage_header(run, item, crc)
                await write_piece(IoOp(fd, item.offset, pieces[0]))
        if errors:
            raise errors[0]

    async def read(self, keys: list[bytes], entries: list[IndexEntry | None],
                   outs: list[torch.Tensor | None], results: list[torch.Tensor | None],
                   corrupt: Failed, unreadable: Failed) -> ReadCounts:
        """Read slots a chunk at a time into ``results``; each chunk is verified and copied
        out (on a worker thread when large) while later chunks are still on the device.
        Blocks that fail verification go to ``corrupt``, blocks that cannot be read at
        all (an I/O error, a short read past a truncated extent's end, an extent file
        that is missing) to ``unreadable``, each with the cause: the caller takes both
        out of the index, so that a lookup never promises them again.  A read that
        failed is tried again first, alone (:func:`kvstore.io.coalesce.reread_failed`).
        Returns what to count, for the caller to count on the event loop."""
        # CUDA outputs: filled by stream-ordered copies from the arena runs, awaited
        # (eventfd) before the runs are reused; no host synchronisation.
        device_outs = any(o is not None and o.device.type == "cuda" for o in outs)

        def check(read: list[tuple[int, IndexEntry, ArenaRun]], to_device: ToDevice | None
                  ) -> int:
            # One call for the chunk: the compiled kernels check and copy every slot with
            # the GIL released (the Python checks where they are not built).
            checked = verify_copy_all([(run, keys[i], entry, outs[i]) for i, entry, run in read],
                                      to_device=to_device)
            nbytes = 0
            for (i, entry, _), result in zip(read, checked):
                if isinstance(result, CorruptionError):
                    corrupt.append((keys[i], entry, str(result)))
                elif isinstance(result, Exception):  # a newer format: refuse, as before
                    raise result
                else:
                    results[i] = result
                    nbytes += entry.raw_len
            return nbytes

        return await self._read_slots(keys, entries, unreadable, check, device_outs)

    async def verify(self, keys: list[bytes], entries: list[IndexEntry | None],
                     verified: list[bool], corrupt: Failed, unreadable: Failed) -> ReadCounts:
        """:meth:`read` that only checks (header against entry, payload CRC32C): nothing
        is decoded or copied out.  ``verified[i]`` becomes True for each slot that checks
        out; the bytes counted are the slot bytes read whole (checked, whatever the
        outcome).  The scrub's and the quarantine re-reads' path (a slot of a format this
        build does not read fails here, as corrupt, instead of raising: it does not check
        out)."""

        def check(read: list[tuple[int, IndexEntry, ArenaRun]], _: ToDevice | None) -> int:
            for (i, entry, _run), error in zip(read, verify_slots(
                    [(run, keys[i], entry) for i, entry, run in read])):
                if error is not None:
                    corrupt.append((keys[i], entry, str(error)))
                else:
                    verified[i] = True
            return sum(entry.slot_len for _, entry, _ in read)

        return await self._read_slots(keys, entries, unreadable, check, False)

    async def _read_slots(self, keys: list[bytes], entries: list[IndexEntry | None],
                          unreadable: Failed,
                          check: Callable[[list[tuple[int, IndexEntry, ArenaRun]],
                                           ToDevice | None], int],
                          device_outs: bool) -> ReadCounts:
        """The chunked reads of :meth:`read` and :meth:`verify`: ``check`` gets each
        chunk's slots that were read whole and returns the bytes it counts."""
        counts = [0, 0, 0]  # read errors, bytes, retried reads
        wanted: list[tuple[int, IndexEntry]] = []
        for i, entry in enumerate(entries):
            if entry is None:
                continue
            if entry.extent not in self._fds and not self._open_extent(entry.extent):
                counts[0] += 1
                unreadable.append((keys[i], entry, f"extent file {entry.extent} is missing"))
            else:
                wanted.append((i, entry))

        def finish(batch: list[tuple[int, IndexEntry, ArenaRun]],
                   res: list[int | OSError], to_device: ToDevice | None) -> tuple[int, int]:
            """Sort out what could not be read, check the rest; returns (read errors,
            bytes), which the caller counts on the event loop (this may run on a
            worker thread)."""
            errors = 0
            read = []
            for (i, entry, run), r in zip(batch, res):
                if isinstance(r, OSError):
                    errors += 1
                    unreadable.append((keys[i], entry, f"read failed: {r}"))
                elif r != run.length:
                    errors += 1
                    unreadable.append((keys[i], entry, f"short read: {r} of {run.length} "
                                       f"bytes at offset {entry.offset} of extent "
                                       f"{entry.extent} (truncated?)"))
                else:
                    read.append((i, entry, run))
            return errors, check(read, to_device)

        failures: list[BaseException] = []

        async def staged(chunk: list[tuple[int, IndexEntry]]
                         ) -> tuple[ArenaRun, list[tuple[int, IndexEntry, ArenaRun]]]:
            whole, runs = await self._acquire_runs([e.slot_len for _, e in chunk])
            return whole, [(i, e, run) for (i, e), run in zip(chunk, runs)]

        async def read_chunk(whole: ArenaRun, batch: list[tuple[int, IndexEntry, ArenaRun]]) -> None:
            self._chunks_active += 1
            copies = self.copier.copies() if device_outs else None
            try:
                ops = [IoOp(self._fds[e.extent], e.offset, run) for _, e, run in batch]
                res = await self.engine.read(ops)
                # A merged read's error would otherwise be every block's (up to 16 MiB).
                counts[2] += await reread_failed(self.engine.read, ops, res)
                errors, nbytes = await offloaded(
                    whole.length, finish, batch, res, None if copies is None else copies.sink,
                    alone=self._chunks_active == 1)
                if copies is not None:
                    await copies.wait()
                counts[0] += errors
                counts[1] += nbytes
            except Exception as e:  # re-raised below, unwrapped from the task group
                failures.append(e)
            finally:
                self._chunks_active -= 1
                if copies:  # (cancelled) the GPU may still read the runs
                    with anyio.CancelScope(shield=True):
                        await copies.wait()
                self.arena.release(whole)

        chunks = self._chunks(wanted, lambda w: w[1].slot_len)
        if len(chunks) == 1:  # most gets of small blocks: no task group to set up
            await read_chunk(*await staged(chunks[0]))
        elif chunks:
            async with anyio.create_task_group() as tg:
                for chunk in chunks:
                    tg.start_soon(read_chunk, *await staged(chunk))
                    await anyio.lowlevel.checkpoint()  # let the chunk's reads go out first
        if failures:
            raise failures[0]
        return ReadCounts(*counts)


async def read_slot(transfers: Transfers, key: bytes, entry: IndexEntry,
                    buffer: AlignedBuffer) -> tuple[memoryview, SlotHeader] | None:
    """One slot's verified bytes (header and payload) copied into ``buffer`` (valid
    until its next use), or None if its extent is not open, it cannot be read whole or
    it fails verification: nothing is quarantined here.  Read through ``transfers``'
    engine into an arena run, an error tried again as every read is
    (:func:`kvstore.io.coalesce.reread_failed`); the check and the copy run on a worker
    thread when large (a remote upload's read of a block)."""
    fd = transfers._fds.get(entry.extent)
    if fd is None and transfers._open_extent(entry.extent):
        fd = transfers._fds.get(entry.extent)
    if fd is None:
        return None
    run = await transfers.arena.acquire(entry.slot_len)
    try:
        ops = [IoOp(fd, entry.offset, run)]
        res = await transfers.engine.read(ops)
        await reread_failed(transfers.engine.read, ops, res)
        if res[0] != run.length:  # an error, or the extent ends early
            return None
        return await offloaded(run.length, _verified_copy, run, key, entry, buffer)
    finally:
        transfers.arena.release(run)


def _verified_copy(run: ArenaRun, key: bytes, entry: IndexEntry, buffer: AlignedBuffer
                   ) -> tuple[memoryview, SlotHeader] | None:
    try:
        header = check_slot(run.view, key, entry)
        check_payload(run.view, header)
    except CorruptionError:
        return None
    n = SLOT_HEADER_BYTES + header.payload_len
    view = buffer.view(n)
    view[:] = run.view[:n]
    return view, header


class ReadCounts(NamedTuple):
    """What one read of slots did, counted by its caller: blocks that could not be read
    (after retries), bytes delivered (or, for a verify, slot bytes checked), and op reads
    retried after an error."""

    errors: int
    nbytes: int
    retries: int


def verify_slots(batch: Sequence[tuple[ArenaRun, bytes, IndexEntry]]
                 ) -> list[CorruptionError | FormatVersionError | None]:
    """Check slots read into the arena against their entries (header, then payload
    CRC32C), copying nothing: the compiled checker in one call when it is built (no
    destination: verify only), else :func:`kvstore.io.slots.check_slot` and
    :func:`~kvstore.io.slots.check_payload`.  None for each slot that checks out."""
    if native_slots.available():
        return [r if isinstance(r, Exception) else None for r in
                native_slots.verify([(run, key, entry, 0, 0, False) for run, key, entry in batch])]
    out: list[CorruptionError | FormatVersionError | None] = []
    for run, key, entry in batch:
        try:
            check_payload(run.view, check_slot(run.view, key, entry))
            out.append(None)
        except (CorruptionError, FormatVersionError) as e:
            out.append(e)
    return out
