"""A worker's reports for vLLM's KV events over a real store, without an engine: its
scope's stored, evicted, deleted and quarantined blocks, the start-up replay in pages,
a resync after a gap, and two ranks' reports folded into one announcement per block."""

from __future__ import annotations

from pathlib import Path

import kvstore
from kvstore.integrations.vllm import block_tags
from kvstore.integrations.vllm.block_tags import BlockInfo, scoped_tag
from kvstore.integrations.vllm.rank_reports import BUSY, REMOVED, RESYNC, SETTLED, STORED
from kvstore.integrations.vllm.scheduler.event_fold import EventFold, Stored
from kvstore.integrations.vllm.worker.events import WorkerEvents
from kvstore.testing import parts
from tests.conformance import NS, flip_payload_bit
from tests.core.test_events import SLOT, chain, value

SCOPE, OTHER = b"S" * 16, b"O" * 16


def tags(ks: list[bytes], scope: bytes = SCOPE, first: int = 0) -> list[bytes | None]:
    return [scoped_tag(scope, block_tags.encode(BlockInfo(bytes([first + i]) * 32, None, ())))
            for i in range(len(ks))]


def put(store: kvstore.BlockingStore, ks: list[bytes], scope: bytes = SCOPE,
        first: int = 0) -> None:
    store.put_many(ks, [value(first + i) for i in range(len(ks))],
                   parents=kvstore.chain_parents(ks), tags=tags(ks, scope, first))


def opened(path: Path, **options: int) -> kvstore.BlockingStore:
    return kvstore.open_blocking(path, namespace=NS, extent_bytes=1 << 20,
                                 staging_bytes=1 << 20, **options)


def hashes(reports: list[tuple[int, int, int, bytes]], kind: int) -> list[int]:
    return [block_tags.decode(b).hash[0] for _, _, k, b in reports if k == kind]


def kinds(reports: list[tuple[int, int, int, bytes]]) -> list[int]:
    return [k for _, _, k, _ in reports]


def test_the_replay_lists_the_scope_in_pages_then_settles(tmp_path: Path) -> None:
    with opened(tmp_path / "s") as store:
        put(store, chain(5), SCOPE)
        put(store, chain(3, 10), OTHER, first=100)  # another scope in the same store
        store.put_many(chain(1, 20), [value(9)])  # untagged
        events = WorkerEvents(store, 0, lambda: False, replay=True, page_blocks=2)
        events.start(SCOPE, 0)
        steps = [events.take() for _ in range(3)]  # pages of 2, 2 and 1 blocks
        assert [len(hashes(s, STORED)) for s in steps] == [2, 2, 1]
        assert sorted(h for s in steps for h in hashes(s, STORED)) == [0, 1, 2, 3, 4]
        assert kinds(steps[0])[-1] == BUSY and kinds(steps[1]) == [STORED] * 2
        assert kinds(steps[2])[-1] == SETTLED
        assert events.take() == []  # nothing changed: nothing to say
        events.close()


def test_the_replay_lists_each_block_after_its_parent(tmp_path: Path) -> None:
    with opened(tmp_path / "s") as store:
        ks = chain(8)  # keys in chain order are not in key order
        assert sorted(ks) != ks
        chained = [scoped_tag(SCOPE, block_tags.encode(BlockInfo(
            bytes([i]) * 32, bytes([i - 1]) * 32 if i else None, ()))) for i in range(8)]
        store.put_many(ks, [value(i) for i in range(8)], parents=kvstore.chain_parents(ks),
                       tags=chained)
        events = WorkerEvents(store, 0, lambda: False, replay=True, page_blocks=3)
        events.start(SCOPE, 0)
        replayed = [h for _ in range(3) for h in hashes(events.take(), STORED)]
        assert replayed == list(range(8))
        events.close()


def test_without_replay_only_changes_are_reported(tmp_path: Path) -> None:
    with opened(tmp_path / "s", capacity_bytes=4 * SLOT) as store:
        put(store, chain(2), SCOPE)
        busy = [True]
        events = WorkerEvents(store, 1, lambda: busy[0], replay=False)
        events.start(SCOPE, 3)
        assert events.take() == [(1, 3, BUSY, b"")]  # a save in flight, nothing stored
        put(store, chain(2, 10), SCOPE, first=10)
        put(store, chain(1, 30), OTHER, first=30)
        busy[0] = False
        step = events.take()
        assert hashes(step, STORED) == [10, 11] and kinds(step)[-1] == SETTLED
        assert all(r[0] == 1 and r[1] == 3 for r in step)
        put(store, chain(3, 40), SCOPE, first=40)  # over capacity: leaves evicted
        step = events.take()
        assert hashes(step, STORED) == [40, 41, 42] and hashes(step, REMOVED)
        assert set(hashes(step, REMOVED)) <= {0, 1, 10, 11}
        store.delete_many(chain(3, 40)[2:])
        assert hashes(events.take(), REMOVED) == [42]
        events.close()


def test_a_quarantined_block_is_reported_removed(tmp_path: Path) -> None:
    with opened(tmp_path / "s") as store:
        ks = chain(2)
        put(store, ks, SCOPE)
        events = WorkerEvents(store, 0, lambda: False, replay=False)
        events.start(SCOPE, 0)
        events.take()
        entry = parts(store).index.get_entries([ks[1]])[0]
        assert entry is not None
        flip_payload_bit(tmp_path / "s", entry, at=10)
        assert store.get_many(ks)[1] is None
        assert hashes(events.take(), REMOVED) == [1]
        events.close()


def test_a_gap_resyncs_and_replays(tmp_path: Path) -> None:
    with opened(tmp_path / "s") as store:
        events = WorkerEvents(store, 0, lambda: False, replay=True, max_events=2)
        events.start(SCOPE, 0)
        assert kinds(events.take()) == [SETTLED]  # an empty store: replayed at once
        put(store, chain(5), SCOPE)  # 5 events into a buffer of 2: a gap
        step = events.take()
        assert RESYNC in kinds(step)
        after = step[kinds(step).index(RESYNC):]
        assert sorted(hashes(after, STORED)) == [0, 1, 2, 3, 4]  # the replay
        events.close()


def test_two_ranks_stores_fold_into_one_announcement_per_block(tmp_path: Path) -> None:
    with opened(tmp_path / "r0") as r0, opened(tmp_path / "r1") as r1:
        fold = EventFold(2, busy=True)
        ranks = [WorkerEvents(s, i, lambda: False, replay=True) for i, s in enumerate((r0, r1))]
        for w in ranks:
            w.start(SCOPE, 0)
        put(r0, chain(3), SCOPE)
        fold.add(ranks[0].take())
        fold.add(ranks[1].take())
        assert fold.take() == [] and not fold.pending  # rank 1 holds nothing yet
        put(r1, chain(2), SCOPE)
        fold.add(ranks[1].take())
        changes = fold.take()
        assert [[b.hash[0] for b in c.blocks] for c in changes if isinstance(c, Stored)] \
            == [[0, 1]]
        r0.delete_many(chain(3)[1:2])
        fold.add(ranks[0].take())
        assert [[h[0] for h in c.hashes] for c in fold.take()] == [[1]]
        for w in ranks:
            w.close()
