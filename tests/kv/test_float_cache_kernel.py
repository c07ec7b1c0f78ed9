"""A float cache's decode step through ``pallas_kernels.decode_attention`` (interpret mode, forced here: on a CPU
the models keep XLA's path) equals XLA's update-then-attend, unrolled and scanned; where it is taken on a GPU."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import dispatch_table, native
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params, stacked
from pallas_kernels import config as kernel_config

LLAMA = ModelConfig("llama", 64, 128, 2, 4, 2, 32, 96, 1e-5, 64, False)  # grouped-query: 4 heads over 2
MISTRAL = ModelConfig("mistral", 64, 128, 2, 4, 4, 16, 96, 1e-5, 64, True, sliding_window=5)
PROMPT_MASK = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 left-padded
FAKE_H200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")


def _decode(config, params, tokens):
    """Logits of a 6-token prompt then one token a step, and the last cache (float32)."""
    step = lambda p, t, m, c: forward_step(config, p, t, m, c)  # noqa: E731  a fresh function: traced here
    cache = init_cache(config, 2, tokens.shape[1] + 2, jnp.float32)
    logits, cache = jax.jit(step)(params, tokens[:, :6], jnp.asarray(PROMPT_MASK), cache)
    outs, one, decode = [logits[:, -1:]], jnp.ones((2, 1), jnp.int32), jax.jit(step)
    for i in range(6, tokens.shape[1]):
        logits, cache = decode(params, tokens[:, i : i + 1], one, cache)
        outs.append(logits)
    return jnp.concatenate(outs, axis=1), cache


def _forced(monkeypatch):
    """The kernel for every one-token step (what a GPU takes), the path's choice otherwise as it is."""
    real = kvcache.float_path
    monkeypatch.setattr(kvcache, "float_path", lambda cache, q: "pallas" if q.shape[1] == 1 else real(cache, q))


