"""The scheduler's fold of the ranks' reports into vLLM's KV events, without an engine:
one announcement per block once every rank holds it, a withdrawal as soon as one rank
loses it, resets, resyncs, and whether the engine must keep stepping."""

from __future__ import annotations

from kvstore.integrations.vllm import block_tags
from kvstore.integrations.vllm.block_tags import BlockInfo
from kvstore.integrations.vllm.rank_reports import BUSY, REMOVED, RESYNC, SETTLED, STORED
from kvstore.integrations.vllm.scheduler.event_fold import EventFold, Removed, Stored


def info(i: int, group: int = 0) -> BlockInfo:
    return BlockInfo(bytes([i]) * 32, bytes([i - 1]) * 32 if i else None,
                     tuple(range(4 * i, 4 * i + 4)), group=group)


def body(i: int, group: int = 0) -> bytes:
    return block_tags.encode(info(i, group))


def stored(fold: EventFold) -> list[int]:
    return [b.hash[0] for c in fold.take() if isinstance(c, Stored) for b in c.blocks]


def test_with_two_ranks_a_block_is_announced_once_when_both_hold_it() -> None:
    fold = EventFold(2)
    fold.add([(0, 0, STORED, body(0)), (0, 0, STORED, body(1))])
    assert fold.take() == []  # rank 1 has neither yet
    fold.add([(1, 0, STORED, body(1))])
    assert stored(fold) == [1]
    fold.add([(1, 0, STORED, body(0)), (0, 0, STORED, body(1)), (1, 0, STORED, body(1))])
    assert stored(fold) == [0]  # a repeated report announces nothing again
    assert fold.announced == 2


def test_an_announced_block_is_withdrawn_when_any_rank_loses_it() -> None:
    fold = EventFold(2)
    fold.add([(r, 0, STORED, body(i)) for r in (0, 1) for i in (0, 1)])
    fold.take()
    fold.add([(1, 0, REMOVED, body(1))])
    assert fold.take() == [Removed(0, [info(1).hash])]
    fold.add([(0, 0, REMOVED, body(1))])  # already withdrawn: nothing more
    assert fold.take() == []
    fold.add([(0, 0, STORED, body(1))])
    assert fold.take() == []  # rank 1 still lacks it
    fold.add([(1, 0, STORED, body(1))])
    assert stored(fold) == [1]  # stored again by both: announced again


def test_a_block_one_rank_never_held_is_never_withdrawn() -> None:
    fold = EventFold(2)
    fold.add([(0, 0, STORED, body(3)), (0, 0, REMOVED, body(3))])
    assert fold.take() == [] and fold.announced == 0


def test_groups_are_blocks_of_their_own() -> None:
    fold = EventFold(1)
    fold.add([(0, 0, STORED, body(1, group=0)), (0, 0, STORED, body(1, group=1)),
              (0, 0, REMOVED, body(1, group=1))])
    changes = fold.take()
    assert [b.group for c in changes if isinstance(c, Stored) for b in c.blocks] == [0, 1]
    assert changes[-1] == Removed(1, [info(1).hash])


def test_a_reset_withdraws_everything_announced_and_ignores_the_old_scope() -> None:
    fold = EventFold(2)
    fold.add([(r, 0, STORED, body(i)) for r in (0, 1) for i in range(3)])
    fold.add([(0, 0, STORED, body(7))])  # held by one rank: never announced
    fold.take()
    fold.reset(1)
    removed = fold.take()
    assert [sorted(h[0] for h in c.hashes) for c in removed] == [[0, 1, 2]]
    fold.add([(r, 0, STORED, body(5)) for r in (0, 1)])  # reported before the move
    assert fold.take() == [] and fold.announced == 0
    fold.add([(1, 1, STORED, body(7)), (0, 1, STORED, body(7))])
    assert stored(fold) == [7]  # block 7 of the new scope needs both ranks anew


def test_a_resync_withdraws_what_the_rank_held_until_it_replays_it() -> None:
    fold = EventFold(2)
    fold.add([(r, 0, STORED, body(i)) for r in (0, 1) for i in range(2)])
    fold.take()
    fold.add([(0, 0, RESYNC, b"")])
    assert [sorted(h[0] for h in c.hashes) for c in fold.take()] == [[0, 1]]
    fold.add([(0, 0, STORED, body(1))])  # the rank's replay
    assert stored(fold) == [1]


def test_pending_while_any_rank_is_busy_and_at_start_with_a_replay() -> None:
    fold = EventFold(2, busy=True)
    assert fold.pending
    fold.add([(0, 0, SETTLED, b"")])
    assert fold.pending  # rank 1 has not finished its replay
    fold.add([(1, 0, SETTLED, b"")])
    assert not fold.pending
    fold.add([(1, 0, BUSY, b"")])
    assert fold.pending
    fold.reset(1, busy=False)
    fold.add([(1, 0, SETTLED, b"")])  # the old scope's: ignored
    assert fold.pending
    fold.add([(1, 1, SETTLED, b"")])
    assert not fold.pending and not EventFold(2).pending


def test_a_report_that_is_not_a_tag_is_counted_and_skipped() -> None:
    fold = EventFold(1)
    fold.add([(0, 0, STORED, b"\x09junk"), (5, 0, STORED, body(1)), (0, 0, STORED, body(2))])
    assert fold.malformed == 1 and stored(fold) == [2]


def test_consecutive_announcements_come_in_order() -> None:
    fold = EventFold(1)
    fold.add([(0, 0, STORED, body(i)) for i in range(4)])
    changes = fold.take()
    assert len(changes) == 1 and [b.hash[0] for b in changes[0].blocks] == [0, 1, 2, 3]
