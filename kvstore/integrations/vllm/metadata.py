"""What vLLM's scheduler side hands its workers each step (the only state the two
halves of the connector share): the loads to start and the blocks to save, in
:class:`KVStoreConnectorMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.integrations.vllm.groups import Part

__all__ = ["HybridLoad", "KVStoreConnectorMetadata", "Load", "Save"]


@dataclass
class Load:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class HybridLoad:
    """A hybrid model's load: every part (each group's block) the hit needs, loaded
    all or nothing (:mod:`kvstore.integrations.vllm.groups`)."""

    req_id: str
    parts: list[Part]


@dataclass
class Save:
    block_id: int
    hash: bytes
    parent_hash: bytes | None
    # The block's tag body for vLLM's KV events (kvstore.integrations.vllm.block_tags:
    # vLLM's raw hashes, token ids, LoRA name, extra keys, group); the worker puts its
    # scope in front.  None: stored untagged.
    info: bytes | None = None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: requests whose blocks to load (per request, in
    chain order), blocks to save (full, computed by the end of the step, not planned
    before), and whether the step runs no forward (the worker may then wait a little
    for loads instead of returning at once)."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    idle: bool = False
    # The scheduler's key scope: how often it moved (reset_cache) and the weights item
    # of the scope now.  The worker moves with it before this step's loads and saves.
    scope_epoch: int = 0
    weights: str = ""
    # A hybrid model (several KV cache groups): its loads, and per group the blocks to
    # save (the group's hashes: each group's block is a block of its own in the store).
    hybrid_loads: list[HybridLoad] = field(default_factory=list)
    groups: list[KVStoreConnectorMetadata] = field(default_factory=list)


