"""A caller's tag per block (``put_many(tags=)``, kvstore/index/tags.py): written with the
block's index entry, given back by the snapshot and the events, dropped with the block,
kept through quarantine and back with a restore; bad tags refused before any I/O."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvstore
from kvstore import BlockEvent
from kvstore.errors import StoreIOError
from kvstore.index.tags import MAX_TAG_BYTES
from kvstore.io.protocol import EngineWrapper, IoOp
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.concurrency import GatedEngine, real_engine
from tests.conformance import NS
from tests.core.test_events import SLOT, chain, drain, opened, value
from tests.read_faults import ReadFaults, open_faulty


def tag(i: int) -> bytes:
    return b"scope-A/" + i.to_bytes(4, "big") * 8


def tags_in_table(store: kvstore.Store) -> dict[bytes, bytes]:
    """Every row of the tags table (through the table, not the snapshot)."""
    index = parts(store).index
    with index.begin() as txn, txn.cursor(index.tags._tags) as cur:
        return {bytes(k): bytes(v) for k, v in cur}


async def snapshot(store: kvstore.Store, **options: Any) -> dict[bytes, bytes | None]:
    return {b.key: b.tag async for page in store.snapshot(**options) for b in page}


def tag_events(items: Sequence[object]) -> list[tuple[str, bytes, bytes | None]]:
    return [(e.kind, e.key, e.tag) for e in items if isinstance(e, BlockEvent)]


@pytest.mark.anyio
async def test_tags_round_trip_through_put_events_snapshot_and_a_reopen(tmp_path: Path) -> None:
    ks = chain(4)
    tags = [tag(0), None, tag(2), b""]  # (an empty tag is a tag)
    async with opened(tmp_path) as store, store.subscribe() as sub:
        await store.put_many(ks, [value(i) for i in range(4)],
                             parents=kvstore.chain_parents(ks), tags=tags)
        assert tag_events(drain(sub)) == [("stored", k, t) for k, t in zip(ks, tags)]
        assert await snapshot(store) == dict(zip(ks, tags))
    async with opened(tmp_path) as store:
        assert await snapshot(store) == dict(zip(ks, tags))
        # the scope filter: a prefix of the tag; untagged blocks are left out
        assert await snapshot(store, tag_prefix=b"scope-A/", page_blocks=1) == \
            {ks[0]: tag(0), ks[2]: tag(2)}
        assert await snapshot(store, tag_prefix=b"") == {k: t for k, t in zip(ks, tags)
                                                          if t is not None}
        assert await snapshot(store, tag_prefix=b"scope-B/") == {}
        pages = [[b.key for b in p] async for p in
                 store.snapshot(page_blocks=1, order="parents_first", tag_prefix=b"s")]
        # (ks[1], untagged, is left out: ks[2] starts a chain then; starts in key order)
        assert pages == [[k] for k in sorted([ks[0], ks[2]])]


@pytest.mark.anyio
async def test_a_stored_key_keeps_its_tag_and_a_batch_takes_the_first(tmp_path: Path) -> None:
    a, b, c = chain(3)
    async with opened(tmp_path) as store, store.subscribe() as sub:
        await store.put(a, value(0), tag=b"first")
        # deduplicated: nothing is written, the tag included
        assert not await store.put(a, value(0), tag=b"second")
        await store.put_many([a], [value(0)])  # (and no tag does not drop it)
        # a key twice in one batch is written once, with the first tag given for it
        await store.put_many([b, b, c, c], [value(1), value(1), value(2), value(2)],
                             tags=[None, b"b1", b"c1", b"c2"])
        assert tag_events(drain(sub)) == [("stored", a, b"first"), ("stored", b, b"b1"),
                                          ("stored", c, b"c1")]
        assert tags_in_table(store) == {a: b"first", b: b"b1", c: b"c1"}


@pytest.mark.anyio
async def test_a_tag_goes_with_its_block_deleted_or_evicted(tmp_path: Path) -> None:
    ks = chain(6)
    async with opened(tmp_path, capacity_bytes=4 * SLOT) as store, store.subscribe() as sub:
        await store.put_many(ks[:3], [value(i) for i in range(3)],
                             parents=kvstore.chain_parents(ks[:3]), tags=[tag(i) for i in range(3)])
        assert await store.delete_many([ks[2]]) == 1
        # one chain of 4 more: the oldest leaves (a, then b, leaves before children)
        await store.put_many(ks[3:], [value(i) for i in range(3, 6)],
                             tags=[tag(i) for i in range(3, 6)])
        got = tag_events(drain(sub))
        assert ("deleted", ks[2], tag(2)) in got
        evicted = [(k, t) for kind, k, t in got if kind == "evicted"]
        assert evicted and all(t == tag(ks.index(k)) for k, t in evicted)
        stored = await snapshot(store)
        assert tags_in_table(store) == stored == {k: tag(ks.index(k)) for k in stored}
    assert fsck.check(str(tmp_path / "store")).findings == []


def test_a_tag_is_kept_through_quarantine_and_back_with_the_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ks = chain(2)

    async def scenario() -> None:
        faults = ReadFaults()
        async with open_faulty("simulated", tmp_path, faults, monkeypatch, namespace=NS,
                               extent_bytes=1 << 20, staging_bytes=1 << 20) as store, \
                store.subscribe() as sub:
            parts(store).rechecks.delays = (3600.0,)  # only the scrub reads it again
            await store.put_many(ks, [value(0), value(1)], tags=[b"t0", b"t1"])
            entry = parts(store).index.get_entries([ks[1]])[0]
            assert entry is not None
            faults.aim(store.path, entry, None)
            assert (await store.get_many(ks))[1] is None
            assert tags_in_table(store) == {ks[0]: b"t0", ks[1]: b"t1"}  # kept
            assert await snapshot(store) == {ks[0]: b"t0"}
            faults.clear()
            await store.scrub(rate_bytes_per_s=None)
            assert tag_events(drain(sub))[2:] == [("quarantined", ks[1], b"t1"),
                                                  ("restored", ks[1], b"t1")]
            assert await snapshot(store) == {ks[0]: b"t0", ks[1]: b"t1"}

    anyio.run(scenario)


class FailingWrites(EngineWrapper):
    """Every write fails with EIO once armed."""

    armed = False

    async def write(self, ops: Sequence[IoOp]) -> None:
        if self.armed:
            raise StoreIOError(errno.EIO, "write failed: Input/output error (injected)")
        await self.inner.write(ops)


@pytest.mark.anyio
async def test_a_failed_put_leaves_no_tag(tmp_path: Path) -> None:
    engine = FailingWrites(real_engine("threads", tmp_path / "store"))
    a, b = chain(2)
    async with opened(tmp_path, engine=engine) as store:
        await store.put(a, value(0), tag=b"kept")
        engine.armed = True
        with pytest.raises(StoreIOError):
            await store.put(b, value(1), tag=b"lost")
        assert tags_in_table(store) == {a: b"kept"}


@pytest.mark.anyio
@pytest.mark.parametrize("stage", ["write", "datasync"])
async def test_a_cancelled_put_leaves_its_tag_only_with_its_block(tmp_path: Path,
                                                                  stage: str) -> None:
    """Cancelled while its slot is written (it is then absent) or synced (the shared sync
    is shielded: the put then commits whole): the tag is there exactly when the block is."""
    engine = GatedEngine(real_engine("threads", tmp_path / "store"))
    a, b = chain(2)
    async with opened(tmp_path, engine=engine) as store:
        await store.put(a, value(0), tag=b"kept")
        gate = engine.gate(stage)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: store.put(b, value(1), tag=b"b"))
            await gate.entered.wait()
            tg.cancel_scope.cancel()
            gate.open()
        stored = await store.contains(b)
        assert stored == (stage == "datasync")
        assert tags_in_table(store) == {a: b"kept", **({b: b"b"} if stored else {})}
        assert await snapshot(store) == tags_in_table(store)


@pytest.mark.parametrize(("tags", "match"), [
    (b"tag", "not a single bytes"),
    ("tag", "not a single str"),
    (42, "sequence of bytes or None"),
    ([b"a"], "2 keys but 1 tags"),
    ([b"a", "b"], "tag 1 must be bytes or None, got str"),
    ([b"a", 7], "tag 1 must be bytes or None, got int"),
    ([None, b"x" * (MAX_TAG_BYTES + 1)], f"tag 1 is {MAX_TAG_BYTES + 1} bytes"),
])
def test_bad_tags_are_refused_before_any_io(tmp_path: Path, tags: object, match: str) -> None:
    ks = chain(2)
    with kvstore.open_blocking(tmp_path / "store", namespace=NS, extent_bytes=1 << 20,
                               staging_bytes=1 << 20) as store:
        with pytest.raises(kvstore.InvalidTagError, match=match) as raised:
            store.put_many(ks, [value(0), value(1)], tags=tags)  # type: ignore[arg-type]
        assert isinstance(raised.value, ValueError)
        assert store.contains_many(ks) == [False, False]
        assert store.stats().puts == 0
        with pytest.raises(ValueError, match="tag_prefix"):
            store.snapshot(tag_prefix="scope")  # type: ignore[arg-type]
        # the largest tag, and views of bytes, are taken
        store.put(ks[0], value(0), tag=b"x" * MAX_TAG_BYTES)
        store.put_many([ks[1]], [value(1)], tags=[memoryview(b"view")])
        assert {b.key: b.tag for p in store.snapshot() for b in p} == \
            {ks[0]: b"x" * MAX_TAG_BYTES, ks[1]: b"view"}
