"""Large blocks staged and written a piece at a time (kvstore/io/transfers.py): the slot's
bytes are those of one staged whole (both CRC32C paths), pieces go to the device while
later ones are still being staged, the header page last; a cancelled or failed transfer
gives its staging back and fails with the engine's error, not a task-group wrapper."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codecs.tensors import DTYPE_CODES
from kvstore.disk.format import PAGE, SLOT_HEADER_BYTES
from kvstore.errors import StoreIOError
from kvstore.io import native_slots, slots
from kvstore.io.arena import Arena
from kvstore.io.protocol import IOEngine, IoOp
from kvstore.io.slots import PutItem
from kvstore.io.transfers import LONE_OFFLOAD_BYTES, OFFLOAD_BYTES, Transfers, offloaded
from tests.concurrency import BACKENDS, ENGINES, GatedEngine, real_engine, run_within, until

KEY, PARENT = bytes(range(16)), bytes(range(100, 116))
GARBAGE = 0xA5
NATIVE = [False, True] if native_slots.available() else [False]
PIECE = OFFLOAD_BYTES  # the smallest piece that is staged on a worker thread, as in use


def _item(nbytes: int, seed: int = 0) -> PutItem:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    item = PutItem(KEY, PARENT, data, DTYPE_CODES[torch.uint8], (nbytes,))
    item.seq = 3
    return item


def _staged_whole(item: PutItem) -> bytes:
    arena = Arena(item.slot_len)
    try:
        run = arena.try_acquire(item.slot_len)
        assert run is not None
        slots.stage_all([(item, run)], native=False)
        return bytes(run.view)
    finally:
        arena.close()


@pytest.mark.parametrize("native", NATIVE)
@settings(max_examples=60, deadline=None)
@given(nbytes=st.integers(0, 6 * PAGE), cuts=st.lists(st.integers(1, 7), max_size=6))
def test_a_slot_staged_in_ranges_is_the_slot_staged_whole(native: bool, nbytes: int,
                                                          cuts: list[int]) -> None:
    item = _item(nbytes, seed=nbytes)
    want = _staged_whole(item)
    bounds = sorted({0, *(c * PAGE for c in cuts if c * PAGE < item.slot_len), item.slot_len})
    arena = Arena(item.slot_len)
    try:
        run = arena.try_acquire(item.slot_len)
        assert run is not None
        run.array[:] = GARBAGE  # every byte must be written or zeroed
        crc = 0
        for start, end in zip(bounds, bounds[1:]):
            crc = slots.stage_slot_range(run, item, start, end, crc, native=native)
        slots.stage_header(run, item, crc)
        assert bytes(run.view) == want
    finally:
        arena.close()


def _read_file(path: Path, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


@asynccontextmanager
async def _transfers(engine: IOEngine, path: Path, *, read_only: bool = False
                     ) -> AsyncIterator[tuple[Transfers, Arena]]:
    """Transfers over ``engine`` into one extent file (opened read-only: every write
    fails), with an arena of 8 pieces filled with garbage; all closed after."""
    await engine.start()
    arena = Arena(8 * PIECE)
    arena.array[:] = GARBAGE
    if read_only:
        (path / "extent").write_bytes(b"")
        fd = os.open(path / "extent", os.O_RDONLY)
    else:
        (path / "extent").touch()
        fd = engine.open_file(str(path / "extent"))
    try:
        yield Transfers(engine, arena, {1: fd}, piece_bytes=PIECE), arena
    finally:
        if read_only:
            os.close(fd)
        else:
            engine.close_file(fd)
        await engine.aclose()
        arena.close()


class Recording(GatedEngine):
    """A gated real engine that records each write call's (file offset, bytes)."""

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner)
        self.writes: list[tuple[int, int]] = []

    async def write(self, ops: Sequence[IoOp]) -> None:
        self.writes.extend((op.offset, op.run.length) for op in ops)
        await super().write(ops)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ENGINES)
