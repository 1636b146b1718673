"""Read marks across the owners of one store (kvstore/core/read_marks.py,
kvstore/io/marks.py; issue 43's DESIGN 7.1-7.3): a range one owner frees is not reused
while a read of another owner that looked it up may still copy it, and is reused once
that read ended; mark slots are taken at registration and cleared by a dead owner's
recovery; without the native helper a store works alone and refuses a second owner.

Two Stores of this process on one path are two owners.
A read is held at a gate of its owner's engine between its lookup and its slot read."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvstore
import kvstore.core.owners
from kvstore.core.read_marks import ReadMarks
from kvstore.io import marks
from kvstore.io.marks import NO_MARK, MarksFile
from kvstore.testing import parts, waiting_reserves
from kvstore.tools import fsck
from tests.concurrency import DEADLINE, GatedEngine, real_engine, until
from tests.conformance import NS, keys, same
from tests.core.test_owners import ROOT, killed_at
from tests.core.test_pending_space import pending, slot, tiled

OPEN = {"namespace": NS, "extent_bytes": 1 << 20}
VALUE = torch.arange(4096, dtype=torch.float32)  # every put here is this size

needs_helper = pytest.mark.skipif(not marks.native()[0], reason=marks.native()[1])


@needs_helper
@pytest.mark.parametrize("reader", ["first", "second"])  # the owner opened first reads, or not
def test_a_read_in_one_owner_keeps_what_another_freed_pending_until_it_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    k, other, third = keys(3)

    async def scenario() -> None:
        engine = GatedEngine(real_engine("threads", tmp_path))
        gated = {"engine": engine, **OPEN}
        plain = {"engine": "threads", **OPEN}
        async with kvstore.open(tmp_path, **(gated if reader == "first" else plain)) as s1, \
                kvstore.open(tmp_path, **(plain if reader == "first" else gated)) as s2:
            a, b = (s1, s2) if reader == "first" else (s2, s1)  # a reads, b frees
            index = parts(b).index
            await b.put(k, VALUE)
            old = slot(index.get_entries([k])[0])
            gate = engine.gate("read")
            got: list[torch.Tensor | None] = []
            with anyio.fail_after(DEADLINE):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: _get_into(a, k, got))
                    await gate.entered.wait()  # a looked k up: its mark is published
                    assert parts(a).owner.marks.published > 0
                    assert await b.delete(k)
                    await b.put(other, VALUE)  # the same size: best fit would be old
                    assert slot(index.get_entries([other])[0]) != old
                    assert pending(index) == [old] and tiled(index)
                    gate.open()
            assert len(got) == 1 and same(got[0], VALUE)  # the bytes it looked up
            assert parts(a).owner.marks.published == 0  # withdrawn when the read ended
            assert a.stats().raced_reads == 0 and a.stats().corrupt_blocks == 0
            await b.put(third, VALUE)  # no read holds it now: reused, and ripened
            assert slot(index.get_entries([third])[0]) == old
            assert pending(index) == [] and tiled(index)
            assert same(await a.get(third), VALUE) and same(await b.get(other), VALUE)
        report = fsck.check(str(tmp_path))
        assert report.findings == [], [f.detail for f in report.findings]

    anyio.run(scenario)


async def _get_into(store: kvstore.Store, key: bytes, got: list[torch.Tensor | None]) -> None:
    got.append(await store.get(key))


def open_here(path: Path) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, engine="threads", **OPEN)


def slots_of(store: kvstore.BlockingStore) -> dict[int, int]:
    """owner id -> mark slot, from the ``owners`` rows."""
    index = parts(store).index
    with index.begin() as txn:
        return {i: r.mark_slot for i, r in index.owner_records.rows(txn).items()}


@needs_helper
def test_owners_take_the_lowest_free_mark_slot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = open_here(tmp_path)
    b = open_here(tmp_path)
    with b:
        with a:
            assert slots_of(a) == {parts(a).owner.id: 1, parts(b).owner.id: 2}
        with open_here(tmp_path) as c:  # a's slot is free again
            assert slots_of(c) == {parts(b).owner.id: 2, parts(c).owner.id: 1}


READER = textwrap.dedent("""
    import sys, torch, kvstore
    from kvstore.testing import parts, waiting_reserves
    from tests.conformance import NS, keys
    store = kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                                  engine="threads")
    store.put_many(keys(1), [torch.ones(16)])
    parts(store).owner.marks.begin()  # a read in flight, never ended: killed meanwhile
    print("reading", flush=True)
    sys.stdin.readline()
