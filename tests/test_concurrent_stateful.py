"""A Hypothesis state machine whose steps are *concurrent* rounds (issue 12).

Each step opens the store - on the simulated disk (which yields a seeded number of times
before every I/O op, so tasks interleave and ops complete out of order) or on a real
io_uring or thread-pool engine - and starts 1-5 tasks at once - puts of chain prefixes
(parents in the batch), gets, match_prefix, deletes of chain suffixes, prefetches,
scrubs - under capacity pressure with pinned blocks, and may cancel any task after a
drawn number of scheduling points, close the store while tasks run, crash the machine
at a drawn I/O op, or fail the round's first fdatasync while other tasks' writes are
pending (the disk drops what it covered, as Linux may; then the machine loses whatever
else was unsynced: no put acknowledged after the failure may be among it) (crashes and
failed syncs on the simulated disk only), or make reads fail (issue 41): once (the next
read on the simulated disk, or the reads of one stored slot, through each engine's own
read call: ``tests/read_faults.py``) or for good (one slot's sector, until the round's
check clears it), or fork the process from the event loop, while the store opens or
after a drawn number of scheduling points of the round (a worker process an engine
starts with the store's operations in flight, its open or close on a worker thread):
the child holds no descriptor of the store's LOCK file, runs on past the round, through
the reopen and fsck of the checks below, and once the parent has closed the store opens
it itself and reads every block (the rule of docs/api.md: it may, then), then exits
cleanly.  Invariants after every round, on asyncio and trio:

* every operation ended (the round runs under a deadline: a hang fails, it does not stall);
* never wrong bytes: every get returns the stored value or a miss;
* every acknowledged block that was not deleted reads back bit-exact unless eviction took
  it (missing blocks never exceed the blocks evicted), pinned blocks are never evicted;
* a read error is a suspicion, not a verdict: after a round whose reads failed only once,
  nothing is quarantined; a sector that keeps failing costs the blocks on it only, and
  once it reads again a scrub puts them back (nothing lost); no quarantine without a
  read fault;
* a cancelled / unacknowledged put is whole or absent (no partial chain prefix: puts
  are prefixes, so an absent block's descendants from the same put are absent too);
* no chain holes (fsck's count) on machines that do not delete (deletes may cut chains);
* used bytes never exceeded capacity; no eviction without pressure, and a round evicts
  at most its puts' shortfall plus one block per put;
* fsck finds no damage after close (a crash may leave only reclaimable space);
* a forked child opens the store once the parent has closed it and reads what the
  parent read;
* processes as actors (issue 43): on one machine in two on a real engine, another
  process has the store open for the machine's whole life and reads its blocks a few
  milliseconds apart (``tests/peer_reader.py``), beside every round and check; one round
  in eight SIGKILLs it at a drawn scheduling point (mid-read, most likely: its read mark
  stays, so space the round frees waits for it until a reserve finds it dead) and a new
  one takes its place.  It never reads wrong bytes and none of its reads fails.

Size: the machines follow the Hypothesis profile (``tests/conftest.py``): derandomised
under ``ci``, a new seed under ``default`` and CI's ``random`` pass (which selects this
test by its ``hypothesis`` mark), with a third of the profile's examples as machines
(:func:`machine_settings`); ``-m slow`` runs longer ones.  Counts are printed at the end
of the run (``tests/conftest.py``).
"""

from __future__ import annotations

import errno
import functools
import json
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

import kvstore
from kvstore.disk.extents import extent_path
from kvstore.disk.format import SLOT_HEADER_BYTES, IndexEntry, round_up
from kvstore.errors import (
    CapacityError,
    ReadOnlyError,
    StoreClosedError,
    StoreFullError,
    StoreIOError,
)
from kvstore.io.probe import probe
from kvstore.io.protocol import IOEngine
from kvstore.io.simulated import (
    CRASH_MODES,
    SimulatedCrash,
    SimulatedDisk,
    SimulatedEngine,
    is_simulated_crash,
)
from kvstore.testing import parts
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tools import fsck
from tests.concurrency import LiveChild, SnapshotReader, lock_descriptors, run_within
from tests.conformance import NS, make_tensor, same
from tests.peer_reader import PeerReader
from tests.read_faults import ReadFaults, _FailingOps, faulty_engine
from tests.test_full_disk import Filler, small_fs  # noqa: F401 - small_fs: a fixture
from tests.tiers.remote.slow_s3 import SlowS3

STATS: dict[str, int] = {"machines": 0, "rounds": 0, "tasks": 0, "cancellations": 0,
                         "closes_in_flight": 0, "crashes": 0, "scheduling_points": 0,
                         "evictions": 0, "g1_checks": 0, "sync_faults": 0,
                         "remote_machines": 0, "slow_remote_rounds": 0, "forks": 0,
                         "forks_in_flight": 0, "forks_while_opening": 0, "child_reads": 0,
                         "child_refusals": 0, "small_fs_machines": 0, "full_rounds": 0,
                         "index_full_refusals": 0, "full_refusals": 0, "puts_after_full": 0,
                         "real_engine_machines": 0, "read_faults": 0, "read_faults_hit": 0,
                         "round_promotions": 0,
                         "persistent_read_faults": 0, "blocks_restored": 0, "scrubs": 0,
                         "read_evictions": 0, "tag_checks": 0, "peers": 0, "peer_reads": 0,
                         "peer_hits": 0, "peers_killed": 0, "owners_recovered": 0}

