"""The vLLM connector's scheduler side: lookups (how many of a request's blocks are
stored), the loads and saves each step hands the workers (:mod:`kvstore.integrations.vllm.metadata`), and
the key scope's moves after a weight update (``reset_cache``).  It never opens a
store: it shares the worker's when they run in one process, or asks every rank's worker
over its lookup socket (:mod:`kvstore.integrations.vllm.lookup_socket`).

A weight update has two caches to clear: vLLM's own prefix cache and the store.  vLLM
calls ``reset_cache`` even when it refused its own reset (a request still held blocks),
and its prefix cache then keeps serving KV of the old weights, and KV computed on top of
it (:mod:`kvstore.integrations.vllm.scheduler.stale` says how the connector tells which requests use it).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.groups import GroupPlan
from kvstore.integrations.vllm.lookup_socket import LookupClient, RankLookups, socket_name
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata, Load, Save
from kvstore.integrations.vllm.metrics import SCHEDULER_COUNTERS
from kvstore.integrations.vllm.open_store import OpenStore, find, release, warn_once
from kvstore.integrations.vllm.ranks import rank_dirs
from kvstore.integrations.vllm.scheduler.block_info import block_tag_body
from kvstore.integrations.vllm.scheduler.group_saves import GroupSaves
from kvstore.integrations.vllm.scheduler.lookup_pool import LookupPool
from kvstore.integrations.vllm.scheduler.save_plan import SaveMark, plan_saves
from kvstore.integrations.vllm.scheduler.stale import StaleCache
from kvstore.integrations.vllm.scope import LoraScopes, Scope, model_scope, scoped_hash

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = logging.getLogger("kvstore.integrations.vllm")


@dataclass
class _RequestState:
    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    lookup_from: int = 0  # block-aligned local hit passed to the last lookup
    saves: SaveMark = field(default_factory=SaveMark)
    # Known when the key scope moved (a weight update): its KV so far may mix both
    # weights, so none of it is ever saved.
    frozen: bool = False
    # Uses KV that vLLM's prefix cache kept across a weight update (StaleCache): never
    # loaded into, never saved.
    stale: bool = False
    external: int = 0  # tokens this connector loaded for it at its last allocation



class SchedulerSide:
    """What vLLM's scheduler asks of the connector (one per engine)."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig, scope: Scope,
                 scope_digest: bytes, engine_id: str, plan: GroupPlan | None = None) -> None:
        self._vllm_config, self._config = vllm_config, config
        self._block_size = vllm_config.cache_config.block_size
        # A hybrid model's groups: each group's blocks are saved and loaded on their own
        # (kvstore.integrations.vllm.groups), all or nothing per hit.
        self._groups = GroupSaves(plan) if plan is not None and plan.hybrid else None
        world = vllm_config.parallel_config.world_size
        # Weight updates (reset_cache): the scope's epoch and weights item now.  The
        # lookup handshake keeps comparing the scope the engine started with.
        self._scope_epoch = 0
        self._weights = dict(scope)["weights"]
        self._lora = LoraScopes(config.weights_fingerprint)
        # Counters reported to vLLM by this side (also added to the open store's, when
        # it is in this process, for connector_stats()).
        self.counts = dict.fromkeys(SCHEDULER_COUNTERS, 0)
        self._client: LookupClient | RankLookups | None = None
        # vLLM builds the workers (which open the stores) before the scheduler: find a
        # single worker in this process, or ask every rank over its lookup socket.
        self._open: OpenStore | None = find(config, engine_id) if world == 1 else None
        if self._open is None:
            names = [socket_name(d, engine_id) for d in rank_dirs(config.path, world)]
            try:
                self._client = LookupClient(names[0], engine_id, scope_digest) \
                    if world == 1 else RankLookups(names, engine_id, scope_digest)
            except OSError as e:
                raise RuntimeError(
                    f"kvstore connector: no worker of engine {engine_id!r} serves the store "
                    f"at {config.path!r} (world size {world}), neither in this process nor "
                    f"over its lookup socket ({e}); the workers open the stores and must "
                    "start first, on this host") from e
        self._requests: dict[str, _RequestState] = {}
        self._lookups = LookupPool(self._match, config.lookup_wait_s())
        self._pending_loads: list[Load] = []
        self._stale = StaleCache()

    def bind_pool(self, pool: Any) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``): how ``reset_cache`` knows whether
        vLLM's own prefix cache was cleared."""
        self._stale.pool = pool

    def _count(self, **deltas: int) -> None:
        """Scheduler-side counters (and into the open store's when it is in this
        process, for connector_stats)."""
        if self._open is not None:
            self._open.count(**deltas)
        for name, n in deltas.items():
            self.counts[name] += n

    def _hashes(self, request: Request) -> list[bytes]:
        """The request's full-block hashes as store keys see them, or none if they are
        not per vLLM block (a hybrid model hashing at a finer granularity) or the
        request's LoRA adapter cannot be fingerprinted."""
        hashes = list(request.block_hashes)
        if len(hashes) > request.num_tokens // self._block_size:
            warn_once("granularity", "kvstore connector: block hashes are finer than "
                       "blocks (hybrid model?); connector disabled")
            return []
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return [bytes(h) for h in hashes]
        adapter = self._lora.fingerprint(lora)
        if adapter is None:
            warn_once(f"lora:{getattr(lora, 'lora_path', '')}",
                       "kvstore connector: cannot read LoRA adapter %s to fingerprint it; "
                       "its requests are neither loaded nor saved",
                       getattr(lora, "lora_path", lora))
            return []
        return [scoped_hash(bytes(h), adapter) for h in hashes]


    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        state = self._requests.setdefault(request.request_id, _RequestState(request))
        state.request, state.lookup_from = request, num_computed_tokens
        if self._is_stale(state, num_computed_tokens):
            return 0, False
        hashes = self._hashes(request)
        first = num_computed_tokens // self._block_size
        # At least one prompt token must be computed (it yields the first logits).
        last = min(len(hashes), (request.num_tokens - 1) // self._block_size)
        if last <= first:
            return 0, False
        try:
            hit = self._lookups.ask(request.request_id, hashes[first:last])
        except (KVStoreError, OSError, ValueError) as e:
            warn_once("lookup", "kvstore connector: lookup failed (no hits until it "
                       "works again): %s", e)
            return 0, False
        if hit is None:  # still running (the remote tier): vLLM asks again next step
            self._count(lookups_deferred=1)
            return None, False
        self._count(lookups=1)
        tokens = min(hit, last - first) * self._block_size
        # Asynchronous: vLLM caches the blocks only once they arrived, and only the
        # verified ones.  Synchronous: the hit was read and verified by the lookup.
        return tokens, tokens > 0 and self._config.async_loads

    def _match(self, hashes: list[bytes]) -> int:
        """A lookup, on a lookup thread (or this one: ``LookupPool`` with no wait)."""
        epoch = self._scope_epoch
        if self._client is not None:
            return self._client.match(hashes, epoch)
        assert self._open is not None
        return self._open.match_hashes(hashes, epoch)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        state = self._requests.setdefault(request.request_id, _RequestState(request))
        state.request = request
        state.external = max(num_external_tokens, 0)
        if num_external_tokens <= 0:
            return
        first = state.lookup_from // self._block_size
        n = num_external_tokens // self._block_size
        if self._groups is not None:
            self._groups.load(request.request_id, blocks.get_block_ids(),
                              self._hashes(request), first, n)
            self._count(lookup_hit_blocks=n)
            return
        block_ids = list(blocks.get_block_ids()[0])
        hashes = self._hashes(request)[first:first + n]
        self._pending_loads.append(Load(request.request_id, block_ids[first:first + n], hashes))
        self._count(lookup_hit_blocks=n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(
            loads=self._pending_loads, idle=scheduler_output.total_num_scheduled_tokens == 0,
            scope_epoch=self._scope_epoch, weights=self._weights)
        self._pending_loads = []
        if self._groups is not None:
            self._groups.begin_step(meta)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._first_scheduled(state, new.num_computed_tokens)
                self._plan_saves(state, new.num_computed_tokens, scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
                self._first_scheduled(state, cached.num_computed_tokens[i])
            elif new_ids is not None:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for have, more in zip(state.block_ids, new_ids):
                    have.extend(more)
            self._plan_saves(state, cached.num_computed_tokens[i], scheduled[req_id], meta)
        if self._groups is not None:
            self._groups.save_states(scheduler_output, meta, self._state_hashes,
                                     self._state_info)
        return meta

    @property
    def scope_epoch(self) -> int:
        """How often the key scope moved (``reset_cache``)."""
        return self._scope_epoch

    def _state_info(self, req_id: str, idx: int, group: int) -> bytes | None:
        state = self._requests.get(req_id)
        return None if state is None else \
            block_tag_body(state.request, idx, self._block_size, group)

    def _state_hashes(self, req_id: str) -> list[bytes]:
        """The hashes of a request whose states may be saved (none once frozen, stale
        or unknown)."""
        state = self._requests.get(req_id)
        if state is None or state.frozen or state.stale:
            return []
        return self._hashes(state.request)

    def _plan_saves(self, state: _RequestState, computed: int, scheduled: int,
                    meta: KVStoreConnectorMetadata) -> None:
        """Plan the request's blocks from its save mark on (:mod:`kvstore.integrations.vllm.scheduler.save_plan`)."""
        if state.frozen or state.stale:
            return
        hashes = self._hashes(state.request)
        allocated = max((len(ids) for ids in state.block_ids), default=0)
        planned = plan_saves(state.saves, computed, scheduled, self._block_size,
                             len(hashes), allocated)
        request, bs = state.request, self._block_size
        if self._groups is not None:
            self._groups.save_blocks(state.block_ids, hashes, planned, meta,
                                     lambda idx, g: block_tag_body(request, idx, bs, g))
            return
        ids = state.block_ids[0] if state.block_ids else []
        for idx in planned:
            meta.saves.append(Save(ids[idx], hashes[idx], hashes[idx - 1] if idx else None,
                                   block_tag_body(request, idx, bs)))

    def _is_stale(self, state: _RequestState, local_tokens: int) -> bool:
        """Whether the request uses KV of vLLM's prefix cache from before a weight update
        (it had a local hit of ``local_tokens`` while that cache may hold such KV);
        counted once per request."""
        if not state.stale and local_tokens > 0 and self._stale.active:
            state.stale = True
            self._count(reset_stale_requests=1)
        return state.stale

    def _first_scheduled(self, state: _RequestState, computed: int) -> None:
        """The request runs (new, or resumed after a preemption) with ``computed``
        tokens' KV in place: what this connector loaded, the rest vLLM's local hit
        (with a sub-block tail the lookup never saw)."""
        self._is_stale(state, state.lookup_from if state.external else computed)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, which RL frameworks call
        around a weight update (``reload_weights``, ``update_weights``, a pause with
        ``clear_cache``).  Stored KV is only valid for the weights that computed it, so
        the connector moves to a new key scope: derived from the weight files where
        they changed (another ``weights_path``, files rewritten in place: an engine
        started later on those files shares the blocks), else a fresh one that nothing
        on disk matches (weights sent as tensors: the store is a cold cache for them).
        From now on lookups count nothing of the old scope, the worker moves with the
        next step's metadata (loads still in flight then fail and are recomputed), and
        the requests running now are never saved again (their KV may mix both weights).

        vLLM calls this also when it refused to reset its own prefix cache (blocks still
        held by requests), which then still holds KV of the old weights.  Until a reset
        that clears it, a request that reuses any of vLLM's cached KV is neither loaded
        into nor saved (:class:`kvstore.integrations.vllm.scheduler.stale.StaleCache`); only requests computed from
        scratch are.  Where the connector cannot see vLLM's block pool (another vLLM) it
        cannot know the cache was cleared: it moves to a fresh scope, never the new
        files' one, and treats the cache as stale.  True when vLLM's cache is clear (or
        cannot be seen), False when it is not: the reset did not complete, and vLLM's
        ``reset_prefix_cache`` says so (it returns False in that case anyway)."""
        cleared = self._stale.reset()
        try:
            weights = model_scope(self._vllm_config, self._config)
            new = dict(weights)["weights"]
        except ValueError:  # the new weights cannot be fingerprinted
            new = self._weights
        if cleared is None:
            new = self._weights  # (a fresh scope, below)
            warn_once("reset-blind", "kvstore connector: reset_cache: cannot see vLLM's "
                      "block pool, so cannot tell whether its prefix cache was cleared; "
                      "moving to a fresh key scope, and requests that reuse vLLM's cached "
                      "KV are neither loaded nor saved from now on")
        elif not cleared:
            logger.warning(
                "kvstore connector: reset_cache: vLLM's prefix cache was not cleared "
                "(requests still hold blocks), so it keeps KV of the weights before this "
                "reset; until a reset that clears it, requests that reuse vLLM's cached KV "
                "are neither loaded nor saved. Call reset_prefix_cache(reset_connector="
                "True) again once the running requests ended, or with "
                "reset_running_requests=True")
        if new == self._weights:
            # The files say nothing new: the weights came as tensors (or did not change
            # at all: no telling which), so nothing stored may be used for them.
            new = f"update:{uuid.uuid4().hex}"
            if cleared is not None:
                warn_once("reset", "kvstore connector: reset_cache: the weight files did "
                          "not change, so the weights now loaded cannot be identified; "
                          "moving to a fresh key scope (stored KV is not loaded for them)")
        self._scope_epoch += 1
        self._weights = new
        for state in self._requests.values():
            state.frozen = True
        self._lookups.forget_all()
        logger.info("kvstore connector: key scope moved (epoch %d, weights %s)",
                    self._scope_epoch, new)
        return cleared is not False

    def request_finished(self, request: Request, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copied their blocks out during the steps, and vLLM itself holds the
        # blocks of a request whose load is in flight until the worker reports it
        # finished: nothing here delays freeing.
        self._requests.pop(request.request_id, None)
        self._lookups.forget(request.request_id)
        return False, None


    def shutdown(self) -> None:
        self._lookups.close()  # before the client and store they ask
        if self._client is not None:
            self._client.close()
        if self._open is not None:
            release(self._open)