def test_pieces_are_written_while_later_ones_are_staged_and_the_header_last(
        tmp_path: Path, kind: str, backend: str) -> None:
    item = _item(4 * PIECE + 3 * PAGE + 100, seed=1)  # four pieces, a short fifth
    item.extent, item.offset = 1, 8 * PAGE

    async def scenario() -> None:
        engine = Recording(real_engine(kind, tmp_path))
        async with _transfers(engine, tmp_path) as (transfers, arena):
            gate = engine.gate("write")
            seen: dict[str, bytes] = {}

            async def look() -> None:  # the first write arrives: what is staged so far?
                seen["last piece"] = bytes(arena.array[item.slot_len - PAGE:item.slot_len])
                seen["header"] = bytes(arena.array[:SLOT_HEADER_BYTES])

            gate.on_enter = look
            async with anyio.create_task_group() as tg:
                tg.start_soon(transfers.write, [item])
                await gate.entered.wait()
                # Every other piece and the header page go out while the first is held.
                await until(lambda: len(engine.writes) == 6)
                gate.open()
            assert seen == {"last piece": bytes([GARBAGE]) * PAGE,
                            "header": bytes([GARBAGE]) * SLOT_HEADER_BYTES}
            starts = [PAGE + i * PIECE for i in range(5)]
            assert sorted(engine.writes) == [(item.offset, PAGE)] + [
                (item.offset + s, min(PIECE, item.slot_len - s)) for s in starts]
            assert arena.free_bytes == arena.size
        on_disk = _read_file(tmp_path / "extent", item.offset, item.slot_len)
        assert on_disk == _staged_whole(_item(item.payload_len, seed=1))

    run_within(scenario, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ENGINES)
def test_a_cancelled_transfer_gives_its_staging_back(tmp_path: Path, kind: str,
                                                      backend: str) -> None:
    item = _item(3 * PIECE, seed=2)
    item.extent, item.offset = 1, 0

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with _transfers(engine, tmp_path) as (transfers, arena):
            gate = engine.gate("write")
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(transfers.write, [item])
                    await gate.entered.wait()
                    scope.cancel()
            assert scope.cancelled_caught
            assert arena.free_bytes == arena.size

    run_within(scenario, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ENGINES)
def test_a_failed_piece_fails_the_transfer_with_the_engines_error(
        tmp_path: Path, kind: str, backend: str) -> None:
    item = _item(3 * PIECE, seed=3)
    item.extent, item.offset = 1, 0

    async def scenario() -> None:
        engine = real_engine(kind, tmp_path)
        async with _transfers(engine, tmp_path, read_only=True) as (transfers, arena):
            with pytest.raises(StoreIOError):  # EBADF, not an exception group
                await transfers.write([item])
            assert arena.free_bytes == arena.size

    run_within(scenario, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_work_goes_to_a_worker_thread_unless_small_or_alone_and_below_the_lone_bound(
        backend: str) -> None:
    async def scenario() -> dict[tuple[int, bool], bool]:
        here = threading.get_ident()
        placed = {}
        for nbytes, alone in [(OFFLOAD_BYTES // 2, False), (OFFLOAD_BYTES, False),
                              (OFFLOAD_BYTES, True), (LONE_OFFLOAD_BYTES - PAGE, True),
                              (LONE_OFFLOAD_BYTES, True)]:
            ident = await offloaded(nbytes, threading.get_ident, alone=alone)
            placed[nbytes, alone] = ident != here
        return placed

    assert run_within(scenario, backend) == {
        (OFFLOAD_BYTES // 2, False): False, (OFFLOAD_BYTES, False): True,
        (OFFLOAD_BYTES, True): False, (LONE_OFFLOAD_BYTES - PAGE, True): False,
        (LONE_OFFLOAD_BYTES, True): True}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ENGINES)
def test_a_chunk_on_the_device_counts_as_in_flight_until_it_returns(
        tmp_path: Path, kind: str, backend: str) -> None:
    """Whether a chunk is staged / verified in place depends on the chunks in flight: one
    held on the device counts (another task's chunk beside it goes to a thread), and the
    count comes back to zero when it returns, is cancelled, or fails."""
    items = [_item(OFFLOAD_BYTES, seed=10 + i) for i in range(2)]
    for i, item in enumerate(items):
        item.extent, item.offset = 1, i * item.slot_len

    async def scenario() -> None:
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with _transfers(engine, tmp_path) as (transfers, arena):
            gate = engine.gate("write")
            async with anyio.create_task_group() as tg:
                tg.start_soon(transfers.write, [items[0]])
                await gate.entered.wait()
                assert transfers._chunks_active == 1
                await transfers.write([items[1]])  # beside the held one: not alone
                assert transfers._chunks_active == 1
                gate.open()
            assert transfers._chunks_active == 0
            gate = engine.gate("write")
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(transfers.write, [items[0]])
                    await gate.entered.wait()
                    scope.cancel()
            assert transfers._chunks_active == 0 and arena.free_bytes == arena.size
        for item in items:
            assert _read_file(tmp_path / "extent", item.offset, item.slot_len) == \
                _staged_whole(_item(item.payload_len, seed=10 + items.index(item)))

    run_within(scenario, backend)
