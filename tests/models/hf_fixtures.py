"""Tiny random Hugging Face models written with ``save_pretrained`` (the real on-disk format)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, **COMMON)

# name -> (HF config, save_pretrained kwargs). Each case exercises one variant feature.
CASES = {
    # Llama-3 rope scaling with a short original context, so the scaling changes the result.
    "llama": (lambda: transformers.LlamaConfig(
        **LLAMA_LIKE, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8}), {"max_shard_size": "60KB"}),
    # A window shorter than the test sequences, so sliding actually masks keys.
    "mistral": (lambda: transformers.MistralConfig(**LLAMA_LIKE, sliding_window=4, head_dim=16), {}),
    "qwen2": (lambda: transformers.Qwen2Config(**LLAMA_LIKE, tie_word_embeddings=True), {}),
    # head_dim different from hidden / heads, q/k norms.
    "qwen3": (lambda: transformers.Qwen3Config(**LLAMA_LIKE, head_dim=24, tie_word_embeddings=False),
              {"max_shard_size": "80KB"}),
    "gpt2": (lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **COMMON), {}),
}


def make_hf_model(name: str, seed: int = 0, vocab_size: int | None = None) -> torch.nn.Module:
    """A random fp32 model; every parameter (biases and norms too) drawn at random so all are tested."""
    config = CASES[name][0]()
    if vocab_size is not None:  # to hold a real tokenizer's vocabulary
        config.vocab_size = vocab_size
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            is_norm_scale = ("norm" in pname or "ln_" in pname) and pname.endswith("weight")
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if is_norm_scale else 0.2 * torch.randn_like(p))
    return model


def save(model: torch.nn.Module, name: str, directory) -> None:
    model.save_pretrained(directory, **CASES[name][1])
