"""A hybrid model's loads and saves on the vLLM connector's scheduler side, per KV cache
group (:mod:`kvstore.integrations.vllm.groups`).

*Saves.*  Attention groups (full and sliding window) save every block the save plan
lists (:mod:`kvstore.integrations.vllm.scheduler.save_plan`) that the group holds (a
sliding-window block vLLM already let go is null and skipped).  Sliding-window blocks
are stored densely, so that a hit can end at any block boundary, as it can for full
attention.  A state group's block table holds states only where a prefill chunk ended,
and vLLM frees or overwrites them a step later: states are saved only where vLLM offers
them (``boundary_state_offloads``, the states it keeps as prefix-cache entries), copied
in the same step's ``wait_for_save``.

*Chains.*  A full-attention block's parent is the block before it; a sliding-window
block's and a state's parent is the first full-attention group's block at the same
position.  The store evicts a block only after its children: a state or window block
goes before the attention prefix it extends, never the other way round, so eviction
shortens hits and never leaves one that needs a part that is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.integrations.vllm.groups import GroupPlan, group_hash
from kvstore.integrations.vllm.metadata import HybridLoad, KVStoreConnectorMetadata, Save

__all__ = ["GroupSaves"]


def _no_info(idx: int, group: int) -> bytes | None:
    return None


def _no_state_info(req_id: str, idx: int, group: int) -> bytes | None:
    return None


class GroupSaves:
    """One engine's per-group planning (module docstring)."""

    def __init__(self, plan: GroupPlan) -> None:
        self.plan = plan
        full = [g.index for g in plan.groups if g.kind == "full"]
        self._anchor = full[0] if full else None  # the group other groups hang on
        self._pending: list[HybridLoad] = []

    def load(self, req_id: str, block_ids: Sequence[Sequence[int]], hashes: Sequence[bytes],
             first: int, n: int) -> None:
        """An external hit of ``n`` blocks after ``first`` local ones was allocated."""
        self._pending.append(HybridLoad(req_id, self.plan.load_parts(block_ids, hashes,
                                                                     first, n)))

    def begin_step(self, meta: KVStoreConnectorMetadata) -> None:
        """The step's loads, and a metadata of its own per group for the saves."""
        meta.hybrid_loads, self._pending = self._pending, []
        meta.groups = [KVStoreConnectorMetadata() for _ in self.plan.groups]

    def _parent(self, group: int, hashes: Sequence[bytes], idx: int) -> bytes | None:
        kind = self.plan.groups[group].kind
        if kind == "full":
            return group_hash(hashes[idx - 1], group) if idx else None
        return None if self._anchor is None else group_hash(hashes[idx], self._anchor)

    def save_blocks(self, block_ids: Sequence[Sequence[int]], hashes: Sequence[bytes],
                    planned: range, meta: KVStoreConnectorMetadata,
                    info: Callable[[int, int], bytes | None] = _no_info) -> None:
        """Attention groups' blocks at the planned positions; ``info(idx, group)``: the
        block's tag body (:mod:`kvstore.integrations.vllm.scheduler.block_info`)."""
        for g in self.plan.groups:
            if g.kind == "state" or g.index >= len(block_ids):
                continue
            ids = block_ids[g.index]
            for idx in planned:
                if idx < len(ids) and ids[idx] != 0:
                    meta.groups[g.index].saves.append(Save(
                        ids[idx], group_hash(hashes[idx], g.index),
                        self._parent(g.index, hashes, idx), info(idx, g.index)))

    def save_states(self, scheduler_output: Any, meta: KVStoreConnectorMetadata,
                    hashes_of: Callable[[str], list[bytes]],
                    info_of: Callable[[str, int, int], bytes | None] = _no_state_info
                    ) -> None:
        """The states vLLM offers this step (``boundary_state_offloads``:
        ``{req_id: [(group, block id, boundary tokens)]}``), valid until the step
        ends; ``info_of(req_id, idx, group)``: a state's tag body."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        bs = self.plan.block_size
        for req_id, states in offers.items():
            hashes = hashes_of(req_id)
            for group, block_id, boundary in states:
                idx = boundary // bs - 1
                if boundary % bs or not 0 <= idx < len(hashes) or block_id == 0 or \
                        self.plan.groups[group].kind != "state":
                    continue
                meta.groups[group].saves.append(Save(
                    block_id, group_hash(hashes[idx], group),
                    self._parent(group, hashes, idx), info_of(req_id, idx, group)))
