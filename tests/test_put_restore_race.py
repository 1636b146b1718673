"""A block put again while its quarantined copy is restored is indexed once.

A read error quarantines K; the engine, told "miss", computes K again and puts it; a
re-read of the quarantined copy (the background re-reads, a scrub) verifies it and
puts it back while that put is between its decision (K absent: write it) and its
commit.  The commit indexed K a second time over the restored entry: an LRU row with
no block behind it and one child too many for K's parent (fsck: refcount-drift; the
parent could never be a leaf again, so never evicted).  Found by the concurrent state
machine (a bad sector healed under a remote promotion of the same key).  The commit
now skips K (``dedup_late``), as it does a key another process committed meanwhile.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import kvstore
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.concurrency import DEADLINE, GatedEngine
from tests.read_faults import ReadFaults, faulty_engine

KEYS = [bytes([0x31 + i]) * 16 for i in range(2)]  # a parent and K


def _value(i: int) -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32) + 1000 * i


@pytest.mark.parametrize("restore", ["rechecks", "scrub"])
def test_a_restore_during_a_put_of_the_same_key_indexes_it_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore: str) -> None:
    async def scenario() -> None:
        faults = ReadFaults()
        engine = GatedEngine(faulty_engine("threads", tmp_path, faults, monkeypatch))
        async with kvstore.open(tmp_path, engine=engine, extent_bytes=1 << 20) as store:
            parts(store).rechecks.delays = (3600.0,)  # no background re-read: this test does it
            await store.put_many(KEYS, [_value(0), _value(1)],
                                 parents=kvstore.chain_parents(KEYS))
            parent, k = KEYS
            faults.aim(store.path, parts(store).index.get_entries([k])[0])
            assert (await store.get_many([k])) == [None]  # quarantined: unreadable
            faults.clear()  # it reads again
            gate = engine.gate("datasync")  # the put of K again, held before its commit
            with anyio.fail_after(DEADLINE):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: store.put(k, _value(1), parent=parent))
                    await gate.entered.wait()
                    if restore == "rechecks":
                        assert await parts(store).rechecks.once() == 0
                    else:
                        await store.scrub(rate_bytes_per_s=None)
                    assert store.stats().restored_blocks == 1
                    gate.open()
            # its commit found K indexed again: K skipped (its slot free again), counted
            # as deduplicated late (issue 43: what a commit of K by another process does)
            assert store.stats().dedup_late == 1 and store.stats().put_retries == 0
            got = await store.get_many(KEYS)
            assert all(g is not None and torch.equal(g, _value(i)) for i, g in enumerate(got))
        report = fsck.check(str(tmp_path))
        assert report.findings == [], [f.detail for f in report.findings]
        assert report.blocks == 2 and report.quarantined == 0

    anyio.run(scenario)
