"""Two processes sharing a store add an extent at the same moment (issue 43): each gets
an id of its own, and neither replaces the other's file.

The allocator read ``next_extent`` outside any transaction and recorded it only after
the file was made: a second process growing meanwhile picked the same id, replaced the
first one's file (its half-initialised extent unlinked under it) and recorded it, and
the first one's commit then gave the same run to the free map twice.  The id is now
reserved in a transaction of its own before the file is made
(``Index.reserve_extent_id``).

The first grower is held inside its extent's initialisation by its I/O engine (a real
thread-pool engine that waits for the test before it initialises) while a real second
process, with an allocator of its own over the same index, grows the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from kvstore.core.allocator import Allocator
from kvstore.disk.format import EXTENT_HEADER_BYTES, PAGE, ExtentHeader
from kvstore.disk.layout import extent_path
from kvstore.index.index import Index, IndexWriter, init_meta
from kvstore.io.threads import ThreadPoolEngine

ROOT = Path(__file__).resolve().parents[2]
EXTENT = 17 * PAGE
UUID = b"u" * 16

SECOND = textwrap.dedent("""
    import sys, anyio
    from kvstore.core.allocator import Allocator
    from kvstore.index.index import Index, IndexWriter
    from kvstore.io.threads import ThreadPoolEngine
    PAGE = 4096
    path = sys.argv[1]
    class Slot:
        key, parent, slot_len, extent, offset = b"b" * 16, None, 16 * PAGE, 0, 0
    index = Index(path + "/index", map_size=1 << 24, sync=False)
    writer = IndexWriter(index)
    allocator = Allocator(
        path=path, index=index, writer=writer, engine=ThreadPoolEngine(direct=False),
        extent_bytes=17 * PAGE, store_uuid=b"u" * 16, capacity_bytes=64 * PAGE,
        file_mode=0o600,
        counters={"evicted_blocks": 0, "evicted_bytes": 0})
    async def main():
        allocator.start()
        slot = Slot()
        changes = await allocator.reserve([slot])
        print(slot.extent, *changes.new_extents)
    anyio.run(main)
    writer.close()
    index.close()
""")


class HeldInitialise(ThreadPoolEngine):
    """A thread-pool engine that waits for ``go`` before it initialises an extent."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.started = anyio.Event()
        self.go = anyio.Event()

    async def initialise(self, fd: int, nbytes: int, header: bytes) -> None:
        self.started.set()
        await self.go.wait()
        await super().initialise(fd, nbytes, header)


class _Slot:
    def __init__(self) -> None:
        self.key = b"a" * 16
        self.parent: bytes | None = None
        self.slot_len = 16 * PAGE
        self.extent = self.offset = 0


def grow_in_another_process(path: Path) -> tuple[int, int]:
    run = subprocess.run([sys.executable, "-c", SECOND, str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    slot_extent, new_extent = map(int, run.stdout.split())
    return slot_extent, new_extent


def header_id(path: Path, extent_id: int) -> int:
    with open(extent_path(str(path), extent_id), "rb") as f:
        return ExtentHeader.decode(f.read(EXTENT_HEADER_BYTES)).extent_id


@pytest.mark.anyio
async def test_two_processes_growing_at_once_get_two_extents(tmp_path: Path) -> None:
    index = Index(str(tmp_path / "index"), map_size=1 << 24, sync=False)
    writer = IndexWriter(index)
    try:
        writer.run_sync(lambda txn: init_meta(txn, index, store_uuid=UUID, extent_bytes=EXTENT))
        engine = HeldInitialise()
        allocator = Allocator(
            path=str(tmp_path), index=index, writer=writer, engine=engine,
            extent_bytes=EXTENT, store_uuid=UUID, capacity_bytes=64 * PAGE, file_mode=0o600,
            counters={"evicted_blocks": 0, "evicted_bytes": 0})
        allocator.start()
        mine = _Slot()
        theirs: tuple[int, int] = (0, 0)
        async with anyio.create_task_group() as tg:
            async def reserve() -> None:
                await allocator.reserve([mine])

            tg.start_soon(reserve)
            await engine.started.wait()  # our file is made, its extent not recorded yet
            theirs = await anyio.to_thread.run_sync(grow_in_another_process, tmp_path)
            engine.go.set()
        their_slot_extent, their_extent = theirs
        assert their_slot_extent == their_extent
        assert mine.extent != their_extent
        assert index.extents_list() == {mine.extent: EXTENT, their_extent: EXTENT}
        # each file is the one its grower initialised, under its own name
        assert header_id(tmp_path, mine.extent) == mine.extent
        assert header_id(tmp_path, their_extent) == their_extent
        assert sorted(os.listdir(tmp_path / "extents")) == sorted(
            os.path.basename(extent_path(str(tmp_path), e)) for e in (mine.extent, their_extent))
        # the free map and the claims (each grower claimed from its extent; owner 0
        # both: these allocators are no registered owners) hold each extent's run once
        # (ours minus nothing: the reservation is not committed)
        with index.begin() as txn:
            claimed = index.space.claims_of(txn, 0)
        assert sorted(index.free_runs() + claimed) == sorted(
            [(mine.extent, PAGE, EXTENT - PAGE), (their_extent, PAGE, EXTENT - PAGE)])
    finally:
        writer.close()
        index.close()
