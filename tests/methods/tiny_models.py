"""Tiny random models for the method tests: llama with GQA and qkv bias, and gpt2, with non-trivial norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.models import ModelConfig, init_params


def tiny_config(family: str) -> ModelConfig:
    common = dict(vocab_size=96, hidden_size=32, num_layers=2, intermediate_size=64, norm_eps=1e-5,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "gpt2":
        return ModelConfig(model_type="gpt2", num_heads=4, num_kv_heads=4, head_dim=8, act="gelu_tanh", **common)
    # 4 query heads on 2 KV heads (GQA), Qwen2-style q/k/v biases.
    return ModelConfig(model_type="qwen2", num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, **common)


def tiny_model(family: str, seed: int = 0):
    """(config, params) with random norms/biases and a few outlier input channels, like real LLMs."""
    config = tiny_config(family)
    params = init_params(config, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)

    def perturb(path, leaf):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if name.endswith("scale"):
            s = 1 + 0.3 * rng.normal(size=leaf.shape)
            s[rng.random(leaf.shape) < 0.1] *= 20  # outlier channels
            return jnp.asarray(s, leaf.dtype)
        if name.endswith("bias"):
            return jnp.asarray(0.1 * rng.normal(size=leaf.shape), leaf.dtype)
        return leaf

    return config, jax.tree_util.tree_map_with_path(perturb, params)


def tiny_windows(config, n: int = 4, t: int = 32, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, size=(n, t))