CHAINS = [NS.chain_keys(list(range(10_000 * c, 10_000 * c + 4 * 6))) for c in range(3)]
POOL = [k for chain in CHAINS for k in chain]
PARENTS = {k: (chain[i - 1] if i else None) for chain in CHAINS for i, k in enumerate(chain)}
VALUES = {k: make_tensor(torch.uint8, ((1500, 5000, 7000)[i % 3],), i) for i, k in enumerate(POOL)}
TAGS = {k: b"tag:" + k for k in POOL}  # every put tags its blocks (issue 45)
SLOTS = {k: round_up(SLOT_HEADER_BYTES + v.numel()) for k, v in VALUES.items()}
MAX_SLOT = max(SLOTS.values())
CAPACITY = 28 << 10  # about 4 of the 18 blocks: most puts evict
PINNED = CHAINS[1][:2]
OPTIONS: dict[str, Any] = dict(namespace=NS, extent_bytes=64 << 10, staging_bytes=64 << 10,
                               capacity_bytes=CAPACITY)
ROUND_DEADLINE = 30.0
REMOTE_CONCURRENCY = 2
# Engines a machine runs on: the simulated disk (interleavings under a seed, crashes,
# failed syncs) in half of them, the real engines (their own merging of reads, their
# own threads or ring) in the rest; an engine this host cannot run falls back to it.
ENGINES = ("simulated", "simulated", "threads", "io_uring")
# Read faults: "next" fails the simulated disk's next read op once, whatever it reads
# (elsewhere as "transient"); "transient" fails the reads of one stored slot once;
# "persistent" fails them until the round's check clears it (a bad sector).
READ_FAULTS = ("transient", "persistent", "next")
ops = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.integers(1, 6)),     # chain, prefix length
    st.tuples(st.just("get"), st.lists(st.sampled_from(POOL), min_size=1, max_size=4)),
    st.tuples(st.just("match"), st.integers(0, 2)),
    st.tuples(st.just("delete"), st.integers(0, 2), st.integers(0, 5)),  # chain, suffix start
    st.tuples(st.just("prefetch"), st.lists(st.sampled_from(POOL), min_size=1, max_size=4),
              st.booleans()),                                            # keys, await it
    st.tuples(st.just("scrub")),
)
cancel_points = st.one_of(st.none(), st.integers(0, 40))


@functools.cache
def usable(kind: str) -> bool:
    """Whether this host runs the engine ``kind`` (the simulated one always)."""
    if kind == "simulated":
        return True
    with tempfile.TemporaryDirectory() as d:
        return probe(d, kind).engine == kind


def child_reads(path: Path, backend: str) -> Callable[[bytes], bytes]:
    """What a forked child does once the parent has closed the store: open it itself (on
    a simulated disk of its own, no memory tier, no remote) and read every block.  Its
    answer, as JSON: the indices in POOL it got and those whose bytes were wrong, or the
    error that stopped it and whether it was a ``KVStoreError``."""
    def later(_: bytes) -> bytes:
        async def read() -> dict[str, list[int]]:
            engine = SimulatedEngine(SimulatedDisk(seed=7))
            async with kvstore.open(path, engine=engine, memory_bytes=0, **OPTIONS) as store:
                got = await store.get_many(POOL)
            return {"present": [i for i, g in enumerate(got) if g is not None],
                    "wrong": [i for i, (k, g) in enumerate(zip(POOL, got))
                              if g is not None and not same(g, VALUES[k])]}

        answer: dict[str, Any] = {}

        def target() -> None:  # a thread of its own: this one is "inside" the parent's loop
            try:
                answer.update(anyio.run(read, backend=backend))
            except BaseException as e:  # noqa: BLE001 - the answer carries it
                answer["error"] = repr(e)
                answer["typed"] = isinstance(e, kvstore.KVStoreError)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        return json.dumps(answer).encode()

    return later


def without_crashes(e: BaseException) -> BaseException:
    """A task group's errors less its simulated crashes: a crash is no ``Exception``, and
    Hypothesis reports (and shrinks) only a failure that is one."""
    split = getattr(e, "split", None)
    if split is None:
        return e
    _, rest = split(SimulatedCrash)
    return e if rest is None else rest  # type: ignore[no-any-return]


def overlaps(faults: ReadFaults, path: Path, extent: int | None, offset: int | None,
             length: int | None) -> bool:
    """Whether the slot [offset, offset+length) of ``extent`` touches the failing range."""
    return (faults.path == extent_path(str(path), extent or 0) and offset is not None
            and length is not None and offset < faults.offset + faults.length
            and faults.offset < offset + length)


