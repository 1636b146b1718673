"""Drive the vLLM connector's scheduler side (``SchedulerSide``) through weight-update
resets with vLLM's real block pool, requests and scheduler outputs, without an engine,
and print what happened as JSON.  Run with the vLLM venv's python
(tests/integrations/vllm/test_vllm_reset.py does)::

    python tests/integrations/vllm/scheduler_probe.py MODEL_DIR STORE_DIR

A worker side opens the store first (the scheduler side finds it in this process, as in
vLLM's one-process engine).  In order:

1. ``reset_cache`` before vLLM bound its block pool: the connector cannot know whether
   vLLM's prefix cache was cleared: a fresh key scope, a warning, True.
2. The pool bound, two of its blocks held by a request: vLLM would have refused its own
   reset; ``reset_cache`` says False and warns.  Then, while that cache is stale:
   a request whose lookup sees a local hit of one block; one whose lookup saw none but
   which is scheduled with a sub-block local hit (10 tokens: vLLM keeps such a tail
   when the connector has nothing longer); one with no local hit at all (saved); the
   same request resumed after a preemption with a local hit (its own blocks, or any
   other request's with the same hashes: no telling), and its next step.
3. The blocks freed and vLLM's own reset done (accepted): ``reset_cache`` says True;
   a new request with a local hit is looked up and saved from its hit on.
"""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace
from typing import Any

import torch


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(model: str, store: str) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    from kvstore.integrations.vllm.config import ConnectorConfig
    from kvstore.integrations.vllm.scheduler.side import SchedulerSide
    from kvstore.integrations.vllm.scope import model_scope, scope_digest
    from kvstore.integrations.vllm.worker.side import WorkerSide

    log = _Log()
    logging.getLogger("kvstore.integrations.vllm").addHandler(log)
    bs, num_blocks = 32, 64
    config = EngineArgs(model=model, dtype="float32", enforce_eager=True,
                        block_size=bs).create_engine_config()
    cc = ConnectorConfig.from_extra({"path": store, "extent_bytes": 4 << 20,
                                     "max_pending_save_bytes": 1 << 20,
                                     "load_staging_bytes": 1 << 20})
    scope = model_scope(config, cc)
    digest = scope_digest(scope)
    worker = WorkerSide(config, SimpleNamespace(num_blocks=num_blocks), cc, scope, digest,
                        "probe")
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn":
                               torch.zeros(2, num_blocks, bs, 2, 32) for i in range(2)})
    sched = SchedulerSide(config, cc, scope, digest, "probe")
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=bs)
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(bs, fn)
    out: dict[str, Any] = {}

    def request(name: str, first: int, blocks: int) -> Any:
        tokens = [(first + i) % 100 + 3 for i in range(blocks * bs + 5)]
        return Request(name, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)

    allocated: list[Any] = []

    def allocate(req: Any, external: int) -> list[int]:
        got = pool.get_new_blocks(len(req.prompt_token_ids) // bs + 1)
        allocated.extend(got)
        sched.update_state_after_alloc(req, KVCacheBlocks((got,)), external)
        return [b.block_id for b in got]

    def step(new: list[tuple[Any, list[int], int]] = (),  # type: ignore[assignment]
             resumed: list[tuple[Any, list[int], int]] = (),  # type: ignore[assignment]
             running: list[tuple[Any, int]] = ()) -> list[int]:  # type: ignore[assignment]
        """One scheduler output: new requests (request, block ids, computed tokens),
        resumed ones (the same), running ones (request, computed); every request's
        prompt rest scheduled (one token when nothing is left).  The saves planned,
        as the block ids."""
        so = SchedulerOutput.make_empty()
        cached = CachedRequestData.make_empty()
        for req, ids, computed in new:
            data = NewRequestData.from_request(req, (ids,))
            data.num_computed_tokens = computed
            so.scheduled_new_reqs.append(data)
            so.num_scheduled_tokens[req.request_id] = max(req.num_tokens - computed, 1)
        for req, ids, computed in [*resumed, *[(r, None, c) for r, c in running]]:
            cached.req_ids.append(req.request_id)
            if ids is not None:
                cached.resumed_req_ids.add(req.request_id)
            cached.new_block_ids.append(None if ids is None else (ids,))
            cached.num_computed_tokens.append(computed)
            cached.new_token_ids.append([])
            cached.num_output_tokens.append(0)
            so.num_scheduled_tokens[req.request_id] = max(req.num_tokens - computed, 1)
        so.scheduled_cached_reqs = cached
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        meta = sched.build_connector_meta(so)
        return [s.block_id for s in meta.saves]

    # 1. no pool: cannot know
    out["unbound_reset"] = sched.reset_cache()
    out["unbound_weights"] = sched._weights.split(":")[0]
    out["unbound_warned"] = any("cannot see vLLM's block pool" in m for m in log.lines)

    # 2. a request holds blocks: vLLM refused its reset
    sched.bind_pool(pool)
    held = pool.get_new_blocks(2)
    out["refused_reset"] = sched.reset_cache()
    out["refused_warned"] = any("was not cleared" in m for m in log.lines)
    hit = request("hit", 0, 3)
    out["hit_lookup"] = list(sched.get_num_new_matched_tokens(hit, bs))
    tail = request("tail", 10, 3)
    out["tail_lookup"] = list(sched.get_num_new_matched_tokens(tail, 0))
    tail_ids = allocate(tail, 0)
    out["tail_saves"] = step(new=[(tail, tail_ids, 10)])
    clean = request("clean", 20, 3)
    out["clean_lookup"] = list(sched.get_num_new_matched_tokens(clean, 0))
    clean_ids = allocate(clean, 0)
    out["clean_saves"] = step(new=[(clean, clean_ids, 0)])
    out["clean_ids"] = clean_ids
    # preempted, then resumed with a local hit of two blocks
    out["resumed_lookup"] = list(sched.get_num_new_matched_tokens(clean, 2 * bs))
    resumed_ids = allocate(clean, 0)
    out["resumed_saves"] = step(resumed=[(clean, resumed_ids, 2 * bs)])
    out["resumed_next_saves"] = step(running=[(clean, clean.num_tokens)])
    out["stale_requests"] = sched.counts["reset_stale_requests"]

    # 3. nothing held, vLLM's own reset accepted
    for name in ("hit", "tail", "clean"):
        sched.request_finished(SimpleNamespace(request_id=name), [])  # type: ignore[arg-type]
    pool.free_blocks([*held, *allocated])
    out["pool_reset"] = pool.reset_prefix_cache()
    out["accepted_reset"] = sched.reset_cache()
    after = request("after", 30, 3)
    out["after_lookup"] = list(sched.get_num_new_matched_tokens(after, bs))
    after_ids = allocate(after, 0)
    out["after_saves"] = step(new=[(after, after_ids, bs)])
    out["after_ids"] = after_ids
    out["stale_requests_after"] = sched.counts["reset_stale_requests"]
    sched.shutdown()
    worker.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
