"""Which blocks of a request the vLLM connector saves in a step (scheduler side).

Kept apart from :mod:`kvstore.integrations.vllm` so that it imports without vLLM and is
unit-tested over recorded scheduler outputs.

Each request has a mark: the blocks before it were planned already.  In each step in
which the request is scheduled, every block from the mark on is planned whose KV is
computed by the end of the step (it lies below ``computed + scheduled`` tokens), that
is allocated, and whose hash is known; the mark then moves past them.  A block whose
hash is not known yet stays after the mark and is planned in a later step.  That is
what async scheduling needs: a block completed by a decode step has its last token
sampled only after the step was scheduled, so its hash appears a step later, when the
block is no longer among the step's new tokens.  Speculative tokens have no hash until
they are accepted, so KV of rejected drafts is never saved.

The mark starts after the prefix the request found cached when it is first scheduled
(vLLM's prefix cache or kvstore: those blocks are stored already).
"""

from __future__ import annotations

__all__ = ["SaveMark", "plan_saves"]


class SaveMark:
    """A request's mark (``None`` until it is first scheduled)."""

    __slots__ = ("planned",)

    def __init__(self) -> None:
        self.planned: int | None = None


def plan_saves(mark: SaveMark, computed: int, scheduled: int, block_size: int,
               known_hashes: int, allocated_blocks: int) -> range:
    """Block indices to save in this step; moves ``mark`` past them.

    ``computed``: tokens whose KV existed before the step; ``scheduled``: tokens the
    step computes; ``known_hashes``: full blocks whose hash is known;
    ``allocated_blocks``: blocks the request holds.
    """
    start = computed // block_size if mark.planned is None else mark.planned
    end = max(start, min((computed + scheduled) // block_size, known_hashes,
                         allocated_blocks))
    mark.planned = end
    return range(start, end)
