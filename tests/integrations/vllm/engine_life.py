"""One engine life: start vLLM on CPU, serve prompts, write what happened as JSON.

Run with the vLLM venv's python (tests/integrations/vllm/test_vllm.py does)::

    python tests/integrations/vllm/engine_life.py SPEC.json RESULT.json

SPEC: ``{"model": DIR, "prompts": [str, ...], "max_tokens": int, "store": PATH | null,
"extra": {...}}``, optionally ``"llm": {...}`` (more ``LLM`` arguments: ``hf_overrides``,
``kv_cache_dtype``), ``"engine_id": str`` (the kv_transfer_config's), ``"abort_first":
{"I": STEPS}`` (prompt I is first submitted through the engine, stepped STEPS times and
aborted, then served as usual, without a prefix-cache reset in between),
``"weight_update": DIR`` (after the prompts, ``reload_weights`` from DIR and
``reset_prefix_cache(reset_connector=True)``, then the prompts again:
``outputs_after_update``, ``reset``), ``"abort_in_flight": [I, J]`` (prompt I's kvstore load is held in flight by a gate while
the request is aborted and prompt J is served; see ``abort_in_flight``) and ``"hold":
true`` (after writing RESULT, print KVSTORE-ENGINE-LIFE-READY and keep the engine alive until stdin closes),
``"kill_at_commit": N`` (SIGKILL itself inside its N-th index commit of saved blocks),
``"group_count": N`` (a hybrid model's KV cache groups, for the per-group keys when the
engine core is a child process), ``"batch": true`` (after the prompts, vLLM's prefix cache reset, all prompts submitted at
once: ``batch_outputs``; with no other prompts when ``"prompts_in_turn": false``) and
``"update_while_running"`` (see :func:`update_while_running`).
``store: null`` runs without the connector (the reference outputs).  Prompts are served
one ``generate`` call each, in order, with vLLM's own (device) prefix cache reset before
each: a later prompt can reuse an earlier one's blocks only through kvstore (or, after
an aborted attempt, through what that attempt left in vLLM's prefix cache).  RESULT: per prompt the output token ids, vLLM's ``num_cached_tokens`` and the
store keys of its full blocks (vLLM's block hashes, computed here with vLLM's hash
function, scoped by the connector's namespace: an independent check of the key
derivation); vLLM's metrics; the connector's counters
(``kvstore.integrations.vllm.connector_stats``); with tensor parallel, ``ranks``: each
worker's counters (``LLM.collective_rpc``) and per output ``rank_keys``; or ``error`` if
the engine failed to start.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
BLOCK_SIZE = 32  # the smallest block vLLM's CPU attention supports


def metrics(llm: Any) -> dict[str, Any]:
    """Counters and gauges by name: ``name[source]`` where they have a ``source`` label,
    ``name{label=value,...}`` where they have others (the connector's ``rank`` and
    ``outcome``); vLLM's ``model_name`` and ``engine`` labels are left out."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if not isinstance(value, (int, float)):
            continue
        labels = {k: v for k, v in m.labels.items() if k not in ("model_name", "engine")}
        if set(labels) == {"source"}:
            name = f"{m.name}[{labels['source']}]"
        elif labels:
            name = m.name + "{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}"
        else:
            name = m.name
        out[name] = out.get(name, 0) + value
    return out


