"""The connector's save planning over recorded scheduler-output sequences (no vLLM)."""

from __future__ import annotations

from kvstore.integrations.vllm.scheduler.save_plan import SaveMark, plan_saves

BS = 4


def run(steps: list[tuple[int, int, int, int]]) -> list[list[int]]:
    """Plan each (computed, scheduled, known hashes, allocated blocks) step in order."""
    mark = SaveMark()
    return [list(plan_saves(mark, c, s, BS, h, a)) for c, s, h, a in steps]


def test_prefill_then_sync_decode_saves_every_full_block_once() -> None:
    # 10-token prompt: blocks 0 and 1 are full after the prefill; decode fills block 2
    # at token 12 (its hash is known when the step that computes token 11 is planned).
    steps = [(0, 10, 2, 3), (10, 1, 2, 3), (11, 1, 3, 3), (12, 1, 3, 4)]
    assert run(steps) == [[0, 1], [], [2], []]


def test_async_scheduling_saves_decode_blocks_a_step_late() -> None:
    """With async scheduling the block's last token is sampled after the step that
    completes it was planned: its hash appears one step later, and it must be planned
    then (the old planner only looked at the step's own new tokens and lost it)."""
    steps = [(0, 10, 2, 3),
             (10, 1, 2, 3),
             (11, 1, 2, 3),   # computes token 11: block 2 full, hash still unknown
             (12, 1, 3, 4),   # hash known now, though the step's tokens are block 3's
             (13, 1, 3, 4)]
    assert run(steps) == [[0, 1], [], [], [2], []]


def test_a_cached_prefix_is_not_planned_again() -> None:
    # 6 blocks found cached (vLLM's prefix cache or kvstore) when first scheduled.
    assert run([(24, 9, 8, 9), (33, 1, 8, 9)]) == [[6, 7], []]


def test_chunked_prefill_plans_each_chunk() -> None:
    assert run([(0, 6, 5, 6), (6, 6, 5, 6), (12, 8, 5, 6)]) == [[0], [1, 2], [3, 4]]


def test_preemption_and_recompute_do_not_save_twice() -> None:
    # Saved blocks 0-2, preempted, resumed from scratch (computed 0): nothing again
    # until block 3.
    steps = [(0, 12, 3, 3), (12, 1, 3, 4), (0, 13, 3, 4), (13, 3, 4, 4)]
    assert run(steps) == [[0, 1, 2], [], [], [3]]


def test_speculative_tokens_are_never_planned_without_a_hash() -> None:
    # 3 draft tokens scheduled past the known tokens: block 2's hash is not known.
    assert run([(0, 8, 2, 3), (8, 4, 2, 3)]) == [[0, 1], []]


def test_a_request_without_hashes_plans_nothing() -> None:
    assert run([(0, 40, 0, 10), (40, 1, 0, 11)]) == [[], []]
