"""The I/O engine is the only road to a store's bytes: a fault or a crash of the
simulated engine reaches every read and write a store makes, the remote tier's reads
of a block to upload and the making of a new extent file included (both went around
the engine before: a read on a worker thread with its own descriptor, and a file
preallocated and initialised with plain system calls, where no simulated fault or
crash could reach them)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvstore
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.disk.layout import extents_dir
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.coalesce import READ_RETRY_DELAYS_S
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine, is_simulated_crash
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, keys, make_tensor

OPTIONS: dict[str, Any] = dict(extent_bytes=64 << 10, staging_bytes=1 << 20, namespace=NS)
VALUE = make_tensor(torch.float16, (4000,), 1)


@pytest.mark.anyio
async def test_a_read_fault_reaches_the_read_of_a_block_to_upload(tmp_path: Path) -> None:
    disk = SimulatedDisk(seed=1)
    (key,) = keys(1)
    async with kvstore.open(tmp_path, engine=SimulatedEngine(disk), **OPTIONS) as store:
        await store.put_many([key], [VALUE])
        buffer = AlignedBuffer()
        # every attempt fails: the first read and each retry
        disk.faults = [("read", errno.EIO)] * (len(READ_RETRY_DELAYS_S) + 1)
        assert await parts(store).reads.read_slot(key, buffer) is None
        assert disk.faults == []  # each attempt went through the engine
        got = await parts(store).reads.read_slot(key, buffer)
        assert got is not None
        view, header = got
        assert header.key == key and header.raw_len == VALUE.numel() * VALUE.element_size()
        assert len(view) == SLOT_HEADER_BYTES + header.payload_len


@pytest.mark.anyio
async def test_no_room_for_a_new_extent_reaches_the_put_and_leaves_no_file(
        tmp_path: Path) -> None:
    disk = SimulatedDisk(seed=2, faults=[("initialise", errno.ENOSPC)])
    (key,) = keys(1)
    async with kvstore.open(tmp_path, engine=SimulatedEngine(disk), **OPTIONS) as store:
        with pytest.raises(kvstore.StoreFullError):
            await store.put_many([key], [VALUE])
        assert not os.listdir(extents_dir(str(tmp_path)))  # its space went back
        await store.put_many([key], [VALUE])  # the disk has room again: the store goes on
        (got,) = await store.get_many([key])
        assert got is not None and torch.equal(got, VALUE)


@pytest.mark.parametrize("crash_at", [1, 2])  # the extent's initialise; the slot's write
def test_a_crash_while_a_new_extent_is_made_leaves_only_what_fsck_reclaims(
        tmp_path: Path, crash_at: int) -> None:
    (key,) = keys(1)

    async def put() -> None:
        disk = SimulatedDisk(seed=3, crash_at=crash_at)
        async with kvstore.open(tmp_path, engine=SimulatedEngine(disk), **OPTIONS) as store:
            await store.put_many([key], [VALUE])

    with pytest.raises(BaseException) as crashed:
        anyio.run(put)
    assert is_simulated_crash(crashed.value)
    assert not fsck.check(str(tmp_path), deep=True).damage

    async def reopen() -> None:
        async with kvstore.open(tmp_path, engine=SimulatedEngine(SimulatedDisk()),
                                **OPTIONS) as store:
            assert await store.get_many([key]) == [None]
            await store.put_many([key], [VALUE])
            (got,) = await store.get_many([key])
            assert got is not None and torch.equal(got, VALUE)

    anyio.run(reopen)
    assert fsck.check(str(tmp_path), deep=True).findings == []
