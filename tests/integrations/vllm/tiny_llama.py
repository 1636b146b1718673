"""Build a tiny random Llama model and its tokenizer in a directory, without the hub.

Run with the vLLM venv's python (it needs transformers and tokenizers)::

    python tests/integrations/vllm/tiny_llama.py OUT_DIR [SEED]

SEED (default 0) draws other weights for the same architecture, files and sizes: "a
retrained model at the same path" for the connector's key-scope tests.

The tokenizer is a WordLevel vocabulary over lower-case words and punctuation, trained on
a few sentences, saved as a ``PreTrainedTokenizerFast`` so that vLLM loads it like any
hub tokenizer.  The model has random weights under a fixed seed: its greedy output is
gibberish, but deterministic, which is all the connector tests compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

TEXT = """
the quick brown fox jumps over the lazy dog . a store keeps blocks of attention keys and
values on disk so that an engine restart does not throw every computed prefix away .
you are a helpful assistant . answer the question of the user in one short sentence .
what is the capital of france ? paris is the capital of france . how many legs has a
spider ? a spider has eight legs . tell me a story about a cat and a mouse who live in
an old house by the river , and the winter when the river froze .
"""


def build(out: Path, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(TEXT.split())], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=max(tok.get_vocab_size(), 128), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    # Larger-than-default random matrices (norms stay 1): hidden states then depend on
    # the KV strongly enough that wrong KV changes the greedy tokens more often.
    # head_dim is 32, the smallest vLLM's CPU attention supports.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR [SEED]")
    build(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 0)
