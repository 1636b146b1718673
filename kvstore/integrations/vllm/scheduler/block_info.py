"""The tag body of a block the scheduler plans to save
(:mod:`kvstore.integrations.vllm.block_tags`): what vLLM's ``BlockStored`` carries of
it, which only the scheduler knows (the request's tokens, raw block hashes, LoRA name,
extra keys).  The worker puts its scope in front and stores it with the block.
"""

from __future__ import annotations

from typing import Any

from kvstore.integrations.vllm import block_tags
from kvstore.integrations.vllm.block_tags import BlockInfo

__all__ = ["block_tag_body"]


def _extra_keys(request: Any, start: int, end: int) -> tuple[Any, ...] | None:
    """The block's entry of vLLM's event ``extra_keys`` (vLLM's own helpers, so the
    entries are what its GPU events publish); None without vLLM."""
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )
    except ImportError:  # (unit tests without vLLM)
        return None
    keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    converted = to_event_extra_keys([keys])
    return None if converted is None else converted[0]


def block_tag_body(request: Any, idx: int, block_size: int, group: int = 0) -> bytes | None:
    """The tag body of block ``idx`` of ``request`` in KV cache ``group`` (None when the
    request has no hash for it)."""
    hashes = request.block_hashes
    if idx >= len(hashes):
        return None
    start, end = idx * block_size, (idx + 1) * block_size
    lora = getattr(request, "lora_request", None)
    info = BlockInfo(bytes(hashes[idx]), bytes(hashes[idx - 1]) if idx else None,
                     tuple(request.all_token_ids[start:end]),
                     None if lora is None else str(lora.name),
                     _extra_keys(request, start, end), group)
    return block_tags.encode(info)
