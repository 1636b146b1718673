"""The scrub: every stored slot read again and verified beside live traffic
(``Store.scrub``, ``open(scrub_bytes_per_s=...)``, kvstore/core/scrub.py).

It finds exactly the damaged blocks and nothing else, puts back a quarantined block that
reads whole again, resumes where it stopped after a restart, stops cleanly when
cancelled or when the store closes, and is correct while puts, deletes and evictions
run beside it.  On io_uring, the thread pool and the simulated engine.
"""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import pytest
import torch

import kvstore
import kvstore.core.scrub
from kvstore.disk.format import IndexEntry
from kvstore.io.simulated import SimulatedDisk, SimulatedEngine
from kvstore.testing import parts, rechecks_idle, scrub_passes, waiting_reserves
from kvstore.tools import fsck
from tests.concurrency import GatedEngine, real_engine, until
from tests.conformance import flip_payload_bit
from tests.read_faults import ENGINES, ReadFaults, open_faulty

FLOATS = 8 << 10  # 16 KiB blocks (fp16): 20 KiB slots
OPEN = dict(extent_bytes=4 << 20, staging_bytes=8 << 20)


def _keys(n: int, start: int = 0) -> list[bytes]:
    return [(start + i).to_bytes(4, "big") * 4 for i in range(n)]


def _value(i: int) -> torch.Tensor:
    return (torch.arange(FLOATS, dtype=torch.float32) % 97 + i).to(torch.float16)


def _engine(kind: str, path: Path, seed: int = 1) -> kvstore.io.protocol.IOEngine:
    return SimulatedEngine(SimulatedDisk(seed=seed)) if kind == "simulated" \
        else real_engine(kind, path)


async def _fill(path: Path, kind: str, n: int, **opened: object) -> list[IndexEntry]:
    async with kvstore.open(path, engine=_engine(kind, path), **{**OPEN, **opened}) as store:
        await store.put_many(_keys(n), [_value(i) for i in range(n)])
        entries = parts(store).index.get_entries(_keys(n))
    assert all(e is not None for e in entries)
    return [e for e in entries if e is not None]


async def _all_read_back(store: kvstore.Store, keys: list[bytes], values: list[int],
                         missing: set[bytes] = frozenset()) -> None:  # type: ignore[assignment]
    got = await store.get_many(keys)
    for key, i, g in zip(keys, values, got):
        if key in missing:
            assert g is None
        else:
            assert g is not None and torch.equal(g, _value(i)), key.hex()


def _quarantined(store: kvstore.Store) -> set[bytes]:
    rows, _ = parts(store).index.quarantine_records.rows(None, 1 << 20)
    return {k for k, _, _ in rows}


@pytest.mark.parametrize("kind", ENGINES)
def test_scrub_finds_exactly_the_damaged_blocks(tmp_path: Path, kind: str) -> None:
    async def scenario() -> None:
        entries = await _fill(tmp_path, kind, 200)
        rng = random.Random(7)
        damaged = rng.sample(range(200), 20)
        for i in damaged:  # one flipped payload byte each, anywhere in the payload
            flip_payload_bit(tmp_path, entries[i], at=rng.randrange(FLOATS * 2),
                             mask=1 << rng.randrange(8))
        bad = {_keys(200)[i] for i in damaged}
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **OPEN) as store:
            report = await store.scrub(rate_bytes_per_s=None)
            assert (report.checked_blocks, report.failed_blocks, report.restored_blocks,
                    report.complete, report.resumed) == (200, 20, 0, True, False)
            assert report.checked_bytes == sum(e.slot_len for e in entries)
            assert _quarantined(store) == bad
            stats = store.stats()
            assert (stats.scrubbed_blocks, stats.scrub_failed_blocks, stats.scrub_passes,
                    stats.restored_blocks, stats.quarantined, stats.blocks) == \
                (200, 20, 1, 0, 20, 180)
            assert stats.scrub_last_complete is not None and stats.scrub_progress == 0.0
            await _all_read_back(store, _keys(200), list(range(200)), bad)
            again = await store.scrub(rate_bytes_per_s=None)  # the quarantined: read again
            assert (again.rechecked_blocks, again.restored_blocks, again.failed_blocks,
                    again.checked_blocks) == (20, 0, 0, 180)

    anyio.run(scenario)


