"""The blocks every system stores: same bytes for kvstore and every peer.

Blocks are bf16 KV blocks shaped like an engine's, ``[2 (K/V), layers, 16 tokens,
8 heads, 128]`` with the layer count chosen to give the block size (64 KiB = 1 layer,
2 MiB = 32 layers of a Llama-3-8B-like model, 32 MiB = 512 layers-equivalent), filled
with activation-scaled normals from a seeded generator, so FP8 sees realistic values and
a peer process (another virtual environment, same torch) regenerates the identical
bytes instead of receiving them over a pipe.  ``fingerprint`` lets both sides check that.

Each block is its own tensor (not a view of one big buffer): ``torch.save`` writes a
view's whole storage, which would inflate that peer's bytes.
"""

from __future__ import annotations

import hashlib
import zlib

import torch

KV, TOKENS, HEADS, HEAD_DIM = 2, 16, 8, 128
LAYER_BYTES = KV * TOKENS * HEADS * HEAD_DIM * 2  # bf16: 64 KiB per layer
# [kv, layers, tokens, heads, dim]: KVLayout(kv_axis=0, token_axis=2, head_axis=3)
LAYOUT_AXES = (0, 2, 3)


def block_shape(block_bytes: int) -> tuple[int, ...]:
    if block_bytes % LAYER_BYTES or block_bytes <= 0:
        raise ValueError(f"block size {block_bytes} is not a positive multiple of "
                         f"{LAYER_BYTES} bytes (one layer of [2,16,8,128] bf16)")
    return (KV, block_bytes // LAYER_BYTES, TOKENS, HEADS, HEAD_DIM)


def make_blocks(block_bytes: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` distinct bf16 blocks of ``block_bytes`` each (deterministic)."""
    shape = block_shape(block_bytes)
    g = torch.Generator().manual_seed(seed * 1_000_003 + block_bytes)
    return [(torch.randn(shape, generator=g) * 2).to(torch.bfloat16) for _ in range(count)]


def block_key(seed: int, block_bytes: int, i: int) -> bytes:
    """A 16-byte key for block ``i`` (used by every system; peers use its hex)."""
    return hashlib.blake2b(f"{seed}:{block_bytes}:{i}".encode(), digest_size=16).digest()


def fingerprint(blocks: list[torch.Tensor]) -> int:
    """CRC32 over the first and last block's bytes: both processes hold the same data."""
    crc = 0
    for b in (blocks[0], blocks[-1]):
        crc = zlib.crc32(b.view(torch.uint8).numpy().tobytes(), crc)
    return crc
