"""Fetched blocks stored in the local store (promoted), through the tier port:
:class:`Promotions`, used by :class:`kvstore.tiers.remote.adapter.RemoteAdapter`.

A promotion is a local durable put (which also fills the memory tier), so the next get
is local.  It is best effort: a block that is not stored (backpressure for a background
put, a full or read-only store, a block this store cannot hold) is fetched again next
time, and counted (``RemoteStats.promotion_dropped``).  Lossless blocks keep their codec;
lossy (FP8) blocks are stored as the tensor the get returned, so a local hit reads back
exactly what the remote one did.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.codecs import pipeline as codecs
from kvstore.codecs.pipeline import CodecSpec
from kvstore.errors import BlockTooLargeError, CapacityError, KVStoreError
from kvstore.tiers.remote.blocks import RemoteBlock

if TYPE_CHECKING:
    from kvstore.core.deletes import DeleteWatch
    from kvstore.tiers.host import TierHost
    from kvstore.tiers.remote.tier import RemoteTier

__all__ = ["Promotions"]

_log = logging.getLogger("kvstore.remote")
_RAW = CodecSpec()
_ZSTD = CodecSpec(zstd=True)

Fetched = tuple[RemoteBlock, torch.Tensor]  # the verified object, the tensor to store


def _spec_for(codec: int) -> CodecSpec:
    return _ZSTD if codec == codecs.CODEC_RAW | codecs.ZSTD else _RAW


class Promotions:
    """The promotions of one remote tier (see the module docstring)."""

    def __init__(self, tier: RemoteTier, host: TierHost) -> None:
        self._tier, self._host = tier, host

    async def promote(self, blocks: Sequence[Fetched], *, background: bool,
                      watch: DeleteWatch | None = None) -> None:
        """Store fetched blocks locally (grouped by codec).  ``watch``: registered before
        the fetch began; keys deleted since are not stored (the delete returned: the
        promotion must not undo it)."""
        if not blocks:
            return
        if not self._host.accepts_writes:
            self._tier.count_promotions(dropped=len(blocks))
            return
        groups: dict[int, list[Fetched]] = {}
        for block, value in blocks:
            spec_id = block.header.codec if codecs.is_lossless(block.header.codec) else 0
            groups.setdefault(spec_id, []).append((block, value))
        for codec, group in groups.items():
            await self._promote_group(group, codec, background=background, watch=watch)

    async def _promote_group(self, group: Sequence[Fetched], codec: int, *,
                             background: bool, watch: DeleteWatch | None) -> None:
        """One local put of blocks of one codec.  A put refuses its batch whole for one
        block that does not fit this store (written by a store with larger extents or
        staging) or for a batch over ``capacity_bytes``: the blocks then go one by one,
        so that one block's refusal does not drop its neighbours."""
        try:
            result = await self._host.promote(
                [b.key for b, _ in group], [v for _, v in group],
                [b.header.parent for b, _ in group], _spec_for(codec),
                background=background, skip_deleted=watch)
        except (BlockTooLargeError, CapacityError):
            if len(group) == 1:
                self._tier.count_promotions(dropped=1)
                return
            for one in group:
                await self._promote_group([one], codec, background=background, watch=watch)
            return
        except KVStoreError:
            self._tier.count_promotions(dropped=len(group))
            return
        self._tier.count_promotions(written=result.written, dropped=result.dropped)

    def promote_soon(self, blocks: list[Fetched], watch: DeleteWatch) -> bool:
        """Promote in the store's background task group: the caller has its blocks now,
        the local durable put (staging, fdatasync, index commit) runs behind it.  Until it
        lands the blocks are served from ``RemoteTier.promoting``; under backpressure the
        put is dropped (counted), never queued without bound.  ``aclose`` waits for it.
        True if it started (the task then ends ``watch``)."""
        tier = self._tier
        if not blocks:
            return False
        fetched = [block for block, _ in blocks]

        async def promote() -> None:
            try:
                await self.promote(blocks, background=True, watch=watch)
            except Exception:  # noqa: BLE001 - best effort, in the background
                # (raised, it would cancel the store's background task group, and with
                # it the caller's code inside ``open()``)
                _log.exception("kvstore: promoting %d fetched blocks failed", len(blocks))
                tier.count_promotions(dropped=len(blocks))
            finally:
                self._host.unwatch_deletes(watch)
                tier.promotion_done(fetched)

        if not self._host.spawn(promote):  # not opened through kvstore.open()
            tier.count_promotions(dropped=len(blocks))
            return False
        tier.promotion_started(fetched)  # (before the task runs: it starts soon)
        return True
