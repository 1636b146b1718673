"""The vLLM connector's part of vLLM's KV events (``--kv-events-config``): the blocks
its stores hold, published as ``BlockStored`` / ``BlockRemoved`` with
``medium="STORAGE"`` through vLLM's own publisher (docs/events.md, "vLLM's KV events").

* Each worker returns its rank's reports (:mod:`kvstore.integrations.vllm.worker.events`)
  in a :class:`KVStoreKVEvents`, which vLLM merges over the ranks of a step.
* The scheduler side folds them (:mod:`kvstore.integrations.vllm.scheduler.event_fold`:
  one announcement per block, once every rank holds it) and ``take_events`` turns the
  result into vLLM's events (:class:`SchedulerEvents`), which vLLM publishes in the
  step's ``KVEventBatch`` after its own (GPU) events.

The names are vLLM's: ``MEDIUM_STORAGE`` (what vLLM's own disk tier publishes, and what
routers such as Dynamo's map to their disk tier), ``locality="LOCAL"``, the block hashes
converted as vLLM converts its own (``maybe_convert_block_hash``: the low 64 bits as an
int by default), the group's ``kv_cache_spec_kind`` and sliding window as vLLM's GPU
events carry them, and ``ownership="kvstore"`` naming the tier.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvstore.integrations.vllm.block_tags import BlockInfo
from kvstore.integrations.vllm.rank_reports import Report
from kvstore.integrations.vllm.scheduler.event_fold import EventFold, Removed, Stored

__all__ = ["LOCALITY", "MEDIUM", "OWNERSHIP", "KVStoreKVEvents", "SchedulerEvents"]

MEDIUM = MEDIUM_STORAGE
LOCALITY = "LOCAL"
OWNERSHIP = "kvstore"


class KVStoreKVEvents(KVConnectorKVEvents):
    """One step's rank reports (:mod:`kvstore.integrations.vllm.rank_reports`), from
    one worker or merged over the workers by vLLM (``add_events``).  Plain tuples:
    vLLM pickles it from each worker process to the scheduler's."""

    def __init__(self, reports: list[Report] | None = None) -> None:
        self.reports: list[Report] = list(reports or ())
        self.workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.reports.extend(events)

    def aggregate(self) -> KVStoreKVEvents:
        return self  # the fold is the scheduler's, across steps (event_fold)

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.reports)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.reports = []


def _group_meta(kv_cache_config: Any) -> list[tuple[str | None, int | None]]:
    """``(kv_cache_spec_kind, sliding window)`` per KV cache group, as vLLM's KV cache
    manager annotates its own ``BlockStored``."""
    if kv_cache_config is None:
        return []
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return [(get_kv_cache_spec_kind(g.kv_cache_spec).value,
             get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups]


class SchedulerEvents:
    """The scheduler side's fold and its conversion to vLLM's events."""

    def __init__(self, world: int, block_size: int, kv_cache_config: Any, *,
                 replay: bool) -> None:
        self.fold = EventFold(world, busy=replay)
        self._block_size = block_size
        self._replay = replay
        self._groups = _group_meta(kv_cache_config)

    def update(self, events: Any) -> None:
        """A step's merged worker output (``kv_cache_events``), if it is ours."""
        if isinstance(events, KVStoreKVEvents):
            self.fold.add(events.reports)

    def reset(self, epoch: int) -> None:
        """The key scope moved (``reset_cache``): withdraw everything announced, then
        replay the new scope."""
        self.fold.reset(epoch, busy=self._replay)

    @property
    def pending(self) -> bool:
        return self.fold.pending

    def take(self) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for change in self.fold.take():
            if isinstance(change, Removed):
                out.append(BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in change.hashes],
                    medium=MEDIUM, group_idx=change.group, locality=LOCALITY,
                    ownership=OWNERSHIP))
            elif isinstance(change, Stored):
                out.extend(self._stored(run) for run in _runs(change.blocks))
        return out

    def _stored(self, run: list[BlockInfo]) -> BlockStored:
        first = run[0]
        kind, window = self._groups[first.group] if first.group < len(self._groups) \
            else (None, None)
        extra = [b.extra_keys for b in run]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(b.hash) for b in run],
            parent_block_hash=None if first.parent is None
            else maybe_convert_block_hash(first.parent),
            token_ids=[t for b in run for t in b.token_ids],
            block_size=self._block_size, lora_id=None, medium=MEDIUM,
            lora_name=first.lora_name,
            extra_keys=None if all(e is None for e in extra) else extra,
            group_idx=first.group, kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window, locality=LOCALITY, ownership=OWNERSHIP)


def _runs(blocks: Iterable[BlockInfo]) -> list[list[BlockInfo]]:
    """Blocks as chains: a block joins the run before it when it is that run's next
    block (its parent is the run's last block, same group and LoRA), as vLLM's own
    ``BlockStored`` lists a request's consecutive blocks."""
    runs: list[list[BlockInfo]] = []
    for b in blocks:
        last = runs[-1][-1] if runs else None
        if last is not None and b.parent == last.hash and b.group == last.group \
                and b.lora_name == last.lora_name:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs
