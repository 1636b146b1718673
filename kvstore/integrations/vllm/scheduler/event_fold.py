"""The engine's view of its stores for vLLM's KV events (scheduler side): the ranks'
reports (:mod:`kvstore.integrations.vllm.rank_reports`) folded into one announcement per
block.

Each rank keeps its shard of a block in a store of its own, so the engine holds a block
only when every rank does.  vLLM's own aggregation (``KVEventAggregator``) keeps an
event only when every worker that reported *in that step* emitted it; background puts
finish in different steps on different ranks, so it would announce a block twice or
never.  The fold keeps a rank mask per block across steps instead:

* a block is announced (``Stored``) once, when its mask becomes full;
* an announced block is withdrawn (``Removed``) as soon as any rank loses it;
* a reset (the key scope moved) withdraws every announced block and forgets the rest;
  reports of an older scope's epoch are ignored;
* a rank's ``RESYNC`` clears its bit everywhere (withdrawing what it held), and its
  replay then sets it again.

``pending`` is true while some rank has saves in flight or a replay unfinished: vLLM's
engine keeps stepping (``has_pending_push_work``) so those events leave without waiting
for the next request.

Kept apart from :mod:`kvstore.integrations.vllm` so that it imports without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstore.integrations.vllm import block_tags
from kvstore.integrations.vllm.block_tags import BlockInfo
from kvstore.integrations.vllm.rank_reports import (
    BUSY,
    REMOVED,
    RESYNC,
    SETTLED,
    STORED,
    Report,
)

__all__ = ["EventFold", "Removed", "Stored"]


@dataclass
class Stored:
    """Blocks every rank holds now, in the order they became so."""

    blocks: list[BlockInfo] = field(default_factory=list)


@dataclass
class Removed:
    """Announced blocks of one KV cache group that some rank no longer holds."""

    group: int
    hashes: list[bytes] = field(default_factory=list)


_Id = tuple[int, bytes]  # (group, vLLM's raw hash)


class EventFold:
    """Rank masks per block (module docstring).  ``busy``: the ranks' state before
    their first report (true with a start-up replay, so the engine steps until it is
    out)."""

    def __init__(self, world: int, *, busy: bool = False) -> None:
        self.world = world
        self.epoch = 0
        self._full = (1 << world) - 1
        self._masks: dict[_Id, int] = {}
        self._infos: dict[_Id, BlockInfo] = {}
        self._announced: set[_Id] = set()
        self._busy = self._full if busy else 0
        self._out: list[Stored | Removed] = []
        self.malformed = 0  # reports whose body was not a block tag (counted, skipped)

    @property
    def pending(self) -> bool:
        return self._busy != 0

    @property
    def announced(self) -> int:
        return len(self._announced)

    def add(self, reports: Iterable[Report]) -> None:
        """Fold the reports of one step (any ranks, in each rank's order)."""
        for rank, epoch, kind, body in reports:
            if not 0 <= rank < self.world or epoch != self.epoch:
                continue  # (a scope left behind by a reset)
            bit = 1 << rank
            if kind == BUSY:
                self._busy |= bit
            elif kind == SETTLED:
                self._busy &= ~bit
            elif kind == RESYNC:
                for ident in list(self._masks):
                    self._clear(ident, bit)
            elif kind in (STORED, REMOVED):
                try:
                    info = block_tags.decode(body)
                except ValueError:
                    self.malformed += 1
                    continue
                ident = (info.group, info.hash)
                if kind == STORED:
                    self._set(ident, bit, info)
                else:
                    self._clear(ident, bit)

    def _set(self, ident: _Id, bit: int, info: BlockInfo) -> None:
        mask = self._masks.get(ident, 0) | bit
        self._masks[ident] = mask
        self._infos.setdefault(ident, info)
        if mask == self._full and ident not in self._announced:
            self._announced.add(ident)
            last = self._out[-1] if self._out else None
            if not isinstance(last, Stored):
                last = Stored()
                self._out.append(last)
            last.blocks.append(self._infos[ident])

    def _clear(self, ident: _Id, bit: int) -> None:
        mask = self._masks.get(ident, 0)
        if not mask & bit:
            return
        mask &= ~bit
        if ident in self._announced:
            self._announced.discard(ident)
            self._removed(ident)
        if mask:
            self._masks[ident] = mask
        else:
            del self._masks[ident]
            del self._infos[ident]

    def _removed(self, ident: _Id) -> None:
        last = self._out[-1] if self._out else None
        if not (isinstance(last, Removed) and last.group == ident[0]):
            last = Removed(ident[0])
            self._out.append(last)
        last.hashes.append(ident[1])

    def reset(self, epoch: int, *, busy: bool = False) -> None:
        """The key scope moved to ``epoch``: withdraw every announced block, forget the
        rest; ``busy``: the ranks replay the new scope (the engine steps until they
        report)."""
        for ident in sorted(self._announced, key=lambda i: i[0]):
            self._removed(ident)
        self._announced.clear()
        self._masks.clear()
        self._infos.clear()
        self.epoch = epoch
        if busy:
            self._busy = self._full

    def take(self) -> list[Stored | Removed]:
        """What changed since the last call, in order."""
        out, self._out = self._out, []
        return out
