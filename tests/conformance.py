"""The conformance suite every I/O engine passes, through the public store API.

Each engine's test module subclasses :class:`StoreConformance` and sets ``engine``
(zarr's ``StoreTests`` pattern); every test runs on asyncio and trio.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.testing import parts

NS = kvstore.Namespace(model="conformance", dtype="mixed", block_size=4)
SMALL_EXTENT = 4 << 20
"""Extent size for test stores: the 1 GiB default is fallocated for real, and dozens of
test stores would otherwise take tens of GB of the CI machine's disk."""

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.uint8, torch.int8, torch.float64, torch.int16,
              torch.int32, torch.int64, torch.bool]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float32) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g,
                         dtype=torch.int64).to(dtype)


def keys(n: int, start: int = 0) -> list[bytes]:
    return NS.chain_keys(list(range(start, start + 4 * n)))


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-exact equality, dtype and shape included (NaNs compare by bits)."""
    return (a is not None and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def flip_payload_bit(store_path: Path, entry: Any, at: int = 100, mask: int = 0x10) -> None:
    """Corrupt a stored block on disk: flip bits of its payload byte ``at`` (the store
    must be closed: it reads with O_DIRECT, past the page cache this writes to)."""
    with open(extent_path(str(store_path), entry.extent), "r+b") as f:
        f.seek(entry.offset + SLOT_HEADER_BYTES + at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))


@pytest.mark.anyio
class StoreConformance:
    engine: ClassVar[str]

    def engine_option(self) -> Any:
        """What to pass as ``open(engine=...)``: a name, or an engine instance."""
        return self.engine

    def open(self, path: Path, **options: Any) -> Any:
        options.setdefault("extent_bytes", 8 << 20)
        options.setdefault("staging_bytes", 8 << 20)
        return kvstore.open(path, namespace=NS, engine=self.engine_option(), **options)

    async def test_engine_is_the_one_asked_for(self, tmp_path: Path) -> None:
        async with self.open(tmp_path) as store:
            assert store.stats().engine == self.engine

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
    async def test_roundtrip_every_dtype(self, tmp_path: Path, dtype: torch.dtype) -> None:
        shapes = [(2, 4, 3, 8), (7,), (), (0, 5), (1, 1, 1, 1, 1, 1, 1, 1)]
        values = [make_tensor(dtype, s, i) for i, s in enumerate(shapes)]
        ks = keys(len(values))
        async with self.open(tmp_path) as store:
            result = await store.put_many(ks, values)
            assert result.written == len(values)
            got = await store.get_many(ks)
        assert all(same(g, v) for g, v in zip(got, values))

    async def test_non_contiguous_input_roundtrips_as_its_values(self, tmp_path: Path) -> None:
        base = make_tensor(torch.float16, (16, 8, 4), 1)
        value = base.transpose(0, 2)[:, ::2]
        assert not value.is_contiguous()
        async with self.open(tmp_path) as store:
            await store.put(keys(1)[0], value)
            got = await store.get(keys(1)[0])
        assert same(got, value.contiguous())

    async def test_batches_of_mixed_sizes(self, tmp_path: Path) -> None:
        ks = keys(60)
        values = [make_tensor(torch.bfloat16, (1 + (i * 37) % 3000,), i) for i in range(60)]
        async with self.open(tmp_path) as store:
            await store.put_many(ks, values)
            got = await store.get_many(ks[::-1])
        assert all(same(g, v) for g, v in zip(got, values[::-1]))

    async def test_missing_keys_are_none(self, tmp_path: Path) -> None:
        ks = keys(6)
        values = [make_tensor(torch.float32, (10,), i) for i in range(6)]
        async with self.open(tmp_path) as store:
            await store.put_many(ks[::2], values[::2])
            got = await store.get_many(ks)
            assert await store.contains_many(ks) == [True, False] * 3
            assert await store.get(bytes(16)) is None
            assert store.stats().misses == 4
        for i, g in enumerate(got):
            assert same(g, values[i]) if i % 2 == 0 else g is None

    async def test_match_prefix(self, tmp_path: Path) -> None:
        ks = keys(10)
        values = [make_tensor(torch.float16, (8,), i) for i in range(10)]
        async with self.open(tmp_path) as store:
            assert await store.match_prefix(ks) == 0
            await store.put_many(ks[:7], values[:7], parents=kvstore.chain_parents(ks[:7]))
            assert await store.match_prefix(ks) == 7
            assert await store.match_prefix(ks[:5]) == 5
            assert await store.match_prefix([]) == 0
            await store.delete(ks[3])
            assert await store.match_prefix(ks) == 3  # a hole ends the usable prefix

    async def test_delete_frees_and_reuses_space(self, tmp_path: Path) -> None:
        ks = keys(20)
        values = [make_tensor(torch.uint8, (100_000,), i) for i in range(20)]
        async with self.open(tmp_path) as store:
            empty_free = None
            await store.put_many(ks, values)
            full = store.stats()
            assert await store.delete_many(ks[:10] + ks[:3]) == 10
            assert await store.delete_many(ks[:10]) == 0
            after = store.stats()
            assert after.blocks == 10 and after.free_bytes > full.free_bytes
            got = await store.get_many(ks)
            assert got[:10] == [None] * 10
            assert all(same(g, v) for g, v in zip(got[10:], values[10:]))
            await store.put_many(ks[:10], values[:10])
            assert store.stats().free_bytes == full.free_bytes  # the freed runs were reused
            assert empty_free is None
            assert all(same(g, v) for g, v in zip(await store.get_many(ks), values))

    async def test_reopen_finds_every_block(self, tmp_path: Path) -> None:
        ks = keys(30)
        values = [make_tensor(torch.float16, (3, 64), i) for i in range(30)]
        async with self.open(tmp_path) as store:
            await store.put_many(ks, values, parents=kvstore.chain_parents(ks))
            await store.delete_many(ks[20:25])
        async with self.open(tmp_path) as store:
            got = await store.get_many(ks)
            assert store.stats().blocks == 25
            assert await store.match_prefix(ks) == 20
        for i, g in enumerate(got):
            assert g is None if 20 <= i < 25 else same(g, values[i])

    async def test_concurrent_tasks(self, tmp_path: Path) -> None:
        """Tasks putting overlapping key sets and reading at once: every key stored once."""
        ks = keys(48)
        values = [make_tensor(torch.float32, (512 + i,), i) for i in range(48)]
        results: list[kvstore.PutResult] = []
        reads: list[list[torch.Tensor | None]] = []
        async with self.open(tmp_path, staging_bytes=1 << 20) as store:
            async def writer(lo: int) -> None:
                results.append(await store.put_many(ks[lo:lo + 24], values[lo:lo + 24]))

            async def reader() -> None:
                reads.append(await store.get_many(ks))

            async with anyio.create_task_group() as tg:
                for lo in (0, 8, 16, 24, 0, 24):
                    tg.start_soon(writer, lo)
                tg.start_soon(reader)
            got = await store.get_many(ks)
            assert store.stats().blocks == 48
        assert sum(r.written for r in results) == 48
        assert sum(r.written + r.deduplicated for r in results) == 6 * 24
        assert all(same(g, v) for g, v in zip(got, values))
        assert all(g is None or same(g, v) for g, v in zip(reads[0], values))

    async def test_get_into_caller_tensors(self, tmp_path: Path) -> None:
        ks = keys(3)
        values = [make_tensor(torch.bfloat16, (4, 6), i) for i in range(3)]
        outs = [torch.empty(4, 6, dtype=torch.bfloat16), torch.empty(24, dtype=torch.bfloat16),
                torch.empty(6, 4, dtype=torch.bfloat16).t()]  # non-contiguous, same numel
        async with self.open(tmp_path) as store:
            await store.put_many(ks, values)
            got = await store.get_many(ks, out=outs)
            assert all(g is o for g, o in zip(got, outs))
            assert torch.equal(outs[0], values[0])
            assert torch.equal(outs[1], values[1].reshape(-1))
            assert torch.equal(outs[2], values[2].reshape(4, 6))
            with pytest.raises(kvstore.OutputMismatchError):
                await store.get_many(ks[:1], out=[torch.empty(4, 6, dtype=torch.float16)])
            with pytest.raises(kvstore.OutputMismatchError):
                await store.get_many(ks[:1], out=[torch.empty(5, dtype=torch.bfloat16)])

    async def test_duplicate_puts_write_nothing(self, tmp_path: Path) -> None:
        ks = keys(4)
        values = [make_tensor(torch.float16, (1000,), i) for i in range(4)]
        async with self.open(tmp_path) as store:
            first = await store.put_many(ks + ks[:2], values + values[:2])
            before = store.stats()
            again = await store.put_many(ks, values)
            after = store.stats()
        assert (first.written, first.deduplicated) == (4, 2)
        assert (again.written, again.deduplicated) == (0, 4)
        assert after.free_bytes == before.free_bytes
        assert after.dedup_bytes == 6 * 2000

    async def test_arena_smaller_than_batch(self, tmp_path: Path) -> None:
        """A batch many times the staging arena streams through it."""
        ks = keys(40)
        values = [make_tensor(torch.uint8, (200_000,), i) for i in range(40)]
        async with self.open(tmp_path, staging_bytes=1 << 20) as store:
            await store.put_many(ks, values)
            got = await store.get_many(ks)
        assert all(same(g, v) for g, v in zip(got, values))

    async def test_grows_across_extents(self, tmp_path: Path) -> None:
        ks = keys(40)
        values = [make_tensor(torch.uint8, (150_000,), i) for i in range(40)]
        async with self.open(tmp_path, extent_bytes=1 << 20) as store:
            await store.put_many(ks, values)
            assert store.stats().extents >= 6
        async with self.open(tmp_path) as store:
            got = await store.get_many(ks)
        assert all(same(g, v) for g, v in zip(got, values))

    async def test_corrupt_payload_is_a_miss_and_quarantined(self, tmp_path: Path) -> None:
        ks = keys(3)
        values = [make_tensor(torch.float16, (2048,), i) for i in range(3)]
        async with self.open(tmp_path) as store:
            await store.put_many(ks, values)
            entry = parts(store).index.get_entries([ks[1]])[0]
        assert entry is not None
        flip_payload_bit(tmp_path, entry)
        async with self.open(tmp_path) as store:
            got = await store.get_many(ks)
            stats = store.stats()
            assert (stats.corrupt_blocks, stats.quarantined, stats.blocks) == (1, 1, 2)
            assert await store.get(ks[1]) is None
        assert got[1] is None
        assert same(got[0], values[0]) and same(got[2], values[2])

    async def test_blocking_facade_from_threads(self, tmp_path: Path) -> None:
        ks = keys(16)
        values = [make_tensor(torch.float32, (256,), i) for i in range(16)]

        def work() -> list[torch.Tensor | None]:
            with kvstore.open_blocking(tmp_path, namespace=NS, engine=self.engine_option(),
                                       extent_bytes=8 << 20) as store:
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda i: store.put(ks[i], values[i]), range(16)))
                assert store.stats().blocks == 16
                assert store.match_prefix(ks) == 16
                return store.get_many(ks)

        got = await anyio.to_thread.run_sync(work)
        assert all(same(g, v) for g, v in zip(got, values))

    async def test_event_loop_stays_responsive_during_a_large_batch(self, tmp_path: Path) -> None:
        """Another task keeps getting scheduled while 64 MiB are put and read back."""
        ks = keys(32)
        values = [make_tensor(torch.uint8, (2 << 20,), i) for i in range(32)]
        ticks = 0
        done = anyio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await anyio.sleep(0)

        async with self.open(tmp_path, extent_bytes=128 << 20, staging_bytes=16 << 20) as store:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                await anyio.sleep(0)
                start = ticks
                await store.put_many(ks, values)
                mid = ticks
                got = await store.get_many(ks)
                end = ticks
                done.set()
        assert mid - start >= 32, "the ticker was starved while the put was in flight"
        assert end - mid >= 32, "the ticker was starved while the get was in flight"
        assert all(same(g, v) for g, v in zip(got, values))