def block_keys(token_ids: list[int], block_size: int, namespace_json: str,
               group: int | None = None) -> list[str]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from kvstore import Namespace

    fn = get_hash_fn_by_name("sha256")
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:  # the engine core is a child
        kv_cache_utils.init_none_hash(fn)
    parent = None
    hashes = []
    for i in range(len(token_ids) // block_size):
        parent = kv_cache_utils.hash_block_tokens(
            fn, parent, token_ids[i * block_size:(i + 1) * block_size], None)
        # A hybrid model's group: the group's index appended (as the connector does)
        hashes.append(bytes(parent) + (b"" if group is None else group.to_bytes(4, "big")))
    return [k.hex() for k in Namespace.from_json(namespace_json).engine_keys(hashes)]


def abort_in_flight(llm: Any, prompt: str, other: str, params: Any) -> dict[str, Any]:
    """Submit ``prompt`` and hold its kvstore load in flight (its read finishes only
    when a gate opens); abort it while held; serve ``other`` meanwhile; open the gate.
    Returns what a leak or a wrong copy would show: free KV blocks before, while the
    aborted request's load was held, and after; the connector's loads still tracked;
    ``other``'s output (the test compares it with the reference)."""
    from concurrent.futures import Future

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvstore.integrations.vllm.worker.background_loads import BackgroundLoads

    gate, started = threading.Event(), threading.Event()
    original = BackgroundLoads.start

    def gated_start_load(self: Any, load: Any) -> None:
        original(self, load)
        if "inflight-" not in load.req_id:
            return
        inflight = self.loading[load.req_id]
        inner, outer = inflight.future, Future()

        def finish() -> None:
            gate.wait()
            try:
                outer.set_result(inner.result())
            except BaseException as e:
                outer.set_exception(e)

        threading.Thread(target=finish, daemon=True).start()
        inflight.future = outer
        started.set()

    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    engine, worker = llm.llm_engine, get_kv_transfer_group()
    free_before = pool.get_num_free_blocks()
    BackgroundLoads.start = gated_start_load  # type: ignore[method-assign]
    try:
        engine.add_request("inflight-0", prompt, params)
        for _ in range(100):
            if started.is_set():
                break
            engine.step()
        assert started.is_set(), "the load never started"
        engine.abort_request(["inflight-0"])
        while engine.has_unfinished_requests():
            engine.step()
        held = pool.get_num_free_blocks()
        (out,) = llm.generate([other], params, use_tqdm=False)  # the load is still held
        loading_while_held = len(worker._worker.loads.background.loading)
    finally:
        BackgroundLoads.start = original  # type: ignore[method-assign]
        gate.set()
    # vLLM frees the aborted request's blocks once the worker reports its load done:
    # at the next steps that run (here: the next prompt's).
    return {"free_before": free_before, "free_while_held": held,
            "loading_while_held": loading_while_held, "other_tokens": list(out.outputs[0].token_ids),
            "worker": worker}


def settle_saves(llm: Any) -> None:
    """Wait for the previous prompt's saves, background puts in the worker(s), so that a
    later prompt's hit on them does not depend on timing (under load a lookup could run
    before they committed: seen as a missing hit).  ``connector_stats`` waits for them,
    run in every worker wherever it lives (this process, the engine core, rank
    processes)."""
    llm.collective_rpc(_rank_stats)


def _rank_stats(worker: Any) -> list[dict[str, Any]]:
    """Run in each worker process by ``LLM.collective_rpc``."""
    from kvstore.integrations.vllm import all_connector_stats

    return all_connector_stats()


def _out(out: Any) -> dict[str, Any]:
    return {"prompt_token_ids": list(out.prompt_token_ids),
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens}


def _run_to_end(engine: Any, outputs: dict[str, Any]) -> None:
    """Step ``engine`` until no request is left, keeping each finished output by id."""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = _out(out)


def _counters(spec: dict[str, Any]) -> dict[str, Any]:
    from kvstore.integrations.vllm import connector_stats

    stats = connector_stats(spec["store"])
    return {k: v for k, v in stats.items() if isinstance(v, int)}


def update_while_running(llm: Any, spec: dict[str, Any], params: Any) -> dict[str, Any]:
    """An RL trainer's weight update in the middle of serving.  ``spec``:
    ``{"weights": DIR, "first": PROMPT, "running": I | null, "again": bool}``.

    ``first`` is served (its blocks: vLLM's prefix cache and the store, old weights);
    with ``running`` = I, prompt I is submitted and stepped once, so that it runs (and
    holds KV blocks) when the weights are reloaded from ``weights`` and
    ``reset_prefix_cache(reset_connector=True)`` is called: vLLM refuses its own reset
    then; with ``running`` null nothing runs and vLLM accepts it.  Then every other
    prompt is submitted and all run to their end (``outputs``, in prompt order).  With
    ``again``, once they ended: all prompts submitted and stepped twice, then a reset
    that preempts them (``reset_running_requests=True``, as vLLM's pause with
    ``clear_cache`` does: accepted) and they resume to their end; then vLLM's cache
    alone reset and all prompts at once (``again_outputs``).  The connector's counters
    right after the reset and after each phase."""
    engine = llm.llm_engine
    prompts = spec["prompts"]
    plan = spec["update_while_running"]
    llm.generate([plan["first"]], params, use_tqdm=False)
    settle_saves(llm)
    running = plan.get("running")
    done: dict[str, Any] = {}
    if running is not None:
        engine.add_request(f"p{running}", prompts[running], params)
        engine.step()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": plan["weights"]})
    result: dict[str, Any] = {"reset": llm.reset_prefix_cache(reset_connector=True)}
    settle_saves(llm)
    result["counters_at_reset"] = _counters(spec)
    for i, prompt in enumerate(prompts):
        if i != running:
            engine.add_request(f"p{i}", prompt, params)
    _run_to_end(engine, done)
    settle_saves(llm)
    result["outputs"] = [done[f"p{i}"] for i in range(len(prompts))]
    result["counters"] = _counters(spec)
    if plan.get("again"):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"again{i}", prompt, params)
        engine.step()
        engine.step()
        result["reset_again"] = llm.reset_prefix_cache(reset_running_requests=True,
                                                       reset_connector=True)
        result["counters_at_reset_again"] = _counters(spec)
        _run_to_end(engine, done)
        settle_saves(llm)
        result["resumed_counters"] = _counters(spec)
        assert llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
        settle_saves(llm)
        result["again_outputs"] = [_out(o) for o in outs]
        result["again_counters"] = _counters(spec)
    return result

