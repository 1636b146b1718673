"""One engine life: start vLLM on CPU, serve prompts, write what happened as JSON.

Run with the vLLM venv's python (tests/integrations/test_vllm.py does)::

    python tests/integrations/engine_life.py SPEC.json RESULT.json

SPEC: ``{"model": DIR, "prompts": [str, ...], "max_tokens": int, "store": PATH | null,
"extra": {...}}``.  ``store: null`` runs without the connector (the reference outputs).
Prompts are served one ``generate`` call each, in order, so a later prompt can reuse the
blocks an earlier one stored.  RESULT: per prompt the output token ids and vLLM's
``num_cached_tokens``; vLLM's prompt-token metrics by source; the connector's counters
(``kvstore.integrations.vllm.connector_stats``); or ``error`` if the engine failed to
start.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


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


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if spec.get("store") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": spec["store"], **spec.get("extra", {})},
        }
    result: dict[str, Any] = {}
    try:
        llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, block_size=32,
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
    for prompt in spec["prompts"]:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        outputs.append({"prompt_tokens": len(out.prompt_token_ids),
                        "tokens": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens})
    result["outputs"] = outputs
    result["metrics"] = metrics(llm)
    if spec.get("store") is not None:
        from kvstore.integrations.vllm import connector_stats

        result["connector"] = connector_stats(spec["store"])
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
