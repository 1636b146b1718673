"""One engine life: start vLLM on CPU, serve prompts, write what happened as JSON.

Run with the vLLM venv's python (tests/integrations/test_vllm.py does)::

    python tests/integrations/engine_life.py SPEC.json RESULT.json

SPEC: ``{"model": DIR, "prompts": [str, ...], "max_tokens": int, "store": PATH | null,
"extra": {...}}``, optionally ``"llm": {...}`` (more ``LLM`` arguments: ``hf_overrides``,
``kv_cache_dtype``), ``"engine_id": str`` (the kv_transfer_config's), ``"abort_first":
{"I": STEPS}`` (prompt I is first submitted through the engine, stepped STEPS times and
aborted, then served as usual, without a prefix-cache reset in between) and ``"hold":
true`` (after writing RESULT, print KVSTORE-ENGINE-LIFE-READY and keep the engine alive until stdin closes).
``store: null`` runs without the connector (the reference outputs).  Prompts are served
one ``generate`` call each, in order, with vLLM's own (device) prefix cache reset before
each: a later prompt can reuse an earlier one's blocks only through kvstore (or, after
an aborted attempt, through what that attempt left in vLLM's prefix cache).  RESULT: per prompt the output token ids, vLLM's ``num_cached_tokens`` and the
store keys of its full blocks (vLLM's block hashes, computed here with vLLM's hash
function, scoped by the connector's namespace: an independent check of the key
derivation); vLLM's metrics; the connector's counters
(``kvstore.integrations.vllm.connector_stats``); or ``error`` if the engine failed to
start.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
BLOCK_SIZE = 32  # the smallest block vLLM's CPU attention supports


def metrics(llm: Any) -> dict[str, Any]:
    """Counters by name (and by their ``source`` label where they have one)."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if not isinstance(value, (int, float)):
            continue
        source = m.labels.get("source")
        name = m.name if source is None else f"{m.name}[{source}]"
        out[name] = out.get(name, 0) + value
    return out


def block_keys(token_ids: list[int], block_size: int, namespace_json: str) -> list[str]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from kvstore import Namespace

    fn = get_hash_fn_by_name("sha256")
    parent = None
    hashes = []
    for i in range(len(token_ids) // block_size):
        parent = kv_cache_utils.hash_block_tokens(
            fn, parent, token_ids[i * block_size:(i + 1) * block_size], None)
        hashes.append(bytes(parent))
    return [k.hex() for k in Namespace.from_json(namespace_json).engine_keys(hashes)]


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
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
        llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
                  max_model_len=1024, max_num_seqs=4, seed=0, disable_log_stats=False,
                  enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20,
                  gpu_memory_utilization=0.3, **kwargs)
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
    for i, prompt in enumerate(spec["prompts"]):
        assert llm.reset_prefix_cache()
        if i in aborts:
            engine = llm.llm_engine
            engine.add_request(f"aborted-{i}", prompt, params)
            for _ in range(aborts[i]):
                engine.step()
            engine.abort_request([f"aborted-{i}"])
            while engine.has_unfinished_requests():  # let the abort reach the scheduler
                engine.step()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        outputs.append({"prompt_token_ids": list(out.prompt_token_ids),
                        "tokens": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens})
    result["outputs"] = outputs
    result["metrics"] = metrics(llm)
    if spec.get("store") is not None:
        from kvstore.integrations.vllm import connector_stats

        try:
            stats = connector_stats(spec["store"])
        except KeyError:  # VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core is a child
            stats = None
        result["connector"] = stats
        for out in outputs if stats is not None else []:
            out["keys"] = block_keys(out["prompt_token_ids"] + out["tokens"], BLOCK_SIZE,
                                     stats["namespace"])
    with open(result_path, "w") as f:
        json.dump(result, f)
    if spec.get("hold"):
        print("KVSTORE-ENGINE-LIFE-READY", flush=True)
        sys.stdin.read()  # the test closes stdin when this engine may end


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