def kill_at_commit(n: int) -> None:
    """SIGKILL this process inside its ``n``-th index commit of saved blocks: their slots
    are written and synced, the transaction that would index them is not committed (an
    engine killed mid-save)."""
    import signal

    from kvstore.index.index import Index

    commit = Index.commit_puts
    calls = [0]

    def commit_or_die(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] >= n:
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(self, *args, **kwargs)

    Index.commit_puts = commit_or_die  # type: ignore[method-assign]


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("kill_at_commit"):
        kill_at_commit(int(spec["kill_at_commit"]))
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    kwargs.update(spec.get("llm", {}))
    if spec.get("store") is not None:
        kwargs["kv_transfer_config"] = {
            **({"engine_id": spec["engine_id"]} if "engine_id" in spec else {}),
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": spec["store"], **spec.get("extra", {})},
        }
    result: dict[str, Any] = {}
    try:
        llm = LLM(model=spec["model"], **{
            "dtype": "float32", "enforce_eager": True, "block_size": BLOCK_SIZE,
            "max_model_len": 1024, "max_num_seqs": 4, "seed": 0, "disable_log_stats": False,
            "enable_prefix_caching": True, "kv_cache_memory_bytes": 64 << 20,
            "gpu_memory_utilization": 0.3, **kwargs})
    except Exception as e:  # the test asserts on the message
        result["error"] = f"{type(e).__name__}: {e}"
        cause = e.__cause__
        while cause is not None:
            result["error"] += f" <- {type(cause).__name__}: {cause}"
            cause = cause.__cause__
        with open(result_path, "w") as f:
            json.dump(result, f)
        return
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outputs = []
    aborts = {int(i): steps for i, steps in spec.get("abort_first", {}).items()}
    in_flight = spec.get("abort_in_flight")
    tensor_parallel = spec.get("llm", {}).get("tensor_parallel_size", 1) > 1
    if spec.get("update_while_running"):
        result["update"] = update_while_running(llm, spec, params)
    for i, prompt in enumerate(spec["prompts"] if spec.get("prompts_in_turn", True) else []):
        if i and spec.get("store") is not None:
            settle_saves(llm)
        assert llm.reset_prefix_cache()
        if in_flight is not None and i == in_flight[0]:
            # No prefix-cache reset after it: vLLM refuses one while the aborted
            # request's blocks are held, until a step processes its finished load.
            result["abort_in_flight"] = abort_in_flight(
                llm, prompt, spec["prompts"][in_flight[1]], params)
        if i in aborts:
            engine = llm.llm_engine
            engine.add_request(f"aborted-{i}", prompt, params)
            for _ in range(aborts[i]):
                engine.step()
            engine.abort_request([f"aborted-{i}"])
            while engine.has_unfinished_requests():  # let the abort reach the scheduler
                engine.step()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        outputs.append(_out(out))
    result["outputs"] = outputs
    if spec.get("weight_update"):
        # An RL trainer's weight update: new weights loaded in place, then the prefix
        # caches reset, connector included; then the same prompts again.
        if spec.get("store") is not None:
            settle_saves(llm)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": spec["weight_update"]})
        result["reset"] = llm.reset_prefix_cache(reset_connector=True)
        after = []
        for prompt in spec["prompts"]:
            if spec.get("store") is not None:
                settle_saves(llm)
            assert llm.reset_prefix_cache()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            after.append(_out(out))
        result["outputs_after_update"] = after
    if spec.get("batch"):
        if spec.get("store") is not None:
            settle_saves(llm)
        assert llm.reset_prefix_cache()
        result["batch_outputs"] = [_out(o) for o in
                                   llm.generate(spec["prompts"], params, use_tqdm=False)]
    result["metrics"] = metrics(llm)
    config = llm.llm_engine.vllm_config
    result["hybrid_kv_cache_manager"] = \
        config.scheduler_config.disable_hybrid_kv_cache_manager is False
    result["block_size"] = config.cache_config.block_size
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    groups = [] if core is None else core.scheduler.kv_cache_config.kv_cache_groups
    result["groups"] = [type(g.kv_cache_spec).__name__ for g in groups]
    if "abort_in_flight" in result:  # after the prompts that followed
        held = result["abort_in_flight"]
        held["free_after"] = llm.llm_engine.engine_core.engine_core.scheduler \
            .kv_cache_manager.block_pool.get_num_free_blocks()
        held["loading_after"] = len(held.pop("worker")._worker.loads.background.loading)
    if spec.get("store") is not None:
        from kvstore.integrations.vllm import connector_stats

        try:
            stats = connector_stats(spec["store"])
        except KeyError:  # VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core is a child
            stats = None
        result["connector"] = stats
        for out in outputs if stats is not None else []:
            out["keys"] = block_keys(out["prompt_token_ids"] + out["tokens"],
                                     result["block_size"], stats["namespace"])
            if len(result["groups"]) > 1:  # per KV cache group, in group order
                out["group_keys"] = [block_keys(out["prompt_token_ids"] + out["tokens"],
                                                result["block_size"], stats["namespace"], g)
                                     for g in range(len(result["groups"]))]
        if tensor_parallel:
            # Every rank's counters, from its worker process; keys per rank.
            ranks = [s for per_worker in llm.collective_rpc(_rank_stats) for s in per_worker]
            result["ranks"] = ranks
            # (a hybrid model's groups, when the engine core is a child: from the spec)
            groups = len(result["groups"]) or spec.get("group_count", 1)
            for out in outputs:
                out["rank_keys"] = [block_keys(out["prompt_token_ids"] + out["tokens"],
                                               result["block_size"], r["namespace"])
                                    for r in ranks]
                if groups > 1:  # per rank, per group
                    out["rank_group_keys"] = [
                        [block_keys(out["prompt_token_ids"] + out["tokens"],
                                    result["block_size"], r["namespace"], g)
                         for g in range(groups)] for r in ranks]
    with open(result_path, "w") as f:
        json.dump(result, f)
    if spec.get("hold"):
        print("KVSTORE-ENGINE-LIFE-READY", flush=True)
        sys.stdin.read()  # the test closes stdin when this engine may end


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
