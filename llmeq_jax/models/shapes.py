"""Published model shapes for benchmarks with random weights (no download, no checkpoint).

The fields are those of each model's Hugging Face ``config.json``; speed and compile time
depend on the shapes only, so a Llama-2-7B-shaped model with random weights measures what
the real one would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llmeq_jax.models.config import ModelConfig, config_from_hf_dict
from llmeq_jax.models.model import init_params

PUBLISHED = {
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=False),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True),
}


def shape_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The config of a :data:`PUBLISHED` model (``num_layers`` overrides its depth, e.g. for a quick run)."""
    if name not in PUBLISHED:
        raise ValueError(f"unknown model shapes {name!r}; known: {', '.join(PUBLISHED)}")
    config = config_from_hf_dict(PUBLISHED[name], source=name)
    return config if num_layers is None else dataclasses.replace(config, num_layers=num_layers)


def random_params(config: ModelConfig, dtype=jnp.float32, seed: int = 0):
    """Random params of ``config``'s shapes in ``dtype``, built on the default device."""
    return init_params(config, jax.random.key(seed), dtype)


__all__ = ["PUBLISHED", "random_params", "shape_config"]
