"""Where the remote tier meets the local store: the few calls ``kvstore/store.py``
makes (its hooks are marked "remote tier") and what they need from the store.

* ``read_slot``: an upload reads its block back from the extent file (buffered
  ``pread`` on a worker thread, under a read epoch so the slot is not reused meanwhile)
  and verifies it against the index entry before it leaves the node.
* ``fill_misses`` (get_many), ``extend_prefix`` (match_prefix), ``fetch_missing``
  (prefetch): fetch what the local store lacks, decode it like a local slot, and
  promote it: a local durable put (which also fills the memory tier), so the next get
  is local.  Lossless blocks keep their codec; lossy (FP8) blocks are stored as the
  tensor the get returned, so a local hit reads back exactly what the remote one did.
  Promotion is best effort (a read-only or full store still answers from the remote).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import torch

from kvstore import codecs
from kvstore.codecs import CodecSpec
from kvstore.errors import CorruptionError, KVStoreError
from kvstore.extents import extent_path
from kvstore.format import SLOT_HEADER_BYTES, SlotHeader
from kvstore.remote import objects
from kvstore.remote.tier import RemoteBlock
from kvstore.slots import check_payload, check_slot
from kvstore.tensors import CODE_DTYPES, check_out

if TYPE_CHECKING:
    from kvstore.store import Store

_RAW = CodecSpec()
_ZSTD = CodecSpec(zstd=True)


def _pread(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


async def read_slot(store: Store, key: bytes) -> tuple[bytes, SlotHeader] | None:
    """The verified slot bytes of a stored block, or None if it is gone (evicted,
    deleted) or fails verification (then fsck / the next get deal with it)."""
    entry = store.index.get_entries([key])[0]
    if entry is None:
        return None
    epoch = store.allocator.begin_read()
    try:
        raw = await anyio.to_thread.run_sync(
            _pread, extent_path(store.path, entry.extent), entry.offset,
            SLOT_HEADER_BYTES + entry.payload_len)
    except OSError:
        return None
    finally:
        store.allocator.end_read(epoch)
    try:
        header = check_slot(raw, key, entry)
        check_payload(raw, header)
    except CorruptionError:
        return None
    return raw, header


def _spec_for(codec: int) -> CodecSpec:
    return _ZSTD if codec == codecs.CODEC_RAW | codecs.ZSTD else _RAW


async def _promote(store: Store, blocks: Sequence[tuple[RemoteBlock, torch.Tensor]]) -> None:
    """Store fetched blocks locally (grouped by codec).  Best effort."""
    remote = store.remote
    if not blocks or remote is None or store.read_only or store._closed:
        return
    groups: dict[int, list[tuple[RemoteBlock, torch.Tensor]]] = {}
    for block, value in blocks:
        spec_id = block.header.codec if codecs.is_lossless(block.header.codec) else 0
        groups.setdefault(spec_id, []).append((block, value))
    for codec, group in groups.items():
        try:
            result = await store._put_many([b.key for b, _ in group], [v for _, v in group],
                                           [b.header.parent for b, _ in group],
                                           _spec_for(codec))
        except KVStoreError:
            continue
        remote._stats.promoted_blocks += result.written


def _decode(block: RemoteBlock, out: torch.Tensor | None) -> torch.Tensor:
    if out is not None:
        dtype = CODE_DTYPES[block.header.dtype]
        check_out(out, block.header.dtype, (block.header.raw_len // dtype.itemsize,))
    return objects.decode(block.data, block.key, block.header, out)


async def _fetch_decode(store: Store, keys: Sequence[bytes], outs: Sequence[torch.Tensor | None],
                        *, chain: bool) -> list[torch.Tensor | None]:
    remote = store.remote
    assert remote is not None
    blocks = await remote.fetch(keys, chain=chain)
    values: list[torch.Tensor | None] = [None] * len(keys)
    fetched = [(i, b) for i, b in enumerate(blocks) if b is not None]
    if not fetched:
        return values

    def decode_all() -> None:
        for i, block in fetched:
            values[i] = _decode(block, outs[i])

    await anyio.to_thread.run_sync(decode_all)
    promote = []
    for i, block in fetched:
        value = values[i]
        assert value is not None
        # promote from tensors of our own (an ``out`` tensor is the caller's)
        promote.append((block, value if outs[i] is None else value.clone()))
    await _promote(store, promote)
    return values


async def fill_misses(store: Store, keys: Sequence[bytes], outs: Sequence[torch.Tensor | None],
                      results: list[torch.Tensor | None]) -> None:
    """get_many: blocks the local store did not answer, from the remote."""
    miss = [i for i, r in enumerate(results) if r is None]
    if not miss:
        return
    got = await _fetch_decode(store, [keys[i] for i in miss], [outs[i] for i in miss],
                              chain=False)
    for i, value in zip(miss, got):
        results[i] = value


async def extend_prefix(store: Store, keys: Sequence[bytes]) -> int:
    """match_prefix: how many of ``keys`` (the chain after the local prefix) the remote
    has, in order; they are fetched and promoted."""
    got = await _fetch_decode(store, keys, [None] * len(keys), chain=True)
    return next((i for i, v in enumerate(got) if v is None), len(got))


async def fetch_missing(store: Store, keys: Sequence[bytes]) -> None:
    """prefetch: blocks absent locally are fetched and promoted first (the prefetch then
    brings them into memory like any stored block)."""
    entries = store.index.get_entries(keys)
    missing = [k for k, e in zip(keys, entries) if e is None]
    if missing:
        await _fetch_decode(store, missing, [None] * len(missing), chain=False)
