"""The tiers as the store's call paths see them: :class:`MemoryPort` (the host-memory
tier in front of the store), :class:`RemotePort` (the shared remote tier behind it),
and :class:`Tiers`, which holds the ones an open store has.

The paths import these, never a tier: the tiers (:mod:`kvstore.tiers`) implement the
Protocols, and the store builds them and attaches them here (the remote tier possibly
after open: ``Store.attach_remote``).  So a put, a get, an eviction, a quarantine and a
delete reach a tier only through this module, and a tier reaches the store only through
the port it was handed (:class:`kvstore.tiers.host.TierHost`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from kvstore.core.deletes import DeleteWatch
    from kvstore.disk.format import IndexEntry
    from kvstore.io.device_copies import DeviceCopier

__all__ = ["Block", "MemoryPort", "RemotePort", "Tiers"]

# A block to cache: key, parent, bytes (uint8, CPU), dtype, shape, index seq
Block = tuple[bytes, "bytes | None", torch.Tensor, torch.dtype, tuple[int, ...], int]

HitsT = TypeVar("HitsT")
HeldT = TypeVar("HeldT")


class MemoryPort(Protocol[HitsT]):
    """What the call paths ask of the memory tier (:class:`kvstore.tiers.memory.tier.
    MemoryTier`).  ``HitsT``: the tier's record of the hits a get took."""

    def take(self, keys: Sequence[bytes], entries: Sequence[IndexEntry | None]
             ) -> tuple[HitsT, list[IndexEntry | None]]:
        """The hits among ``entries`` (held until :meth:`release`) and the entries left
        for the disk; no await (called in the step of the index lookup)."""
        ...

    def release(self, hits: HitsT) -> None: ...

    async def copy_out(self, hits: HitsT, outs: Sequence[torch.Tensor | None],
                       results: list[torch.Tensor | None], copier: DeviceCopier) -> None: ...

    async def fill(self, blocks: Sequence[Block]) -> int:
        """Cache blocks just verified or made durable; how many were cached."""
        ...

    def forget(self, keys: Sequence[bytes]) -> None:
        """Blocks evicted, quarantined or deleted on disk: never a hit again."""
        ...

    def stats_fields(self) -> dict[str, int]:
        """The tier's own fields of ``StoreStats`` (``memory_used_bytes``, ...)."""
        ...

    def close(self) -> None: ...


class RemotePort(Protocol[HeldT]):
    """What the call paths ask of the remote tier (:class:`kvstore.tiers.remote.adapter.
    RemoteAdapter`).  ``HeldT``: what a get took of the tier in its lookup's step."""

    def held_blocks(self, keys: Sequence[bytes], entries: Sequence[IndexEntry | None]
                    ) -> HeldT:
        """In the step of a get's index lookup: what the tier holds of its misses."""
        ...

    async def fill_misses(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor | None],
                          results: list[torch.Tensor | None], held: HeldT) -> None: ...

    def enqueue(self, keys: Sequence[bytes]) -> None:
        """Blocks just made durable: uploaded in the background (never waits)."""
        ...

    def watch_deletes(self, keys: Sequence[bytes]) -> DeleteWatch: ...

    def unwatch_deletes(self, watch: DeleteWatch) -> None: ...

    async def fetch_missing(self, keys: Sequence[bytes], since: DeleteWatch) -> None:
        """A prefetch: blocks absent locally fetched and stored before it reads them."""
        ...


class Tiers:
    """The tiers of one open store, as its paths reach them (see the module docstring).
    Each is attached once; the memory tier is closed with the store's parts."""

    def __init__(self) -> None:
        self.memory: MemoryPort[Any] | None = None
        self.remote: RemotePort[Any] | None = None

    def attach_memory(self, memory: MemoryPort[Any]) -> None:
        assert self.memory is None, "a store has one memory tier"
        self.memory = memory

    def attach_remote(self, remote: RemotePort[Any]) -> None:
        if self.remote is not None:
            raise ValueError("this store already has a remote tier")
        self.remote = remote

    def forget(self, keys: Sequence[bytes]) -> None:
        """Blocks gone from the disk (evicted, quarantined, deleted) leave the memory
        tier now: the space comes back at once (a lookup would not serve them anyway:
        their index entries are gone)."""
        if self.memory is not None and keys:
            self.memory.forget(keys)

    def stats_fields(self) -> dict[str, int]:
        """The tiers' own fields of ``StoreStats`` ({} for a tier the store has not)."""
        return self.memory.stats_fields() if self.memory is not None else {}

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
