"""KV cache: the slot bookkeeping, and cached decoding equals a full forward at every step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import kvcache
from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params
from llmeq_jax.models import forward as _forward

forward = jax.jit(_forward, static_argnums=0)  # one compile per shape instead of op-by-op dispatch


def test_update_read_append_advance():
    cache = kvcache.init(num_layers=2, batch=2, kv_heads=1, max_len=6, head_dim=3)
    k = jnp.ones((2, 1, 2, 3))
    cache = kvcache.append_mask(cache, jnp.array([[0, 1], [1, 1]]))
    cache = kvcache.update(cache, 1, k, 2 * k)
    cache = kvcache.advance(cache, jnp.array([[0, 1], [1, 1]]))
    keys, values = kvcache.read(cache, 1)
    assert int(cache.length) == 2
    np.testing.assert_array_equal(cache.positions, [1, 2])
    np.testing.assert_array_equal(keys[:, 0, :2], 1.0)
    np.testing.assert_array_equal(values[:, 0, :2], 2.0)
    np.testing.assert_array_equal(keys[:, 0, 2:], 0.0)
    np.testing.assert_array_equal(kvcache.read(cache, 0)[0], 0.0)  # other layer untouched
    np.testing.assert_array_equal(cache.valid[:, :3], [[False, True, False], [True, True, False]])
    # Next tokens land after the written slots and continue each row's positions.
    np.testing.assert_array_equal(kvcache.slots(cache, 2), [2, 3])
    np.testing.assert_array_equal(kvcache.new_positions(cache, jnp.ones((2, 2))), [[1, 2], [2, 3]])


CONFIGS = {
    "llama": ModelConfig("llama", 64, 32, 2, 4, 2, 8, 48, 1e-5, 64, False),
    "mistral-window": ModelConfig("mistral", 64, 32, 2, 4, 2, 8, 48, 1e-5, 64, True, sliding_window=3),
    "gpt2": ModelConfig("gpt2", 64, 32, 2, 4, 4, 8, 48, 1e-5, 64, True, act="gelu_tanh"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_equals_full_forward_every_step(name):
    config = CONFIGS[name]
    params = init_params(config, jax.random.key(0))
    params = jax.tree.map(lambda a: a * 10, params)  # sharper attention than the 0.02 init, so errors show
    rng = np.random.default_rng(0)
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 10)))
    prompt = tokens[:, :5]
    cache = init_cache(config, 2, 10)
    step = jax.jit(forward_step, static_argnums=0)
    logits, cache = step(config, params, prompt, mask, cache)
    seen, seen_mask = prompt, mask
    full = forward(config, params, seen, seen_mask)
    np.testing.assert_allclose(logits[mask == 1], full[mask == 1], atol=1e-4)
    for i in range(5, 10):
        token = tokens[:, i : i + 1]
        logits, cache = step(config, params, token, jnp.ones((2, 1), jnp.int32), cache)
        seen = jnp.concatenate([seen, token], axis=1)
        seen_mask = jnp.concatenate([seen_mask, jnp.ones((2, 1), jnp.int32)], axis=1)
        full = forward(config, params, seen, seen_mask)
        np.testing.assert_allclose(logits[:, 0], full[:, -1], atol=1e-4)
    assert int(cache.length) == 10
