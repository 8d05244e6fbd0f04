#!/usr/bin/env python
"""Write tiny random models and a local tokenizer for real engines on CPU.

    .venv/bin/python scripts/make_tiny_model.py build/tiny-llama
    .venv/bin/python scripts/make_tiny_model.py build/tiny-gemma2 gemma2
    .venv/bin/python scripts/make_tiny_model.py build/tiny-granite-h granite-h
    .venv/bin/python scripts/make_tiny_model.py build/tiny-granite-h-g2 granite-h-g2
    .venv/bin/python scripts/make_tiny_model.py build/tiny-qwen3-next qwen3-next

llama: 4 layers, hidden 128, 4 attention heads, 2 KV heads (GQA), vocab
512, bf16, random weights (seeded), and a WordLevel tokenizer over the same
512 ids. gemma2: the same sizes, layers alternating sliding-window (64
tokens) and full attention, with the Llama's tokenizer. Nothing is
downloaded; an existing model directory is left as it is.

Hybrid (state-space + attention) kinds, the same vocab, tokenizer, bf16 and
seeding, weights drawn with std HYBRID_INIT_STD (0.1, so that outputs depend
on the context); every head count, the intermediate sizes and the Mamba
groups divide by 2 (tensor parallel 2):

granite-h: granite-4.0-h style GraniteMoeHybridForCausalLM, dense (no
experts; shared MLP 256), layers Mamba2, attention, Mamba2, attention
(attention 4 heads / 2 KV heads of 32, no RoPE as granite-4.0-h); Mamba2
hidden 128, expand 2 (inner 256), 8 heads of 32, d_state 32, d_conv 4,
chunk 64, mamba_n_groups 1 (the case where a TP-2 shard replicates the one
group). granite-h-g2: the same with mamba_n_groups 2 (one group per TP-2
rank). qwen3-next: Qwen3NextForCausalLM, layers gated delta net x3 then
full attention (gated, 4 heads / 2 KV heads of 32, partial RoPE 0.25); GDN
2 key heads / 4 value heads of 64 (vLLM's CPU GDN kernel takes head dims 64
and 128 only), conv 4; every layer a MoE of 4 experts
(top 2) of 64 plus a shared expert of 64 (vLLM's Qwen3-Next needs at least
one MoE layer). No Qwen3.5 kind: vLLM's qwen3_5 module imports
qwen3_vl, which needs torchvision (not installed in .venv: it breaks
transformers beside this torch), so vLLM cannot load it here.

Serving the hybrids on vLLM v0.32.0's CPU backend (seen 2026-12-03): the
attention block size is raised to match the Mamba page (granite-h 160,
qwen3-next 288, whatever --block-size says); the SSM state is kept in
float32 on CPUs with AVX-512-bf16 (bf16 elsewhere, a smaller Mamba page
and so a smaller attention block). Prefix caching (on by default) selects
mamba_cache_mode "align", in which a Mamba2 prefill crossing a block
boundary killed the engine ("IndexError: index 6 is out of bounds for
dimension 0 with size 1", mamba_mixer2.py) until the series' patch 0017
(docs/mamba.md). Under NixlConnector the conv state must be laid
out DS: vLLM picks it when kv_connector is NixlConnector itself, not when
it is wrapped (the demo's fault connector): then set
VLLM_SSM_CONV_STATE_LAYOUT=DS.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

GEMMA2_WINDOW = 64
# Weight init std of the hybrid kinds. With transformers' default (0.02) the
# tiny models barely read their context (replacing the first 100 of 150
# tokens moved the last position's log-probs by at most 0.025, about bf16
# noise), so a corrupted transferred state would hardly show in the output;
# with 0.1 the same change moves them by ~3.
HYBRID_INIT_STD = 0.1


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


def _with_llama_tokenizer(path: Path, save) -> Path:
    """Make the model directory with save(path) and the Llama's tokenizer."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    llama = make(path.parent / "tiny-llama")
    path.mkdir(parents=True, exist_ok=True)
    save(path)
    for f in llama.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path


def make_granite_h(path: Path, seed: int = 0, n_groups: int = 1) -> Path:
    """A tiny random granite-4.0-h style Mamba2 / attention hybrid
    (GraniteMoeHybridForCausalLM without experts), mamba_n_groups n_groups."""

    def save(path: Path) -> None:
        import torch
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        torch.manual_seed(seed)
        config = GraniteMoeHybridConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
            num_local_experts=0, num_experts_per_tok=0, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_attention_heads=4, num_key_value_heads=2, position_embedding_type="nope",
            max_position_embeddings=1024, mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=n_groups,
            mamba_d_state=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, dtype="bfloat16",
            initializer_range=HYBRID_INIT_STD)
        GraniteMoeHybridForCausalLM(config).to(torch.bfloat16).save_pretrained(path)

    return _with_llama_tokenizer(path, save)


def make_granite_h_g2(path: Path, seed: int = 0) -> Path:
    """granite-h with mamba_n_groups 2."""
    return make_granite_h(path, seed, n_groups=2)


def make_qwen3_next(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-Next (gated delta net x3, full attention; 4 small experts)."""

    def save(path: Path) -> None:
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        torch.manual_seed(seed)
        config = Qwen3NextConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=1024,
            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[], decoder_sparse_step=1,
            moe_intermediate_size=64, shared_expert_intermediate_size=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, dtype="bfloat16",
            initializer_range=HYBRID_INIT_STD)
        Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)

    return _with_llama_tokenizer(path, save)


MAKERS = {"llama": make, "gemma2": make_gemma2, "granite-h": make_granite_h, "granite-h-g2": make_granite_h_g2,
          "qwen3-next": make_qwen3_next}

if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "build/tiny-llama")
    print(MAKERS[sys.argv[2] if len(sys.argv) > 2 else "llama"](target).resolve())
