"""generate(): static shapes, greedy = argmax of the full forward, sampling controls."""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import generate as gen
from llmeq_jax import native
from llmeq_jax.models import ModelConfig, init_params
from llmeq_jax.models import forward as _forward

CONFIG = ModelConfig("llama", 64, 32, 2, 4, 2, 8, 48, 1e-5, 64, False)

forward = jax.jit(_forward, static_argnums=0)  # one compile per shape instead of op-by-op dispatch


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(lambda a: a * 10, init_params(CONFIG, jax.random.key(1)))


def test_greedy_equals_argmax_of_full_forward(params):
    prompt = jnp.array([[0, 5, 7, 9], [3, 4, 5, 6]])
    mask = jnp.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    out = gen.generate(CONFIG, params, prompt, 6, attention_mask=mask)
    assert out.shape == (2, 6)
    seq, seq_mask = prompt, mask
    for i in range(6):
        want = jnp.argmax(forward(CONFIG, params, seq, seq_mask)[:, -1], axis=-1)
        np.testing.assert_array_equal(out[:, i], want)
        seq = jnp.concatenate([seq, want[:, None]], axis=1)
        seq_mask = jnp.concatenate([seq_mask, jnp.ones((2, 1), jnp.int32)], axis=1)


def test_prefill_runs_the_head_on_the_last_position_only(params):
    """prefill's logits are the full step's last position, and its traced program multiplies one
    position per row by the head (vocab-wide products of [B, 1, hidden] only), not every prompt position."""
    prompt = jnp.array([[0, 5, 7, 9, 2], [3, 4, 5, 6, 1]])
    mask = jnp.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    full, _ = jax.jit(gen.forward_step, static_argnums=0)(CONFIG, params, prompt, mask, gen.init_cache(CONFIG, 2, 8))
    got, _ = gen.prefill(CONFIG, params, prompt, mask, gen.init_cache(CONFIG, 2, 8))
    np.testing.assert_allclose(np.asarray(got), np.asarray(full[:, -1]), rtol=1e-5, atol=1e-5)

    jaxpr = jax.make_jaxpr(gen.prefill.__wrapped__, static_argnums=0)(CONFIG, params, prompt, mask,
                                                                      gen.init_cache(CONFIG, 2, 8))
    head_shapes = [e.outvars[0].aval.shape for e in _equations(jaxpr.jaxpr)
                   if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == CONFIG.vocab_size]
    assert head_shapes and all(math.prod(s[:-1]) == 2 for s in head_shapes), head_shapes


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (pjit, scan, custom calls)."""
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _equations(sub)


@pytest.mark.parametrize("case", ["random", "ties", "nan", "all_inf"])
def test_greedy_tokens_are_argmax(case):
    """greedy_tokens (max, then the first index holding it) picks what jnp.argmax picks: the first of
    tied maxima, the first NaN of a row that has one, index 0 of a row of -inf."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 300)).astype(np.float32)
    if case == "ties":
        x = np.round(x)  # many equal maxima per row
    elif case == "nan":
        x[1, 17] = x[1, 40] = np.nan
        x[3, 299] = np.nan
    elif case == "all_inf":
        x[2] = -np.inf
    got = jax.jit(gen.greedy_tokens)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_decode_step_compiles_once(params):
    cache = gen.init_cache(CONFIG, 1, 12)
    _, cache = gen.prefill(CONFIG, params, jnp.array([[1, 2, 3]]), jnp.ones((1, 3), jnp.int32), cache)
    before = gen.decode_step._cache_size()
    token = jnp.array([4])
    for _ in range(4):
        logits, cache = gen.decode_step(CONFIG, params, token, cache)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    assert gen.decode_step._cache_size() - before <= 1
    assert int(cache.length) == 7


def test_decode_loop_runs_the_steps_asked_with_one_compile(params):
    """The loop's step count is traced: fewer steps give a prefix of the full greedy output (later
    slots 0) from the same compiled program, which decode_seconds times."""
    prompt = jnp.array([[1, 5, 7, 9]])
    full = gen.generate(CONFIG, params, prompt, 8)
    cache = gen.init_cache(CONFIG, 1, 4 + 8)
    logits, cache = gen.prefill(CONFIG, params, prompt, jnp.ones_like(prompt), cache, kernels=gen.kernel_state())
    before = gen._decode_loop._cache_size()
    for steps in (8, 3, 1):
        out, _ = gen._decode_loop(CONFIG, params, logits, cache, jax.random.key(0), jnp.int32(steps), max_new_tokens=8,
                                  greedy=True, temperature=1.0, top_k=0, top_p=1.0, kernels=gen.kernel_state())
        np.testing.assert_array_equal(out[:, :steps], full[:, :steps])
        assert not np.asarray(out[:, steps:]).any()
    assert gen._decode_loop._cache_size() - before <= 1
    assert gen.decode_seconds(CONFIG, params, prompt, 8, runs=1) > 0