@pytest.mark.parametrize("config", [LLAMA, MISTRAL], ids=["llama-gqa", "mistral-window"])
@pytest.mark.parametrize("scanned", [False, True])
def test_decode_through_the_kernel_equals_xla(config, scanned, monkeypatch):
    params = jax.tree.map(lambda a: a * 4, init_params(config, jax.random.key(0)))  # sharper attention
    if scanned:  # the layer index traced: the kernel reads and writes its layer of the stacked cache in place
        params = stacked.stack_blocks(config, params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 14)))
    with native.disabled():  # the CPU's native attention otherwise reads the float cache
        xla_logits, xla_cache = _decode(config, params, tokens)
        _forced(monkeypatch)
        real, rotated = kvcache.float_kernel.append_decode_attention, set()
        monkeypatch.setattr(kvcache.float_kernel, "append_decode_attention",
                            lambda *a, **kw: rotated.add(kw["rope"] is not None) or real(*a, **kw))
        with kernel_config.interpret(True):
            logits, cache = _decode(config, params, tokens)
            step = jax.make_jaxpr(lambda p, t, c: forward_step(config, p, t, jnp.ones((2, 1), jnp.int32), c))
            assert "append_decode_attention" in str(step(params, tokens[:, 6:7], cache))
    # the kernel rotates the query and key itself where each half of a head is a dot (head_dim 32, not 16)
    assert rotated == {config.head_dim // 2 >= 16}
    # the same keys and values in the same slots (to XLA's fusions' last bits: the two graphs compile apart)
    for got, want in ((cache.k, xla_cache.k), (cache.v, xla_cache.v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(jnp.max(jnp.abs(want))))
    assert int(cache.length) == int(xla_cache.length) and float(jnp.max(jnp.abs(cache.k[:, :, :, -2:]))) == 0.0
    # float32 sums in another order; a wrong slot, mask or softmax moves the logits by far more
    np.testing.assert_allclose(logits, xla_logits, atol=2e-5 * float(jnp.max(jnp.abs(xla_logits))))
    assert config.sliding_window is None or tokens.shape[1] > config.sliding_window + 6  # the window slides


@pytest.mark.usefixtures("unchecked_kernels")
def test_the_kernel_is_a_gpus_one_token_path_unless_a_table_measured_xla_faster():
    """Traced for a GPU: a one-token step over a float cache is the kernel and no dynamic-update-slice; a
    prompt (several tokens), a CPU, interpret mode and a table that measured XLA faster keep XLA's path."""
    params = init_params(LLAMA, jax.random.key(0))

    def traced(t: int) -> str:
        cache = init_cache(LLAMA, 1, 64, jnp.bfloat16)
        step = lambda p, x, c: forward_step(LLAMA, p, x, jnp.ones((1, t), jnp.int32), c)  # noqa: E731
        return str(jax.make_jaxpr(step)(params, jnp.zeros((1, t), jnp.int32), cache))

    assert "append_decode_attention" not in traced(1)  # this CPU
    with kernel_config.interpret(True):
        assert "append_decode_attention" not in traced(1)
    with kernel_config.compiling_for(FAKE_H200):
        text = traced(1)
        assert "append_decode_attention" in text
        assert "bf16[2,1,2,64,32] = dynamic_update_slice" not in text  # the kernel writes the caches in place
        assert "append_decode_attention" not in traced(4)
        # measured at 16 bits (a bf16 cache), 2 query rows per kv head, 64 slots
        key = dispatch_table.Key(FAKE_H200.device_kind, "kv_attention", 16, None, LLAMA.head_dim, 64, 2, "float32")
        slower = dispatch_table.from_json(dispatch_table.to_json(
            key.device, [(key, {"pallas_s": 3e-6, "xla_s": 2e-6, "bf16_s": 2e-6})]))
        with dispatch_table.use(slower):
            text = traced(1)
            assert "append_decode_attention" not in text and "bf16[2,1,2,64,32] = dynamic_update_slice" in text
        with kernel_config.disabled():
            assert "append_decode_attention" not in traced(1)


def test_rope_is_left_to_the_kernel_only_where_it_takes_the_step(monkeypatch):
    """``kvcache.rotates``: a one-token step's q and k reach ``attend`` before RoPE only with the model's RoPE
    tables, a float cache through the kernel, head halves of at least 16 features and the setting not "xla"; and
    ``attend`` handed pre-RoPE q and k on any other path rotates them itself (XLA's update-then-attend here)."""
    from llmeq_jax.core.rope import apply_rope, rope_inv_freq, rope_tables
    from llmeq_jax.kv import spec as kvspec
    from pallas_kernels import settings

    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, 1, 4, 32))
    k, v = (jax.random.normal(key, (2, 2, 1, 32)) for key in keys[1:])
    positions = jnp.asarray([[5], [9]])
    tables = rope_tables(positions, rope_inv_freq(32, 10000.0, None))
    cache = init_cache(LLAMA, 2, 16)
    assert not kvcache.rotates(cache, q, tables)  # a CPU: XLA's path, XLA's rotation
    _forced(monkeypatch)
    assert kvcache.rotates(cache, q, tables)
    assert not kvcache.rotates(cache, q, positions)  # positions, no tables: the model rotates
    assert not kvcache.rotates(cache, q[..., :16], tables)  # halves of 8 features: too small a dot
    quantized = kvspec.KVQuantizer(None, kvspec.KVSpec(bits=8, key_range="online", prompt_tokens=4))
    assert not kvcache.rotates(init_cache(LLAMA, 2, 16, kv=quantized), q, tables)
    with settings.override("append_decode_attention", rope="xla"):
        assert not kvcache.rotates(cache, q, tables)
    # attend on XLA's path with rope= equals attend with q and k rotated before
    monkeypatch.setattr(kvcache, "float_path", lambda cache, q: "xla")
    mask = jnp.ones((2, 1, 16), bool)
    got, got_cache = kvcache.attend(cache, 1, q, k, v, mask, rope=tables)
    want, want_cache = kvcache.attend(cache, 1, apply_rope(q, tables, None), apply_rope(k, tables, None, heads_axis=1),
                                      v, mask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(want_cache.k))
    assert not np.array_equal(np.asarray(got_cache.k[1, :, :, 0]), np.asarray(k[:, :, 0]))  # the key was rotated