async def _lose(store: kvstore.Store, faults: ReadFaults, ks: list[bytes], bad: int,
                times: int | None) -> None:
    """``ks`` put; a get finds ``ks[bad]`` unreadable (``times`` reads fail): quarantined."""
    await store.put_many(ks, [_value(i) for i in range(len(ks))])
    entry = parts(store).index.get_entries([ks[bad]])[0]
    assert entry is not None
    faults.aim(store.path, entry, times)
    await _all_read_back(store, ks, list(range(len(ks))), {ks[bad]})
    assert _quarantined(store) == {ks[bad]}


@pytest.mark.parametrize("kind", ENGINES)
def test_a_block_quarantined_by_an_io_error_is_restored_by_the_next_scrub(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        faults = ReadFaults()
        ks = _keys(8)
        async with open_faulty(kind, tmp_path, faults, monkeypatch, **OPEN) as store:
            parts(store).rechecks.delays = (3600.0,)  # only the scrub reads it again here
            await _lose(store, faults, ks, 5, times=None)
            assert not await store.contains(ks[5])
            faults.clear()  # the device answers again
            report = await store.scrub(rate_bytes_per_s=None)
            assert (report.rechecked_blocks, report.restored_blocks, report.failed_blocks) == \
                (1, 1, 0)
            assert _quarantined(store) == set() and store.stats().restored_blocks == 1
            await _all_read_back(store, ks, list(range(8)))
        assert fsck.check(str(tmp_path), deep=True).findings == []

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_an_unreadable_block_is_read_again_in_the_background_and_restored(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No scrub: the store reads it again after a backoff (kvstore/core/rechecks.py)."""
    async def scenario() -> None:
        faults = ReadFaults()
        ks = _keys(8)
        async with open_faulty(kind, tmp_path, faults, monkeypatch, **OPEN) as store:
            parts(store).rechecks.delays = (0.0,)
            # fails the read and both retries (threads, io_uring: the merged read first)
            await _lose(store, faults, ks, 2, times=3)
            assert len(faults.failed) == 3 and store.stats().quarantined_blocks == 1
            await rechecks_idle(store)
            assert _quarantined(store) == set() and store.stats().restored_blocks == 1
            await _all_read_back(store, ks, list(range(8)))

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_cancelled_scrub_resumes_where_it_stopped_after_a_restart(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvstore.core.scrub, "BATCH_BLOCKS", 10)

    async def scenario() -> None:
        await _fill(tmp_path, kind, 100)
        order = sorted(_keys(100))
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **OPEN) as store:
            seen: list[tuple[int, int]] = []
            with anyio.CancelScope() as scope:
                def progress(done: int, total: int) -> None:
                    seen.append((done, total))
                    if len(seen) == 4:
                        scope.cancel()

                await store.scrub(rate_bytes_per_s=None, progress=progress)
            assert scope.cancelled_caught and seen[-1] == (40, 100)
            assert parts(store).scrubber.cursor == order[39]
            assert store.stats().scrub_progress == pytest.approx(
                int.from_bytes(order[39][:8], "big") / 2 ** 64)
            await _all_read_back(store, _keys(100), list(range(100)))
        # nothing half-done: the index, the space and the cursor are consistent
        assert fsck.check(str(tmp_path), deep=True).findings == []
        async with kvstore.open(tmp_path, engine=_engine(kind, tmp_path), **OPEN) as store:
            assert parts(store).scrubber.cursor == order[39]
            report = await store.scrub(rate_bytes_per_s=None)
            assert (report.resumed, report.complete, report.checked_blocks) == (True, True, 60)
            assert store.stats().scrub_last_complete is not None
            fresh = await store.scrub(rate_bytes_per_s=None)  # a new pass: from the start
            assert (fresh.resumed, fresh.checked_blocks) == (False, 100)

    anyio.run(scenario)


@pytest.mark.parametrize("kind", ["io_uring", "threads"])
def test_closing_the_store_stops_a_scrub_with_its_place_saved(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvstore.core.scrub, "BATCH_BLOCKS", 10)

    async def scenario() -> None:
        await _fill(tmp_path, kind, 50)
        engine = GatedEngine(real_engine(kind, tmp_path))
        reports: list[kvstore.core.scrub.ScrubReport] = []
        gates = []

        async def scrub() -> None:  # after its first batch, its next read is held
            reports.append(await store.scrub(rate_bytes_per_s=None, progress=lambda d, t: (
                gates.append(engine.gate("read")) if not gates else None)))

        async with kvstore.open(tmp_path, engine=engine, **OPEN) as store:
            async with anyio.create_task_group() as tg:
                tg.start_soon(scrub)
                await until(lambda: bool(gates))
                await gates[0].entered.wait()
                await store.aclose()  # cancels it at the gate; its place is saved
        (report,) = reports
        assert (report.complete, report.checked_blocks) == (False, 10)
        assert fsck.check(str(tmp_path), deep=True).findings == []
        async with kvstore.open(tmp_path, engine=real_engine(kind, tmp_path), **OPEN) as store:
            assert parts(store).scrubber.cursor == sorted(_keys(50))[9]

    anyio.run(scenario)


async def _scrub_into(store: kvstore.Store, reports: list[kvstore.core.scrub.ScrubReport]) -> None:
    reports.append(await store.scrub(rate_bytes_per_s=None))


@pytest.mark.parametrize("kind", ["io_uring", "threads"])
def test_a_scrub_read_held_while_blocks_are_deleted_put_and_evicted(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch was looked up, then its blocks were deleted and evicted and new puts
    wanted their space: the read epoch keeps the space until the scrub's read ended, so
    nothing is reported bad, nothing is quarantined, and every block stored reads back."""
    monkeypatch.setattr(kvstore.core.scrub, "BATCH_BLOCKS", 20)

    async def scenario() -> None:
        slot = 20 << 10
        engine = GatedEngine(real_engine(kind, tmp_path))
        async with kvstore.open(tmp_path, engine=engine, capacity_bytes=40 * slot,
                                **OPEN) as store:
            ks = _keys(40)
            await store.put_many(ks, [_value(i) for i in range(40)])
            batch = sorted(ks)[:20]
            gate = engine.gate("read")
            reports: list[kvstore.core.scrub.ScrubReport] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: _scrub_into(store, reports))
                await gate.entered.wait()  # its first batch (20 blocks) is being read
                assert await store.delete_many(batch[:5]) == 5
                new = _keys(25, start=1000)
                put_done = anyio.Event()

                async def put() -> None:
                    await store.put_many(new, [_value(1000 + i) for i in range(25)])
                    put_done.set()

                # needs 20 more slots: evicts (LRU) blocks of the held batch among others
                tg.start_soon(put)
                await until(lambda: waiting_reserves(parts(store).allocator) > 0 or put_done.is_set())
                # it evicted blocks the held read still reads: it waits for their space
                assert not put_done.is_set() and parts(store).allocator.pending_free_bytes > 0
                gate.open()
            (report,) = reports
            assert report.complete and report.failed_blocks == 0
            stats = store.stats()
            assert stats.quarantined == 0 and stats.evicted_blocks >= 1
            stored = [k for k in ks + new if await store.contains(k)]
            values = {k: i for i, k in enumerate(ks)} | {k: 1000 + i for i, k in enumerate(new)}
            await _all_read_back(store, stored, [values[k] for k in stored])
        # (deleted and evicted blocks lie in free space: notes, not problems)
        assert fsck.check(str(tmp_path), deep=True).problems == []

    anyio.run(scenario)


@pytest.mark.parametrize("seed", range(3))
def test_a_scrub_beside_puts_deletes_and_evictions_on_the_simulated_disk(
        tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded interleavings: every op waits a random number of scheduling points."""
    monkeypatch.setattr(kvstore.core.scrub, "BATCH_BLOCKS", 7)

    async def scenario() -> None:
        rng = random.Random(seed)
        slot = 20 << 10
        engine = SimulatedEngine(SimulatedDisk(seed=seed, max_yields=5))
        values: dict[bytes, int] = {}
        async with kvstore.open(tmp_path, engine=engine, capacity_bytes=60 * slot,
                                **OPEN) as store:
            async def churn() -> None:
                for round_ in range(12):
                    new = _keys(6, start=100 * (round_ + 1))
                    await store.put_many(new, [_value(100 * (round_ + 1) + i) for i in range(6)])
                    values.update({k: 100 * (round_ + 1) + i for i, k in enumerate(new)})
                    gone = rng.sample(sorted(values), 2)
                    await store.delete_many(gone)
                    for k in gone:
                        values.pop(k)

            first = _keys(50)
            await store.put_many(first, [_value(i) for i in range(50)])
            values.update({k: i for i, k in enumerate(first)})
            reports: list[kvstore.core.scrub.ScrubReport] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(churn)
                for _ in range(3):
                    tg.start_soon(lambda: _scrub_into(store, reports))
            assert all(r.failed_blocks == 0 for r in reports)
            assert store.stats().quarantined == 0 and store.stats().evicted_blocks > 0
            stored = [k for k in values if await store.contains(k)]
            await _all_read_back(store, stored, [values[k] for k in stored])
        # (deleted and evicted blocks lie in free space: notes, not problems)
        assert fsck.check(str(tmp_path), deep=True).problems == []

    anyio.run(scenario)


def test_the_background_scrub_finds_damage_and_records_its_passes(tmp_path: Path) -> None:
    async def scenario() -> None:
        entries = await _fill(tmp_path, "threads", 20)
        flip_payload_bit(tmp_path, entries[4])
        async with kvstore.open(tmp_path, engine="threads", scrub_bytes_per_s=64 << 20,
                                **OPEN) as store:
            await scrub_passes(store, 1)
            stats = store.stats()
            assert (stats.scrub_passes, stats.scrub_failed_blocks, stats.quarantined) == (1, 1, 1)
            assert _quarantined(store) == {_keys(20)[4]}
            completed = stats.scrub_last_complete
        async with kvstore.open(tmp_path, engine="threads", **OPEN) as store:
            assert store.stats().scrub_last_complete == completed  # persisted

    anyio.run(scenario)


def test_a_store_scrub_rate_must_be_positive(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with kvstore.open(tmp_path, engine="threads", **OPEN) as store:
            with pytest.raises(ValueError, match="rate_bytes_per_s"):
                await store.scrub(rate_bytes_per_s=0)

    anyio.run(scenario)
    with pytest.raises(ValueError, match="scrub_bytes_per_s"):
        kvstore.StoreOptions(scrub_bytes_per_s=-1)


def test_the_scrub_and_the_quarantine_in_the_prometheus_export(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore import metrics

    async def scenario() -> dict[str, float]:
        entries = await _fill(tmp_path, "threads", 10)
        flip_payload_bit(tmp_path, entries[2])
        async with kvstore.open(tmp_path, engine="threads", **OPEN) as store:
            registry = CollectorRegistry()
            metrics.register(store, registry)
            before = generate_latest(registry).decode()
            assert "kvstore_scrub_last_complete_timestamp_seconds" not in before  # never
            await store.scrub(rate_bytes_per_s=None)
            text = generate_latest(registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples}

    got = anyio.run(scenario)
    assert got["kvstore_scrubbed_blocks_total"] == 10
    assert got["kvstore_scrub_failed_blocks_total"] == 1
    assert got["kvstore_scrub_passes_total"] == 1
    assert got["kvstore_blocks_quarantined_total"] == 1 == got["kvstore_quarantined_blocks"]
    assert got["kvstore_restored_blocks_total"] == 0
    assert got["kvstore_scrub_progress_ratio"] == 0
    assert got["kvstore_scrub_last_complete_timestamp_seconds"] > 1.6e9