class FullDisk:
    """A round on a full file system: every free block taken (:class:`Filler`) and a
    snapshot held by another process (:class:`SnapshotReader`: every commit needs room
    to grow), until :meth:`free`."""

    def __init__(self, mount: Path, index: Path) -> None:
        self.reader = SnapshotReader(index)
        self.filler: Filler | None = Filler(mount)

    def free(self) -> None:
        if self.filler is not None:
            self.filler.give_back()
            self.filler = None
        self.reader.end()


class ConcurrentMachine(RuleBasedStateMachine):
    backend = "asyncio"
    small_fs: Path | None = None  # a small real file system the test mounted, if it could

    @initialize(deletes=st.booleans(), seed=st.integers(0, 2**16),
                slow=st.sampled_from([3, 100, 400]),
                memory=st.sampled_from([0, 12 << 10, 64 << 10]),  # tier off / evicting / roomy
                remote=st.integers(0, 1), engine=st.sampled_from(ENGINES),
                on_small_fs=st.integers(0, 2), peer=st.integers(0, 1))
    def setup(self, deletes: bool, seed: int, slow: int, memory: int, remote: int = 0,
              engine: str = "simulated", on_small_fs: int = 1, peer: int = 1) -> None:
        # One machine in three lives on a small real file system that rounds can fill.
        self.mount = ConcurrentMachine.small_fs if on_small_fs == 0 else None
        STATS["small_fs_machines"] += self.mount is not None
        self.dir = tempfile.TemporaryDirectory(dir=self.mount)
        self.path = Path(self.dir.name) / "store"
        self.path.mkdir(mode=0o700)  # the real engines' probe writes in it before open
        # A slow device (many scheduling points per op) keeps reads in flight while
        # other tasks' index transactions (on the writer thread) come and go.
        self.disk = SimulatedDisk(seed=seed, max_yields=slow)
        self.kind = engine if usable(engine) else "simulated"
        STATS["real_engine_machines"] += self.kind != "simulated"
        # Reads that fail where told, at each engine's own read call (tests/read_faults.py;
        # the thread pool's is patched in its module, undone at teardown).
        self.faults = ReadFaults()
        self.patches = pytest.MonkeyPatch()
        self.armed: str | None = None       # the read fault of the round, once aimed
        self.full: FullDisk | None = None   # the round's full disk, until freed
        self.deletes = deletes
        self.memory = memory  # memory_bytes: gets must never see a stale cached block
        self.acked: set[bytes] = set()      # acknowledged, not deleted
        self.maybe: set[bytes] = set()      # an unacknowledged put or delete touched them
        self.evicted = 0                    # blocks evicted so far (all sessions)
        self.missing = 0                    # acknowledged blocks found gone (evicted)
        # One machine in two (that does not delete: kvstore never deletes remote
        # objects, so a deleted block may come back from there) has a remote tier on a
        # real S3 server in this process, which some rounds make slow (GETs held past
        # their deadline): requests in flight at the server never exceed `concurrency`.
        self.s3: SlowS3 | None = None
        if remote == 1 and not deletes:
            self.s3 = SlowS3("kvstore", hold=()).__enter__()
            STATS["remote_machines"] += 1
        STATS["machines"] += 1

        async def pin() -> None:
            async with self.open() as store:
                await store.pin(PINNED)

        run_within(pin, self.backend)
        # One machine on a real engine in two has another process on its store for its
        # whole life, reading (tests/peer_reader.py); rounds may SIGKILL it mid-read.
        self.peer: PeerReader | None = None
        self.peer_seen = (0, 0)  # its reads and hits counted so far
        if peer == 0 and self.kind != "simulated":
            self.peer = PeerReader(self.path, self.kind, seed)
            STATS["peers"] += 1

    def teardown(self) -> None:
        peer = getattr(self, "peer", None)
        if peer is not None and not peer.killed:
            self.check_peer(peer.stop())
        if getattr(self, "s3", None) is not None:
            assert self.s3 is not None
            self.s3.__exit__(None, None, None)
        if hasattr(self, "patches"):
            self.patches.undo()
        if hasattr(self, "dir"):
            self.dir.cleanup()

    def engine(self) -> IOEngine:
        if self.kind == "simulated":
            return _FailingOps(SimulatedEngine(self.disk), self.faults)
        return faulty_engine(self.kind, self.path, self.faults, self.patches)

    def open(self) -> Any:
        remote = None if self.s3 is None else RemoteConfig(
            bucket="kvstore", endpoint=self.s3.endpoint, prefix="machine",
            access_key_id="k", secret_access_key="s", concurrency=REMOTE_CONCURRENCY,
            read_deadline_s=0.05, request_timeout_s=60.0, close_drain_s=0.0)
        return kvstore.open(self.path, engine=self.engine(), memory_bytes=self.memory,
                            remote=remote, **OPTIONS)

    def arm(self, store: kvstore.Store, fault: tuple[str, int] | None) -> None:
        """Aim the round's read fault (at the start of the round: at a stored slot)."""
        if fault is None:
            return
        kind, pick = fault
        if kind == "next" and self.kind == "simulated":
            self.disk.faults.append(("read", errno.EIO))
            self.armed = "next"
        else:
            stored = [(k, e) for k, e in zip(POOL, parts(store).index.get_entries(POOL))
                      if e is not None]
            if not stored:
                return
            entry: IndexEntry = stored[pick % len(stored)][1]
            self.faults.failed.clear()
            self.faults.aim(str(self.path), entry, times=None if kind == "persistent" else 1)
            self.armed = "persistent" if kind == "persistent" else "transient"
        STATS["read_faults"] += 1
        STATS["persistent_read_faults"] += self.armed == "persistent"

    def disarm(self) -> None:
        if self.armed is not None:
            STATS["read_faults_hit"] += bool(self.faults.failed) or (
                self.armed == "next" and ("read", errno.EIO) not in self.disk.faults)
        self.faults.clear()
        self.disk.faults = [f for f in self.disk.faults if f[0] != "read"]
        self.armed = None

    # ------------------------------------------------------------------ one round

    @rule(tasks=st.lists(st.tuples(ops, cancel_points), min_size=1, max_size=5),
          close_after=st.one_of(st.none(), st.integers(0, 60)),
          crash=st.one_of(st.none(), st.tuples(st.integers(1, 8), st.sampled_from(CRASH_MODES))),
          sync_fault=st.integers(0, 5), slow_remote=st.booleans(),
          fork=st.one_of(st.none(), st.none(), st.none(),  # 1 in 4: mostly mid-round
                         st.tuples(st.sampled_from(["round", "round", "opening"]),
                                   st.integers(0, 40))),
          read_fault=st.one_of(st.none(), st.none(),  # 1 in 3
                               st.tuples(st.sampled_from(READ_FAULTS), st.integers(0, 17))),
          full=st.one_of(st.none(), st.none(), st.integers(0, 80)),  # 1 in 3
          peer_kill=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 40)))
    def concurrent_round(self, tasks: list[tuple[tuple[Any, ...], int | None]], close_after: int | None,
              crash: tuple[int, str] | None, sync_fault: int = 0,
              slow_remote: bool = False, fork: tuple[str, int] | None = None,
              read_fault: tuple[str, int] | None = None, full: int | None = None,
              peer_kill: int | None = None) -> None:
        if not self.deletes:
            tasks = [t for t in tasks if t[0][0] != "delete"] or [(("match", 0), None)]
        if self.kind != "simulated":  # crashes and failed syncs are the simulated disk's
            crash, sync_fault = None, 0
        # A full disk (on machines on the small file system): from the start of the
        # round's tasks until a drawn scheduling point (under 40), or their end.  Puts, deletes and
        # scrubs may fail with StoreFullError (a new extent, or the index commit: no page
        # to grow into); nothing else may, the store never turns read-only, and once
        # space is back every put refused for it succeeds in the same open.
        full = full if self.mount is not None else None
        if full is not None:
            sync_fault = 0  # a failed sync makes the store read-only: one failure a round
        extra: list[tuple[tuple[tuple[Any, ...], int | None], tuple[str, Any]]] = []
        outcomes: list[tuple[str, Any]] = [("unfinished", None)] * len(tasks)
        round_stats: dict[str, int] = {}
        # Keys no put of this round touches: once a delete of one has returned, no later
        # get may return it (the memory tier included).
        self.unput = set(POOL) - {k for (op, _) in tasks if op[0] == "put"
                                  for k in CHAINS[op[1]][:op[2]]}
        self.deleted: set[bytes] = set()
        yields_before = self.disk.yields
        # One round in six: the round's first fdatasync fails (the disk drops what it
        # covered), with other tasks' writes pending; the store turns read-only, so its
        # puts, deletes and pins may be refused; none acknowledged after it may be lost.
        faulty = sync_fault == 5
        if faulty:
            self.disk.faults.append(("datasync", errno.EIO))
            STATS["sync_faults"] += 1
        refusals: tuple[type[BaseException], ...] = (StoreClosedError, CapacityError) + \
            ((StoreIOError, ReadOnlyError) if faulty else ()) + \
            ((StoreFullError,) if full is not None else ())

        async def one(store: kvstore.Store, i: int, op: tuple[Any, ...]) -> None:
            try:
                outcomes[i] = ("ok", await self.do(store, op))
            except Exception as e:
                if not self.allowed(e, op, refusals, full is not None):
                    raise
                outcomes[i] = ("refused", e)

        async def cancellable(store: kvstore.Store, i: int, op: tuple[Any, ...],
                              after: int | None, tg: Any) -> None:
            with anyio.CancelScope() as scope:
                if after is not None:
                    tg.start_soon(cancel_later, scope, after)
                await one(store, i, op)
            if scope.cancelled_caught:
                outcomes[i] = ("cancelled", None)
                STATS["cancellations"] += 1

        async def cancel_later(scope: anyio.CancelScope, after: int) -> None:
            for _ in range(after):
                await anyio.lowlevel.checkpoint()
            scope.cancel()

        async def close_later(store: kvstore.Store, after: int) -> None:
            for _ in range(after):
                await anyio.lowlevel.checkpoint()
            STATS["closes_in_flight"] += any(o[0] == "unfinished" for o in outcomes)
            state[0] = "closing"
            await store.aclose()
            state[0] = "closed"

        children: list[tuple[LiveChild, str]] = []  # and the store's state at the fork
        state = ["closed"]  # "opening", "open", "closing" (on the store's worker threads)

        async def free_later(after: int) -> None:
            for _ in range(after):
                await anyio.lowlevel.checkpoint()
            if self.full is not None:
                self.full.free()

        async def fork_later(after: int) -> None:
            for _ in range(after):
                await anyio.lowlevel.checkpoint()
            STATS["forks_in_flight"] += any(o[0] == "unfinished" for o in outcomes)
            STATS["forks_while_opening"] += state[0] == "opening"
            children.append((LiveChild(lambda: lock_descriptors(self.path),
                                       child_reads(self.path, self.backend)), state[0]))

        async def kill_peer_later(peer: PeerReader, after: int) -> None:
            for _ in range(after):
                await anyio.lowlevel.checkpoint()
            peer.kill()  # (most likely mid-read: its mark stays, a waiting put recovers it)

        async def body(round_forks: int | None) -> None:
            crashed = False
            if crash is not None:
                self.disk.crash_at = self.disk.ops + crash[0]
            store: kvstore.Store | None = None
            try:
                with anyio.fail_after(ROUND_DEADLINE):
                    state[0] = "opening"
                    async with self.open() as store:
                        state[0] = "open"
                        round_stats["used_before"] = store.used_bytes
                        self.arm(store, read_fault)
                        if full is not None:
                            self.full = FullDisk(self.mount, self.path / "index")
                            STATS["full_rounds"] += 1
                        async with anyio.create_task_group() as tg:
                            for i, (op, after) in enumerate(tasks):
                                tg.start_soon(cancellable, store, i, op, after, tg)
                            if close_after is not None:
                                tg.start_soon(close_later, store, close_after)
                            if round_forks is not None:
                                tg.start_soon(fork_later, round_forks)
                            if full is not None and full < 40:  # else: full to the end
                                tg.start_soon(free_later, full)
                            # (an even draw: one round in eight, so replacements,
                            # ~2 s of a core each, stay a small part of the run)
                            if peer_kill is not None and peer_kill % 2 == 0 \
                                    and self.peer is not None:
                                tg.start_soon(kill_peer_later, self.peer, peer_kill)
                        if self.full is not None and state[0] == "open":
                            self.full.free()
                            await self.put_again(store, tasks, outcomes, extra)
                        if state[0] == "open":
                            state[0] = "closing"
            except BaseException as e:
                if not is_simulated_crash(e):
                    rest = without_crashes(e)
                    if rest is e:
                        raise
                    raise rest from None
                crashed = True
            finally:
                state[0] = "closed"
                self.disk.crash_at = None
                if store is not None:
                    round_stats["evicted"] = parts(store).counters["evicted_blocks"]
                    round_stats["evicted_bytes"] = parts(store).counters["evicted_bytes"]
                    round_stats["peak"] = parts(store).allocator.peak_used_bytes
                    # dead peers this round's store recovered (at its open, or while a
                    # put waited for space a killed peer's mark held)
                    STATS["owners_recovered"] += parts(store).owner.recovered
                    # the round's gets promote blocks fetched from the remote tier: puts
                    # of their own, which make room under pressure like the tasks' puts
                    round_stats["promoted"] = (store.remote.stats().promoted_blocks
                                               if store.remote is not None else 0)
            if faulty:  # unspent when the round crashed first: never carried to the next
                self.disk.faults = [f for f in self.disk.faults if f[0] != "datasync"]
            if crashed:
                STATS["crashes"] += 1
                self.disk.crash(crash[1] if crash else "lose")
            elif faulty:
                self.disk.crash("lose")  # and then the machine loses what was unsynced

        async def go() -> None:
            # A fork drawn "opening" counts its scheduling points from before the open
            # (which runs on worker threads meanwhile), one drawn "round" from the start
            # of the round's tasks.
            async with anyio.create_task_group() as outer:
                if fork is not None and fork[0] == "opening":
                    outer.start_soon(fork_later, fork[1])
                await body(fork[1] if fork is not None and fork[0] == "round" else None)

        if self.s3 is not None:
            # A Store bounds its own requests: what the last one (the checks' store)
            # abandoned at a read deadline ends first, so the cluster's count below is
            # this round's Store alone (two Stores' requests may overlap at a cluster).
            assert self.s3.wait_idle(ROUND_DEADLINE)
        if self.s3 is not None and slow_remote:
            self.s3.hold = {"GET"}
            self.s3.rearm()
            STATS["slow_remote_rounds"] += 1
        try:
            try:
                run_within(go, self.backend, ROUND_DEADLINE * 2)
            finally:
                if self.full is not None:  # (a crash, a close in flight: still full)
                    self.full.free()
                    self.full = None
                if self.s3 is not None:
                    self.s3.release()
                    self.s3.hold = set()
                    assert self.s3.wait_idle(ROUND_DEADLINE)
            if self.s3 is not None:
                assert self.s3.max_in_flight <= REMOTE_CONCURRENCY, \
                    f"{self.s3.max_in_flight} requests in flight at the cluster"
            STATS["rounds"] += 1
            STATS["tasks"] += len(tasks)
            STATS["scheduling_points"] += self.disk.yields - yields_before
            if not faulty:  # nothing made the store read-only
                assert not any(isinstance(r, ReadOnlyError) for _, r in outcomes), \
                    "the store turned read-only without a failed write"
            self.account(tasks + [t for t, _ in extra], outcomes + [o for _, o in extra],
                         round_stats)
            self.check_quarantine()
            if self.peer is not None and self.peer.killed:  # replaced: the checks beside it
                STATS["peers_killed"] += 1
                self.peer = PeerReader(self.path, self.kind, STATS["peers_killed"])
                self.peer_seen = (0, 0)
            present = self.verify()  # reopens and checks the store while a forked child still runs
            if self.peer is not None:
                self.check_peer(self.peer.ask("report"))
            for child, at_fork in children:  # the parent has closed the store
                self.check_child(child, at_fork, present)
        finally:
            if self.full is not None:
                self.full.free()
                self.full = None
            self.disarm()
            statuses = [child.end() for child, _ in children]
        for (child, _), status in zip(children, statuses):
            STATS["forks"] += 1
            assert child.report == 0, f"a forked child kept {child.report} LOCK descriptors"
            assert status == 0, f"a forked child exited with {status}"

    def allowed(self, e: Exception, op: tuple[Any, ...],
                refusals: tuple[type[BaseException], ...], full: bool) -> bool:
        """Whether the round may refuse ``op`` with ``e``: ``refusals``, and on a full disk
        ``StoreFullError`` for the calls that write (reads need no room)."""
        if isinstance(e, StoreFullError) and not isinstance(e, CapacityError):
            if not full or op[0] not in ("put", "delete", "scrub"):
                return False
            STATS["full_refusals"] += 1
            STATS["index_full_refusals"] += "index" in str(e)
            return True
        return isinstance(e, refusals)

    async def put_again(self, store: kvstore.Store, tasks: list[tuple[tuple[Any, ...], int | None]],
                        outcomes: list[tuple[str, Any]],
                        extra: list[tuple[tuple[tuple[Any, ...], int | None], tuple[str, Any]]],
                        ) -> None:
        """Space is back: the store takes writes again in the same open.  Every put the
        full disk refused is made again, one after another (appended to ``extra`` for
        the accounting), and succeeds (or finds the store over capacity)."""
        assert not store.read_only, "a full disk turned the store read-only"
        for (op, _), (status, result) in zip(tasks, outcomes):
            if op[0] == "put" and status == "refused" and \
                    isinstance(result, StoreFullError) and not isinstance(result, CapacityError):
                extra.append(((op, None), ("unfinished", None)))
                try:
                    extra[-1] = ((op, None), ("ok", await self.do(store, op)))
                except CapacityError as e:
                    extra[-1] = ((op, None), ("refused", e))
                STATS["puts_after_full"] += 1

    async def do(self, store: kvstore.Store, op: tuple[Any, ...]) -> Any:
        kind = op[0]
        if kind == "put":
            keys = CHAINS[op[1]][:op[2]]
            return await store.put_many(keys, [VALUES[k] for k in keys],
                                        parents=[PARENTS[k] for k in keys],
                                        tags=[TAGS[k] for k in keys])
        if kind == "get":  # twice: the second read starts after the round's first deletes
            for _ in range(2):
                gone_before = self.deleted & self.unput
                got = await store.get_many(op[1])
                for k, g in zip(op[1], got):  # never wrong bytes, even mid-round
                    assert g is None or same(g, VALUES[k]), "wrong bytes"
                    assert g is None or k not in gone_before, "served a deleted block"
            return got
        if kind == "prefetch":  # into the memory tier; later gets are checked as any
            if not self.memory:
                return None
            handle = store.prefetch(op[1])
            return await handle if op[2] else None
        if kind == "match":
            n = await store.match_prefix(CHAINS[op[1]])
            assert 0 <= n <= len(CHAINS[op[1]])
            return n
        if kind == "scrub":  # beside the round's puts, deletes and evictions
            STATS["scrubs"] += 1
            return await store.scrub(rate_bytes_per_s=None)
        keys = CHAINS[op[1]][op[2]:]
        deleted = await store.delete_many(keys)
        self.deleted |= set(keys)
        return deleted

    def account(self, tasks: list[tuple[tuple[Any, ...], int | None]],
                outcomes: list[tuple[str, Any]], round_stats: dict[str, int]) -> None:
        """Update the model from what was acknowledged; check the capacity rules."""
        put_need = puts = 0
        for (op, _), (status, result) in zip(tasks, outcomes):
            if op[0] == "put":
                keys = CHAINS[op[1]][:op[2]]
                # what it wrote (a prefix put skips the stored head of its chain), plus
                # one block; all of it when it did not say
                wrote = keys[len(keys) - result.written:] if status == "ok" else keys
                put_need += sum(SLOTS[k] for k in wrote)
                puts += 1
                if status == "ok":
                    self.acked |= set(keys)
                    self.maybe -= set(keys)
                else:
                    self.maybe |= set(keys) - self.acked
            elif op[0] == "delete":
                keys = set(CHAINS[op[1]][op[2]:])
                if status == "ok":
                    self.acked -= keys
                    self.maybe -= keys
                else:
                    self.maybe |= keys & self.acked
                    self.acked -= keys
        # A put and a delete of one key in the same round: which ran last decides.
        put_keys = {k for (op, _) in tasks if op[0] == "put" for k in CHAINS[op[1]][:op[2]]}
        deleted = {k for (op, _) in tasks if op[0] == "delete" for k in CHAINS[op[1]][op[2]:]}
        self.maybe |= put_keys & deleted
        self.acked -= put_keys & deleted
        promoted = round_stats.get("promoted", 0)
        put_need += promoted * MAX_SLOT
        puts += promoted
        STATS["round_promotions"] += promoted
        evicted = round_stats.get("evicted", 0)
        self.evicted += evicted
        STATS["evictions"] += evicted
        assert round_stats.get("peak", 0) <= CAPACITY, "used bytes exceeded capacity"
        if evicted:
            short = round_stats["used_before"] + put_need - CAPACITY
            assert short > 0, "evicted without pressure"
            assert round_stats["evicted_bytes"] <= short + puts * MAX_SLOT, \
                "evicted more than the puts needed (plus one block each)"

    def check_quarantine(self) -> None:
        """Before the reopen (whose background re-reads could put blocks back): what the
        round quarantined, as fsck sees it.  Nothing after reads that failed once (they
        were retried) or none at all; after a bad sector, only blocks on it (and they
        verify: fsck, reading past the fault, finds them restorable)."""
        aimed, self.faults.path = self.faults.path, None  # past it: fsck reads through the
        try:  # thread-pool engine too, whose reads fail where it aims
            report = fsck.check(str(self.path))
        finally:
            self.faults.path = aimed
        held = [f for f in report.findings
                if f.kind in ("restorable", "quarantined", "unreadable")]
        assert len(held) == report.quarantined
        if self.armed != "persistent":
            assert not held, ("quarantined without a lasting read error: "
                              f"{[f.detail for f in held]}")
        for f in held:
            assert f.kind == "restorable", f.detail
            assert overlaps(self.faults, self.path, f.extent, f.offset, f.length), \
                f"a block off the failing sector was quarantined: {f.detail}"

    def verify(self) -> set[bytes]:
        """After the round (and any crash): read everything back and run fsck.  With a
        bad sector still failing, read once with it (it costs the blocks on it only),
        then clear it and scrub (they come back).  Returns the blocks present."""
        opened: list[kvstore.Store] = []

        async def read() -> list[torch.Tensor | None]:
            async with self.open() as store:
                opened.append(store)
                got = await store.get_many(POOL)
                held = parts(store).index.quarantine_records.of(POOL)
                if self.armed != "persistent":
                    assert not held, f"quarantined without a lasting read error: {held}"
                    return got
                for e, unreadable in held.values():
                    assert unreadable and overlaps(self.faults, self.path, e.extent, e.offset,
                                                   e.slot_len), "quarantined off the sector"
                self.disarm()  # the sector reads again
                await store.scrub(rate_bytes_per_s=None)
                healed = await store.get_many(POOL)
                before = {k for k, g in zip(POOL, got) if g is not None}
                after = {k for k, g in zip(POOL, healed) if g is not None}
                if self.s3 is None:  # (a remote read past its deadline is a miss, by design)
                    assert before <= after, "a scrub lost blocks"
                    assert after - before <= set(held), "blocks off the failing sector were missing"
                assert not parts(store).index.quarantine_records.of(POOL), \
                    "a block that reads again stayed quarantined after a scrub"
                STATS["blocks_restored"] += len(after - before)
                return healed

        got = dict(zip(POOL, run_within(read, self.backend, ROUND_DEADLINE)))
        self.disarm()
        self.check_tags()
        # Reading evicts too: blocks fetched from the remote tier are promoted into the
        # store (a put), which makes room under capacity pressure like any other.
        read_evictions = parts(opened[0]).counters["evicted_blocks"]
        STATS["owners_recovered"] += parts(opened[0]).owner.recovered  # (killed peers)
        self.evicted += read_evictions
        STATS["evictions"] += read_evictions
        STATS["read_evictions"] += read_evictions
        for k, g in got.items():
            assert g is None or same(g, VALUES[k]), "G2: wrong bytes"
        present = {k for k, g in got.items() if g is not None}
        # (with a remote tier a block evicted here may come back from the bucket without
        # its parent: the chain rules are the local store's)
        for chain in CHAINS if self.s3 is None else []:
            seen_gap = False  # an unacknowledged prefix put is whole or absent
            for k in chain:
                if k not in present:
                    seen_gap = True
                elif seen_gap and not self.deletes:
                    raise AssertionError("a chain has a hole")
        gone = self.acked - present
        STATS["g1_checks"] += len(self.acked)
        assert not (gone & set(PINNED)), "a pinned block was evicted"
        self.missing += len(gone)
        assert self.missing <= self.evicted, f"G1: {len(gone)} acknowledged blocks lost"
        self.acked -= gone
        self.acked |= present & self.maybe  # they are stored: from now on they must stay
        self.maybe -= present
        report = fsck.check(str(self.path))
        assert not report.damage, [f.detail for f in report.damage]
        assert "orphan-tag" not in {f.kind for f in report.findings}, "a tag outlived its block"
        assert report.quarantined == 0, "a block stayed quarantined"
        if not self.deletes and self.s3 is None:
            assert report.chain_holes == 0, report.chain_hole_examples
        return present

    def check_tags(self) -> None:
        """Every stored block has its put's tag (none only for a block the remote tier
        brought back after eviction: promotions carry no tag), and no tag outlives its
        block (fsck finds no orphan tag)."""
        async def listed() -> dict[bytes, bytes | None]:
            async with self.open() as store:
                return {b.key: b.tag async for page in store.snapshot() for b in page}

        for k, tag in run_within(listed, self.backend, ROUND_DEADLINE).items():
            assert tag == TAGS[k] or (tag is None and self.s3 is not None), "a tag was lost"
        STATS["tag_checks"] += 1

    def check_peer(self, seen: dict[str, Any]) -> None:
        """The peer process never read wrong bytes (the machine's deletes, evictions and
        reuse of freed space raced its reads) and no read of it failed."""
        assert not seen["wrong"], f"G2: the peer process read wrong bytes of {seen['wrong']}"
        assert not seen["errors"], f"the peer process's reads failed: {seen['errors']}"
        STATS["peer_reads"] += seen["reads"] - self.peer_seen[0]
        STATS["peer_hits"] += seen["hits"] - self.peer_seen[1]
        self.peer_seen = (seen["reads"], seen["hits"])

    def check_child(self, child: LiveChild, at_fork: str, present: set[bytes]) -> None:
        """A forked child, now that the parent has closed the store, opens it itself.
        Forked while the store was closed, it reads what the parent read (less, with a
        remote tier the child has not: the parent's reads were served from there too).
        Forked while it was open (or opening, or closing), it may be refused, with a
        ``KVStoreError``: the LMDB binding keeps the parent's index environment
        registered in the child, which refuses to open it again (docs/api.md, Fork);
        nothing changes (the next round and fsck see to that).  It never hangs (a fork
        guard inherited held would: ``LiveChild.ask`` fails after its deadline)."""
        answer = json.loads(child.ask(b"read"))
        if "error" in answer:
            assert at_fork != "closed", \
                f"a child forked while the store was closed could not open it: {answer['error']}"
            assert answer["typed"], f"a forked child's open raised {answer['error']}"
            STATS["child_refusals"] += 1
            return
        assert not answer["wrong"], "G2: wrong bytes in a forked child"
        seen = {POOL[i] for i in answer["present"]}
        assert seen <= present if self.s3 is not None else seen == present, \
            f"the forked child read {len(seen)} blocks, the parent {len(present)}"
        STATS["child_reads"] += 1


