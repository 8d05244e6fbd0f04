#!/usr/bin/env python
"""Write tiny random models and a local tokenizer for real engines on CPU.

    .venv/bin/python scripts/make_tiny_model.py build/tiny-llama
    .venv/bin/python scripts/make_tiny_model.py build/tiny-gemma2 gemma2

llama: 4 layers, hidden 128, 4 attention heads, 2 KV heads (GQA), vocab
512, bf16, random weights (seeded), and a WordLevel tokenizer over the same
512 ids. gemma2: the same sizes, layers alternating sliding-window (64
tokens) and full attention, with the Llama's tokenizer. Nothing is
downloaded; an existing model directory is left as it is.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

GEMMA2_WINDOW = 64


def make(path: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, 512)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    return path


def make_gemma2(path: Path, seed: int = 0) -> Path:
    """A tiny random Gemma-2 (sliding window / full attention alternating)."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    llama = make(path.parent / "tiny-llama")
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                          max_position_embeddings=1024, sliding_window=GEMMA2_WINDOW,
                          layer_types=["sliding_attention", "full_attention"] * 2,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    Gemma2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    for f in llama.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path


MAKERS = {"llama": make, "gemma2": make_gemma2}

if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "build/tiny-llama")
    print(MAKERS[sys.argv[2] if len(sys.argv) > 2 else "llama"](target).resolve())
