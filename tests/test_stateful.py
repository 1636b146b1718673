"""Hypothesis stateful test of the contract (G1-G4) against an in-memory model.

Rules: put, put-duplicate, get, delete, match_prefix, crash-and-restart at a chosen I/O
operation in a chosen crash mode, inject EIO / ENOSPC / short write, flip a bit in an
extent.  The model is the set of acknowledged blocks plus the keys of an operation that
was in flight when the machine stopped; after every restart every acknowledged block must
read back bit-exact (G1), no get may return other bytes (G2), the in-flight put must be
all-or-nothing (G3), and fsck must find nothing but reclaimable leftovers (G4).
Puts draw whether they tag their blocks (``put_many(tags=)``): every block's tag reads
back exactly (the snapshot, the table), a re-put keeps the stored tag, a quarantined
block keeps its tag, and no tag outlives its block (fsck finds no orphan tag).
Each rule opens the store, acts and closes it, so persistence is exercised throughout.
Profiles (tests/conftest.py): "ci" derandomised and short; "nightly" long.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES
from kvstore.io.simulated import (
    CRASH_MODES,
    SimulatedDisk,
    SimulatedEngine,
    is_simulated_crash,
)
from kvstore.testing import parts
from kvstore.tools import fsck
from tests.conformance import NS, make_tensor, same

STATS: dict[str, int] = {"machines": 0, "steps": 0, "restarts": 0, "crashes": 0, "faults": 0,
                         "bit_flips": 0, "g1_checks": 0, "g2_checks": 0}

CHAIN_1 = NS.chain_keys(list(range(1000, 1016)))
CHAIN_2 = NS.chain_keys(list(range(2000, 2012)))
POOL = CHAIN_1 + CHAIN_2
VALUES = {k: make_tensor(torch.bfloat16, (700 + 900 * (i % 5),), i) for i, k in enumerate(POOL)}
PARENTS = dict(zip(CHAIN_1, kvstore.chain_parents(CHAIN_1))) | \
    dict(zip(CHAIN_2, kvstore.chain_parents(CHAIN_2)))
OPTIONS: dict[str, Any] = dict(namespace=NS, extent_bytes=48 << 10, staging_bytes=1 << 20)

TAGS = {k: b"tag:" + k for k in POOL}  # a key's tag is a function of the key, as an engine's is

key_lists = st.lists(st.sampled_from(POOL), min_size=1, max_size=5, unique=True)


class StoreMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.path = Path(self.dir.name) / "store"
        self.disk = SimulatedDisk(seed=STATS["machines"])
        self.acked: set[bytes] = set()
        self.unsure: set[bytes] = set()  # keys of an operation in flight at a crash/fault
        self.unsure_tagged = False  # whether that operation tagged its blocks
        self.tagged: set[bytes] = set()  # keys whose tag row exists (stored or quarantined)
        self.held: set[bytes] = set()  # keys with a quarantine record (their tag stays)
        STATS["machines"] += 1

    def teardown(self) -> None:
        if hasattr(self, "dir"):
            self.dir.cleanup()

    def run(self, fn: Any) -> Any:
        async def go() -> Any:
            async with kvstore.open(self.path, engine=SimulatedEngine(self.disk), **OPTIONS) as s:
                return await fn(s)

        STATS["steps"] += 1
        return anyio.run(go)

    def resolve(self) -> None:
        """After a restart: every key still unsure must be all present or all absent."""
        if not self.unsure:
            return
        keys = sorted(self.unsure)

        async def read(s: kvstore.Store) -> list[torch.Tensor | None]:
            return await s.get_many(keys)

        got = self.run(read)
        present = {k for k, g in zip(keys, got) if g is not None}
        for k, g in zip(keys, got):
            assert g is None or same(g, VALUES[k]), "G2: wrong bytes"
        new = present - self.acked
        assert new in (set(), set(keys) - self.acked), "G3: in-flight put partly applied"
        if self.unsure_tagged:
            self.tagged |= new
        self.acked |= present
        self.unsure.clear()

    def check_all(self) -> None:
        """G1 and G2 over the whole pool, after a restart."""
        async def read(s: kvstore.Store) -> list[torch.Tensor | None]:
            return await s.get_many(POOL)

        for k, g in zip(POOL, self.run(read)):
            STATS["g1_checks"] += k in self.acked
            STATS["g2_checks"] += 1
            assert same(g, VALUES[k]) if k in self.acked else g is None, "G1/G2 after restart"
        self.check_tags()

    def check_tags(self) -> None:
        """Every stored block's tag reads back exactly, in the snapshot and the table."""
        async def read(s: kvstore.Store) -> Any:
            listed = {b.key: b.tag async for page in s.snapshot() for b in page}
            return listed, parts(s).index.tags.read_many(POOL)

        listed, table = self.run(read)
        assert listed == {k: TAGS[k] if k in self.tagged else None for k in self.acked}
        assert table == {k: TAGS[k] for k in self.tagged}, "a tag outlived its block"

    # ------------------------------------------------------------------ rules

    @rule(keys=key_lists, tagged=st.booleans())
    def put(self, keys: list[bytes], tagged: bool) -> None:
        self.resolve()

        async def go(s: kvstore.Store) -> kvstore.PutResult:
            return await s.put_many(keys, [VALUES[k] for k in keys],
                                    parents=[PARENTS[k] for k in keys],
                                    tags=[TAGS[k] for k in keys] if tagged else None)

        result = self.run(go)
        assert result.written == len(set(keys) - self.acked)
        if tagged:
            self.tagged |= set(keys) - self.acked
        self.acked |= set(keys)

    @rule()
    def put_duplicate(self) -> None:
        self.resolve()
        keys = sorted(self.acked)[:4]
        if not keys:
            return

        async def go(s: kvstore.Store) -> kvstore.PutResult:  # (another tag: not written)
            return await s.put_many(keys, [VALUES[k] for k in keys],
                                    tags=[b"other" + k for k in keys])

        assert self.run(go).written == 0
        self.check_tags()

    @rule(keys=key_lists)
    def get(self, keys: list[bytes]) -> None:
        self.resolve()

        async def go(s: kvstore.Store) -> list[torch.Tensor | None]:
            return await s.get_many(keys)

        for k, g in zip(keys, self.run(go)):
            STATS["g1_checks"] += k in self.acked
            STATS["g2_checks"] += 1
            if k in self.acked:
                assert same(g, VALUES[k]), "G1: an acknowledged block is not bit-exact"
            else:
                assert g is None, "a block that was never stored came back"

    @rule(keys=key_lists)
    def delete(self, keys: list[bytes]) -> None:
        self.resolve()

        async def go(s: kvstore.Store) -> int:
            return await s.delete_many(keys)

        assert self.run(go) == len(set(keys) & self.acked)
        self.tagged -= (set(keys) & self.acked) - self.held
        self.acked -= set(keys)
        self.check_tags()

    @rule(chain=st.sampled_from([CHAIN_1, CHAIN_2]))
    def match_prefix(self, chain: list[bytes]) -> None:
        self.resolve()

        async def go(s: kvstore.Store) -> int:
            return await s.match_prefix(chain)

        want = next((i for i, k in enumerate(chain) if k not in self.acked), len(chain))
        assert self.run(go) == want

    @rule(keys=key_lists, after=st.integers(1, 8), mode=st.sampled_from(CRASH_MODES),
          tagged=st.booleans())
    def crash_and_restart(self, keys: list[bytes], after: int, mode: str, tagged: bool) -> None:
        self.resolve()
        self.disk.crash_at = self.disk.ops + after

        async def go(s: kvstore.Store) -> None:
            await s.put_many(keys, [VALUES[k] for k in keys], parents=[PARENTS[k] for k in keys],
                             tags=[TAGS[k] for k in keys] if tagged else None)

        self.unsure_tagged = tagged
        try:
            self.run(go)
            if tagged:
                self.tagged |= set(keys) - self.acked
            self.acked |= set(keys)  # finished before the chosen operation
            self.disk.crash_at = None
        except BaseException as e:
            if not is_simulated_crash(e):
                raise
            STATS["crashes"] += 1
            self.unsure = set(keys) - self.acked
        self.disk.crash(mode)
        STATS["restarts"] += 1
        self.resolve()
        self.check_all()
        report = fsck.check(str(self.path), deep=True)
        assert not report.damage, f"G4: {[f.detail for f in report.damage]}"
        assert "orphan-tag" not in {f.kind for f in report.findings}, "a tag outlived its block"

    @rule(keys=key_lists, fault=st.sampled_from([("write", 5), ("write", 28), ("write", -1),
                                                 ("datasync", 5)]))
    def inject_fault(self, keys: list[bytes], fault: tuple[str, int]) -> None:
        self.resolve()
        self.disk.faults.append(fault)
        fresh = set(keys) - self.acked

        async def go(s: kvstore.Store) -> bool:
            try:
                await s.put_many(keys, [VALUES[k] for k in keys])
            except kvstore.StoreIOError:
                assert s.read_only
                return False
            return True

        self.unsure_tagged = False
        if self.run(go):
            self.acked |= set(keys)  # nothing to write: the fault was never reached
            self.disk.faults.clear()
        else:
            STATS["faults"] += 1
            self.unsure = fresh
            self.disk.crash("random")  # what a failed sync leaves on the media
            STATS["restarts"] += 1
            self.resolve()
            self.check_all()

    @rule(data=st.data())
    def flip_bit(self, data: st.DataObject) -> None:
        self.resolve()
        if not self.acked:
            return
        key = data.draw(st.sampled_from(sorted(self.acked)))

        async def where(s: kvstore.Store) -> Any:
            return parts(s).index.get_entries([key])[0]

        entry = self.run(where)
        bit = data.draw(st.integers(0, entry.payload_len * 8 - 1))
        with open(extent_path(str(self.path), entry.extent), "r+b") as f:
            f.seek(entry.offset + SLOT_HEADER_BYTES + bit // 8)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ (1 << bit % 8)]))
        STATS["bit_flips"] += 1

        async def get(s: kvstore.Store) -> Any:
            return await s.get(key), s.stats().corrupt_blocks

        got, corrupt = self.run(get)
        assert got is None and corrupt == 1, "G2: a flipped bit was returned as data"
        self.acked.discard(key)  # detected, quarantined, a miss from now on
        self.held.add(key)  # (its tag, if any, stays with the quarantine record)
        self.check_tags()

    @invariant()
    def nothing_unsure_outside_a_crash_rule(self) -> None:
        assert isinstance(self.unsure, set)


StoreMachine.TestCase.settings = settings(
    settings(), stateful_step_count=20,
    max_examples=settings().max_examples if settings().max_examples > 50 else 40)
TestStoreContract = StoreMachine.TestCase


@pytest.mark.slow
def test_store_contract_long() -> None:
    """The long profile: many more and longer runs (``pytest -m slow``)."""
    run_state_machine_as_test(StoreMachine, settings=settings(
        settings(), max_examples=600, stateful_step_count=40, derandomize=False))
