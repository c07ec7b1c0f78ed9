"""A ``transformers`` (PyTorch) Llama model holding exactly our float weights.

The reference the benchmarks compare with: same weights, so speed and perplexity
differences are the frameworks', not the checkpoints'. Needs torch + transformers
(torch is in the ``dev`` extra); a QArray leaf is dequantized first.
"""

from __future__ import annotations

import numpy as np

from llmeq_jax.models.config import ModelConfig


def hf_llama_config(config: ModelConfig):
    """``transformers.LlamaConfig`` of our config (plain Llama models only)."""
    import transformers

    if config.family != "llama" or config.qkv_bias or config.o_bias or config.qk_norm:
        raise ValueError(f"to_transformers builds plain Llama models only, not {config.model_type!r} with these options")
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def transformers_llama(config: ModelConfig, params):
    """``LlamaForCausalLM`` (float32, eval mode) with our params; kernels ``(in, out)`` become torch ``(out, in)``."""
    import torch
    import transformers

    from llmeq_jax.ops import dequantize_tree_leaf

    model = transformers.LlamaForCausalLM(hf_llama_config(config)).float().eval()

    def t(a, transpose=False):
        a = np.asarray(dequantize_tree_leaf(a), np.float32)
        return torch.from_numpy(np.ascontiguousarray(a.T if transpose else a))

    state = {"model.embed_tokens.weight": t(params["embed"]["embedding"]), "model.norm.weight": t(params["norm"]["scale"])}
    for i in range(config.num_layers):
        p, pre = params[f"layers_{i}"], f"model.layers.{i}."
        state[pre + "input_layernorm.weight"] = t(p["input_norm"]["scale"])
        state[pre + "post_attention_layernorm.weight"] = t(p["post_attn_norm"]["scale"])
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[pre + f"self_attn.{n}.weight"] = t(p["attn"][n]["kernel"], True)
        for n in ("gate_proj", "up_proj", "down_proj"):
            state[pre + f"mlp.{n}.weight"] = t(p["mlp"][n]["kernel"], True)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = t(params["lm_head"]["kernel"], True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"transformers model does not take our tree: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


__all__ = ["hf_llama_config", "transformers_llama"]