class AsyncioMachine(ConcurrentMachine):
    backend = "asyncio"


class TrioMachine(ConcurrentMachine):
    backend = "trio"


MACHINES = {"asyncio": AsyncioMachine, "trio": TrioMachine}


@pytest.fixture
def machines_small_fs(request: pytest.FixtureRequest) -> Any:
    """The small file system (tests/test_full_disk.py) for the machines that draw it;
    without one (not root, no mkfs.ext4), they run where the others do."""
    try:
        ConcurrentMachine.small_fs = request.getfixturevalue("small_fs")
    except pytest.skip.Exception:
        ConcurrentMachine.small_fs = None
    yield
    ConcurrentMachine.small_fs = None


def machine_settings(**budget: int) -> settings:
    """The current profile's settings (its seed, derandomisation and example database,
    tests/conftest.py) with a budget of machines a third of its examples (at least 20,
    8 rounds each: ~10 s a backend under ``ci``), or ``budget`` as given."""
    current = settings()
    return settings(current, **{"max_examples": max(20, current.max_examples // 3),
                                "stateful_step_count": 8, **budget})


@pytest.mark.hypothesis  # CI's randomised pass selects it by this mark (.ci/run)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.usefixtures("machines_small_fs")
def test_concurrent_rounds(backend: str) -> None:
    run_state_machine_as_test(MACHINES[backend], settings=machine_settings())


@pytest.mark.slow
@pytest.mark.hypothesis
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.usefixtures("machines_small_fs")
def test_concurrent_rounds_long(backend: str) -> None:
    run_state_machine_as_test(MACHINES[backend],
                              settings=machine_settings(max_examples=60, stateful_step_count=15))
