"""Hybrid models: what the vLLM connector stores and loads per KV cache group, and what a
hit at token N needs (kept apart from :mod:`kvstore.integrations.vllm` so that it
imports without vLLM and is unit-tested on its own).

With vLLM's hybrid KV cache manager on, a model's layers fall into KV cache groups, one
per kind of layer (full attention, sliding-window attention, Mamba / linear-attention
state), each with its own block table over one shared block pool.  Every group hashes
its blocks with the request's one list of block hashes; a group's block at position p
is stored under the hash of p with the group's index appended (vLLM's own
``make_block_hash_with_group_id`` does the same), scoped by a namespace that covers the
group structure (:meth:`GroupPlan.describe`).

What a hit at N (``n`` blocks past the local hit) needs, per group:

* full attention: every block before N;
* sliding window w: the ``cdiv(w - 1, block size)`` blocks that end at N (vLLM's
  ``SlidingWindowManager`` needs no more: earlier blocks are outside every window the
  model still attends to);
* Mamba / linear attention: the one state vLLM keeps at N (the block at N / bs - 1).

:func:`longest_hit` is the largest ``n`` for which every group's parts are stored: the
hit is shorter, never partial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Group", "GroupPlan", "Part", "group_hash", "longest_hit"]

Kind = Literal["full", "sliding", "state"]

# vLLM's KV cache spec classes the connector stores, by name (importable without vLLM).
_KINDS: dict[str, Kind] = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding",
                           "MambaSpec": "state"}


def group_hash(block_hash: bytes, group: int) -> bytes:
    """A group's hash of a block: vLLM's block hash with the group's index appended
    (as vLLM's ``make_block_hash_with_group_id``)."""
    return block_hash + group.to_bytes(4, "big")


@dataclass(frozen=True)
class Group:
    index: int
    kind: Kind
    layers: tuple[str, ...]
    window_blocks: int  # sliding: the blocks a hit needs before N; else 0
    description: str  # everything of the spec that makes stored bytes of it usable


@dataclass(frozen=True)
class Part:
    """One stored part of a hit: a group's block at a position of the request."""

    group: int
    position: int  # block position in the request
    block_id: int  # vLLM's block id in that group
    hash: bytes  # the group's hash (group_hash)


def _spec_description(kind: Kind, spec: Any) -> str:
    fields = ["block_size", "sliding_window", "num_kv_heads", "head_size", "head_size_v",
              "dtype", "shapes", "dtypes", "mamba_type", "page_size_padded",
              "num_speculative_blocks", "mamba_cache_mode", "tp_replicated"]
    items = [f"{f}={getattr(spec, f)!r}" for f in fields if hasattr(spec, f)]
    return f"{kind}:{type(spec).__name__}({','.join(items)})"


class GroupPlan:
    """The KV cache groups of one engine, from vLLM's ``KVCacheConfig``."""

    def __init__(self, groups: Sequence[Group], block_size: int) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self.layer_group = {name: (g.index, i) for g in self.groups
                            for i, name in enumerate(g.layers)}

    @classmethod
    def of(cls, kv_cache_config: Any, block_size: int) -> GroupPlan:
        """The plan of ``kv_cache_config``; a kind of group the connector cannot store
        (chunked local attention, MLA, encoder caches, ...) is refused with a
        ValueError that names it."""
        groups = []
        for index, spec_group in enumerate(kv_cache_config.kv_cache_groups):
            spec = spec_group.kv_cache_spec
            kind = _KINDS.get(type(spec).__name__)
            if kind is None:
                raise ValueError(
                    f"kvstore connector: KV cache group {index} is a "
                    f"{type(spec).__name__}; the connector stores full attention, sliding "
                    "window and Mamba/linear-attention groups only")
            if spec.block_size != block_size:
                raise ValueError(
                    f"kvstore connector: KV cache group {index} has block size "
                    f"{spec.block_size}, the scheduler {block_size}; groups with their own "
                    "block sizes are not supported")
            window = 0
            if kind == "sliding":
                window = -(-(int(spec.sliding_window) - 1) // block_size)
            groups.append(Group(index, kind, tuple(spec_group.layer_names), window,
                                _spec_description(kind, spec)))
        return cls(groups, block_size)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def has_state(self) -> bool:
        return any(g.kind == "state" for g in self.groups)

    def describe(self) -> str:
        """The group structure, for the key scope: a restart with another structure
        (window, state shapes or dtypes, block size, layers) is a cold cache."""
        return ";".join(f"{g.index}:{g.description}:{','.join(g.layers)}"
                        for g in self.groups)

    def load_parts(self, block_ids: Sequence[Sequence[int]], hashes: Sequence[bytes],
                   first: int, n: int) -> list[Part]:
        """The parts to load for an external hit of ``n`` blocks after ``first`` local
        ones: every group's allocated (non-null) blocks at those positions, which is
        what the hit needs (vLLM nulls a sliding-window block outside the window and
        every state block but the last)."""
        parts = []
        for g in self.groups:
            ids = block_ids[g.index]
            for p in range(first, min(first + n, len(ids))):
                if ids[p] != 0:
                    parts.append(Part(g.index, p, ids[p], group_hash(hashes[p], g.index)))
        return parts


def longest_hit(plan: GroupPlan, hashes: Sequence[bytes],
                present: Callable[[list[bytes]], list[bool]]) -> int:
    """The largest ``n <= len(hashes)`` at which every group's parts are stored
    (``present``: which of the given group hashes are stored, in order).  Linear in
    the blocks: per group, the run of stored blocks ending at each position."""
    m = len(hashes)
    if not m:
        return 0
    got = present([group_hash(h, g.index) for g in plan.groups for h in hashes])
    limit = m
    checks: list[tuple[Group, list[int]]] = []
    for i, g in enumerate(plan.groups):
        have = got[i * m:(i + 1) * m]
        if g.kind == "full":
            limit = min(limit, next((p for p, ok in enumerate(have) if not ok), m))
            continue
        runs, run = [], 0
        for ok in have:
            run = run + 1 if ok else 0
            runs.append(run)
        checks.append((g, runs))

    def serves(n: int) -> bool:
        # sliding: the window's blocks before n (fewer from position 0); state: n - 1
        return all(runs[n - 1] >= (min(n, g.window_blocks) if g.kind == "sliding" else 1)
                   for g, runs in checks)

    return next((n for n in range(limit, 0, -1) if serves(n)), 0)