""")


@needs_helper
def test_a_killed_owners_frozen_mark_is_cleared_by_its_recovery(tmp_path: Path) -> None:
    killed_at(READER, tmp_path, "reading\n")
    frozen = MarksFile.open(str(tmp_path))
    try:
        assert frozen.minimum() != NO_MARK and frozen.mark(1) > 0  # it holds the horizon
        with open_here(tmp_path) as store:
            assert parts(store).owner.recovered == 1
            assert frozen.mark(1) == 0 and frozen.minimum() == NO_MARK
            assert slots_of(store) == {parts(store).owner.id: 1}
    finally:
        frozen.close()
    assert fsck.check(str(tmp_path)).findings == []


def test_without_the_native_helper_a_store_works_alone_and_refuses_a_second_owner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marks, "_lib", None)
    monkeypatch.setattr(marks, "_reason", "not built (test)")
    k, other = keys(2)
    with open_here(tmp_path) as store:
        p = parts(store)
        assert not p.owner.marks.enabled and slots_of(store) == {p.owner.id: 0}
        store.put_many([k], [VALUE])
        old = slot(p.index.get_entries([k])[0])
        store.delete_many([k])
        store.put_many([other], [VALUE])  # today's local rule: no read holds it
        assert slot(p.index.get_entries([other])[0]) == old
        with pytest.raises(kvstore.StoreLockedError, match="native fence helper.*not built"):
            open_here(tmp_path)
        assert same(store.get_many([other])[0], VALUE)
    assert fsck.check(str(tmp_path)).findings == []


MARKER = textwrap.dedent("""
    import sys, kvstore, kvstore.core.owners
    from kvstore.testing import parts, waiting_reserves
    from tests.conformance import NS
    with kvstore.open_blocking(sys.argv[1], namespace=NS, extent_bytes=1 << 20,
                               engine="threads") as store:
        marks = parts(store).owner.marks
        mark = marks.begin()  # what a get of this process publishes before its lookup
        print("marked", flush=True)
        sys.stdin.readline()
        marks.end(mark)
        print("ended", flush=True)
        sys.stdin.readline()
""")


@needs_helper
def test_a_read_mark_of_another_process_keeps_a_freed_range_pending(tmp_path: Path) -> None:
    """The mark crosses processes through the shared mapping, fenced on both sides."""
    k, other, third = keys(3)
    with open_here(tmp_path) as store:
        index = parts(store).index
        store.put_many([k], [VALUE])
        old = slot(index.get_entries([k])[0])
        child = subprocess.Popen([sys.executable, "-c", MARKER, str(tmp_path)], cwd=ROOT,
                                 text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "marked\n"
            store.delete_many([k])
            store.put_many([other], [VALUE])  # the child may still copy k's slot
            assert slot(index.get_entries([other])[0]) != old and pending(index) == [old]
            child.stdin.write("end\n")
            child.stdin.flush()
            assert child.stdout.readline() == "ended\n"
            store.put_many([third], [VALUE])  # no reader anywhere: reused
            assert slot(index.get_entries([third])[0]) == old and pending(index) == []
            child.stdin.write("close\n")
            child.stdin.flush()
            assert child.wait(timeout=DEADLINE) == 0
        finally:
            child.kill()
            child.wait()
            child.stdin.close()
            child.stdout.close()
    assert fsck.check(str(tmp_path)).findings == []


@needs_helper
def test_a_put_short_of_space_waits_for_another_owners_read_not_evicting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capacity for two blocks: the freed one is pending while the other owner reads
    it, so the put waits for that read (it polls the horizon) instead of evicting."""
    k, kept, new = keys(3)

    async def scenario() -> None:
        engine = GatedEngine(real_engine("threads", tmp_path))
        async with kvstore.open(tmp_path, engine=engine, **OPEN) as a, \
                kvstore.open(tmp_path, engine="threads", capacity_bytes=2 * 20480,
                             **OPEN) as b:
            await b.put_many([k, kept], [VALUE, VALUE])
            old = slot(parts(b).index.get_entries([k])[0])
            assert old[2] == 20480
            gate = engine.gate("read")
            got: list[torch.Tensor | None] = []
            put_done = anyio.Event()

            async def put() -> None:
                await b.put(new, VALUE)
                put_done.set()

            with anyio.fail_after(DEADLINE):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: _get_into(a, k, got))
                    await gate.entered.wait()
                    assert await b.delete(k)
                    tg.start_soon(put)
                    await until(lambda: waiting_reserves(parts(b).allocator) > 0
                                or put_done.is_set())
                    assert not put_done.is_set()
                    assert parts(b).allocator.pending_free_bytes == 20480
                    gate.open()
            assert same(got[0], VALUE)
            assert slot(parts(b).index.get_entries([new])[0]) == old
            assert b.stats().evicted_blocks == 0 and await b.contains(kept)

    anyio.run(scenario)


@needs_helper
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=40))
def test_an_owners_mark_is_the_oldest_read_in_flight(
        tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[bool, int]]) -> None:
    """Reads begin as the snapshot id grows and end in any order: the slot holds the
    oldest mark in flight (0: none), and a detached owner publishes nothing more."""
    path = tmp_path_factory.mktemp("marks")
    (path / "owners").mkdir()
    file = MarksFile.open(str(path))
    try:
        newest = [1]
        owner = ReadMarks(file, 5, lambda: newest[0])
        in_flight: list[int] = []
        for begin, pick in steps:
            if begin or not in_flight:
                newest[0] += pick  # (commits meanwhile, or none)
                in_flight.append(owner.begin())
            else:
                owner.end(in_flight.pop(pick % len(in_flight)))
            assert file.mark(5) == owner.published == min(in_flight, default=0)
            assert file.minimum() == min(in_flight, default=NO_MARK)
        owner.detach()
        for mark in in_flight:
            owner.end(mark)
        assert file.mark(5) == min(in_flight, default=0)  # left for the close to clear
    finally:
        file.close()