def test_decode_timing_uses_the_models_cache_dtype_and_reports_the_first_call(params, monkeypatch):
    """decode_timing (what bench_e2e, bench_kv_decode and the CLI time decode with) fills the cache generate would:
    bf16 for a bf16 model (it was float32 whatever the model), quantized by ``kv`` where given; its first call,
    which compiles the loop, is reported."""
    from llmeq_jax import calibrate
    from llmeq_jax.kv import spec as kvspec

    made, quantizers = [], []
    real = gen.init_cache

    def spy(config, batch, max_len, dtype=jnp.float32, **kw):
        made.append(jnp.dtype(dtype))
        quantizers.append(kw.get("kv"))
        return real(config, batch, max_len, dtype, **kw)

    monkeypatch.setattr(gen, "init_cache", spy)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    with native.disabled():  # as on a GPU
        seconds, first = gen.decode_timing(CONFIG, bf16, jnp.array([[1, 5, 7]]), 6, runs=1)
    assert made == [jnp.dtype(jnp.bfloat16)] and 0 < seconds and first > 0
    gen.decode_seconds(CONFIG, params, jnp.array([[1, 5, 7]]), 4, runs=1)
    assert made[-1] == jnp.dtype(jnp.float32) and quantizers == [None, None]
    kv = calibrate.make_kv_quantizer(kvspec.KVSpec(bits=8, key_range="online", prompt_tokens=3))
    seconds, _ = gen.decode_timing(CONFIG, params, jnp.array([[1, 5, 7]]), 4, runs=1, kv=kv)
    assert quantizers[-1] is kv and seconds > 0


def test_a_bf16_model_with_float32_norms_decodes_in_bf16(params):
    """The loaders keep 1-D params (norm scales, biases) in float32 in a bfloat16 model (--dtype bfloat16): its
    activations are still bf16 (the token table's rows; norms return their input's dtype), and so is the cache
    generate fills without native kernels (a GPU; it was float32, read off the final norm's scale). Where the
    native kernels run the cache is float32, which their decode attention reads, and the tokens are the same."""
    loaded = jax.tree.map(lambda a: a.astype(jnp.bfloat16 if a.ndim >= 2 else jnp.float32), params)
    assert loaded["norm"]["scale"].dtype == jnp.float32
    assert gen.activation_dtype(loaded) == jnp.bfloat16
    prompt = jnp.array([[1, 5, 7]])
    with native.disabled():
        want, cache = gen.generate(CONFIG, loaded, prompt, 3, return_cache=True)
    assert cache.k.dtype == jnp.bfloat16
    assert native.available(), native.unavailable_reason()
    got, cache = gen.generate(CONFIG, loaded, prompt, 3, return_cache=True)
    assert cache.k.dtype == jnp.float32 and gen.cache_dtype_for(loaded) == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_sampling_is_seeded_and_varies(params):
    prompt = jnp.array([[1, 2, 3]])
    a = gen.generate(CONFIG, params, prompt, 12, greedy=False, temperature=2.0, seed=0)
    b = gen.generate(CONFIG, params, prompt, 12, greedy=False, temperature=2.0, seed=0)
    c = gen.generate(CONFIG, params, prompt, 12, greedy=False, temperature=2.0, seed=1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_top_k_and_top_p_limit_the_choice():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512))
    keys = jax.random.split(jax.random.key(0), 1)[0]
    k1 = gen.sample_logits(logits, keys, greedy=False, temperature=1.0, top_k=2, top_p=1.0)
    assert set(np.asarray(k1).tolist()) == {0, 1}
    p = gen.sample_logits(logits, keys, greedy=False, temperature=1.0, top_k=0, top_p=0.6)
    assert set(np.asarray(p).tolist()) == {0, 1}  # 0.5 < 0.6, so the second token is needed too
    p1 = gen.sample_logits(logits, keys, greedy=False, temperature=1.0, top_k=0, top_p=0.4)
    assert set(np.asarray(p1).tolist()) == {0}
    full = gen.sample_logits(logits, keys, greedy=False, temperature=1.0, top_k=0, top_p=1.0)
    assert len(set(np.asarray(full).tolist())) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(greedy=False, temperature=0.0), "temperature"),
        (dict(greedy=False, top_k=-1), "top_k"),
        (dict(greedy=False, top_p=0.0), "top_p"),
        (dict(attention_mask=jnp.ones((1, 2))), "attention_mask"),
    ],
)
def test_bad_generation_arguments(params, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(CONFIG, params, jnp.array([[1, 2, 3]]), 4, **kwargs)
