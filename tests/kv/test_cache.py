"""KV cache: the slot bookkeeping, and cached decoding equals a full forward at every step."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import native
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv import grid as kvgrid
from llmeq_jax.kv import memory as kvmemory
from llmeq_jax.kv import spec as kvspec
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


@pytest.mark.parametrize("spec", [kvspec.KVSpec(bits=8), kvspec.KVSpec(bits=4, pre_rope=False, sink_tokens=2),
                                  kvspec.KVSpec(bits=8, key_range="online", prompt_tokens=5, sink_tokens=0)],
                         ids=["int8-preRoPE-sinks4", "int4-postRoPE-sinks2", "int8-online"])
@pytest.mark.parametrize("native_kernels", [False, True])
def test_a_prompt_into_an_unwritten_quantized_cache_reads_its_own_slots(spec, native_kernels):
    """A fresh quantized cache's prompt dequantizes and attends to its first T slots (with its float sinks), not all
    max_len: the logits of reading every slot (the same empty slots dequantized whole), on XLA's path and the
    native kernels'; the first layer's codes (written before any attention) are the same."""
    from llmeq_jax import calibrate

    config = CONFIGS["llama"]
    params = jax.tree.map(lambda a: a * 10, init_params(config, jax.random.key(2)))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (2, 5)))
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kv = calibrate.make_kv_quantizer(spec, config, params, np.random.default_rng(3).integers(0, 64, (2, 16)))
    fresh = init_cache(config, 2, 40, kv=kv)
    assert not fresh.written
    step = lambda p, t, c: forward_step(config, p, t, mask, c)  # noqa: E731
    with contextlib.nullcontext() if native_kernels else native.disabled():
        if not native_kernels:  # the dequantized layer's shape: 5 slots, not 40
            own = str(jax.make_jaxpr(step)(params, tokens, fresh))
            assert "f32[2,2,5,8]" in own and "f32[2,2,40,8]" not in own
        got, got_cache = jax.jit(step)(params, tokens, fresh)
        # the same empty slots read whole: the path of a written cache's prompt (a written online cache keeps its
        # grid, so it is given the one this prompt set)
        every_slot = dataclasses.replace(fresh, written=True, k_scale=got_cache.k_scale, k_lo=got_cache.k_lo,
                                         k_hi=got_cache.k_hi)
        want, want_cache = jax.jit(step)(params, tokens, every_slot)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(got_cache.k), jax.tree.leaves(want_cache.k)):  # layer 0: the same inputs
        np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_a_prompt_into_an_unwritten_cache_attends_to_its_own_keys(name):
    """A fresh cache's prompt attends to its T keys, not the max_len slots (XLA's scores are [T, T]): the same
    logits and cache as attending over every slot (the path of a written cache), then the same decode step."""
    config = CONFIGS[name]
    params = jax.tree.map(lambda a: a * 10, init_params(config, jax.random.key(1)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 6)))
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    fresh = init_cache(config, 2, 40)
    assert not fresh.written
    every_slot = dataclasses.replace(fresh, written=True)  # the same empty slots, read whole
    with native.disabled():  # XLA's attention: its score shapes show which keys were read
        own = jax.make_jaxpr(lambda p, t, c: forward_step(config, p, t, mask, c))(params, tokens[:, :5], fresh)
        scores = set(re.findall(r"f32\[2,2,2,5,(\d+)\]", str(own)))  # [B, KV, G, T, keys]
        assert "5" in scores and "40" not in scores, scores
        runs = [jax.jit(lambda p, t, c: forward_step(config, p, t, mask, c))(params, tokens[:, :5], c)
                for c in (fresh, every_slot)]
    (got, got_cache), (want, want_cache) = runs
    assert got_cache.written and want_cache.written
    real = np.asarray(mask, bool)  # a left-padding position sees no key: its output is noise on either path
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)
    real_slots = np.asarray(got_cache.valid)[None, :, None, :, None]  # the padding slots' keys are masked out
    np.testing.assert_allclose(np.where(real_slots, got_cache.k, 0), np.where(real_slots, want_cache.k, 0),
                               rtol=1e-5, atol=1e-5)
    step = [forward_step(config, params, tokens[:, 5:], jnp.ones((2, 1), jnp.int32), c)[0]
            for c in (got_cache, want_cache)]
    np.testing.assert_allclose(step[0], step[1], rtol=1e-5, atol=1e-5)


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
    # The model is causal: position i of one forward over all 10 tokens is the forward over the first i + 1.
    full = forward(config, params, tokens, jnp.concatenate([mask, jnp.ones((2, 5), jnp.int32)], axis=1))
    np.testing.assert_allclose(logits[mask == 1], full[:, :5][mask == 1], atol=1e-4)
    for i in range(5, 10):
        logits, cache = step(config, params, tokens[:, i : i + 1], jnp.ones((2, 1), jnp.int32), cache)
        np.testing.assert_allclose(logits[:, 0], full[:, i], atol=2e-4)  # a GPU sums in another order
    assert int(cache.length) == 10


# --------------------------------------------------------------------------- quantized cache (stories260K)

from llmeq_jax import calibrate, evaluate  # noqa: E402
from llmeq_jax.generate import generate  # noqa: E402
from llmeq_jax.models import apply_block, embed, load_model  # noqa: E402
from llmeq_jax.core.rope import apply_rope, rope_inv_freq  # noqa: E402
from llmeq_jax.kv.attention import dot_product_attention  # noqa: E402
from llmeq_jax.models.layers import attention_mask  # noqa: E402
from tests.shared_data import shared_data_path  # noqa: E402


@pytest.fixture(scope="module")
def stories():
    config, params, tokenizer = load_model(str(shared_data_path("stories260K.gguf")))
    text = shared_data_path("wikitext2_valid.txt").read_text()[:60000]
    ids = evaluate.tokenize_text(tokenizer, text)
    windows = evaluate.make_windows(ids, 64, 12)
    return config, params, tokenizer, windows[:8], windows[8:]  # calibration, evaluation: disjoint


def _quantizer(stories, spec):
    config, params, _, calib, _ = stories
    return calibrate.make_kv_quantizer(spec, config, params, calib)


@pytest.mark.parametrize(
    "spec",
    [
        kvspec.KVSpec(bits=4, key_granularity="channel", pre_rope=True, window=8, outlier_frac=0.1),
        kvspec.KVSpec(bits=2, key_granularity="token", pre_rope=False, window=0),
        kvspec.KVSpec(bits=8, key_granularity="channel", pre_rope=False, window=3),
        kvspec.KVSpec(bits=4, key_range="online", prompt_tokens=12, window=4),
    ],
    ids=["int4-ch-preRoPE-w8-out", "int2-tok-w0", "int8-ch-postRoPE-w3", "int4-online-w4"],
)
def test_quantized_decode_equals_prefill_path(stories, spec):
    """Token-by-token decode (after a 12-token prompt chunk) sees exactly what forward(kv=...) sees."""
    config, params, _, _, evals = stories
    kv = _quantizer(stories, spec)
    tokens = jnp.asarray(evals[:2, :40])
    prefill_path = jax.jit(lambda t: _forward(config, params, t, kv=kv))(tokens)
    step = jax.jit(forward_step, static_argnums=0)
    cache = init_cache(config, 2, 40, kv=kv)
    logits, cache = step(config, params, tokens[:, :12], jnp.ones((2, 12), jnp.int32), cache)
    outs = [logits]
    for i in range(12, 40):
        logits, cache = step(config, params, tokens[:, i : i + 1], jnp.ones((2, 1), jnp.int32), cache)
        outs.append(logits)
    decoded = jnp.concatenate(outs, axis=1)
    np.testing.assert_array_equal(np.argmax(decoded, -1), np.argmax(prefill_path, -1))
    # Codes can flip where a value sits on a rounding boundary (ulp-level differences between
    # the chunked and the full matmuls, which differ from CPU to CPU), so logits agree closely, not
    # bit for bit: one flipped int8 key code moves later logits by up to ~1e-2 on this model, one
    # flipped int2 code (a step 40x coarser) up to ~3e-2 at a few positions (seen on an AMD EPYC).
    # A wrong scale, slot or mask moves them by O(1) everywhere.
    diff = np.abs(np.asarray(decoded) - np.asarray(prefill_path))
    assert diff.max() < 0.1 and np.mean(diff > 1.5e-2) < 1e-3, (diff.max(), np.mean(diff > 1.5e-2))
    # ... and the quantization really changed something (else the test would prove nothing).
    float_logits = forward(config, params, tokens)
    assert float(jnp.max(jnp.abs(float_logits - prefill_path))) > 1e-2


def test_online_key_ranges_come_from_the_prompt_and_ema_carries_them(stories):
    config, params, _, _, evals = stories
    # A float window over the whole context: attention reads float K/V, so every layer's keys are
    # the float model's (collect_keys) while the store is still quantized on the online grid.
    spec = kvspec.KVSpec(bits=4, key_range="online", prompt_tokens=10, window=16)
    kv = calibrate.make_kv_quantizer(spec)
    assert kv.key_ranges is None  # no calibration pass
    tokens = jnp.asarray(evals[:2, :16])
    mask = jnp.asarray([[0, 0] + [1] * 8, [1] * 10])  # row 0 left-padded: padding keys must not count
    step = jax.jit(forward_step, static_argnums=0)
    cache = init_cache(config, 2, 16, kv=kv)
    _, cache = step(config, params, tokens[:, :10], mask, cache)
    # Each row's range is its own prompt's pre-RoPE key range, per layer, head and channel
    # (the sink tokens included, unlike calibrated ranges).
    assert spec.sink_tokens == 4
    for row, start in ((0, 2), (1, 0)):
        keys = calibrate.collect_keys(config, params, np.asarray(tokens[row:row + 1, start:10]), pre_rope=True)
        np.testing.assert_allclose(cache.k_lo[:, row], jnp.min(keys[:, 0], axis=2), atol=1e-5)
        np.testing.assert_allclose(cache.k_hi[:, row], jnp.max(keys[:, 0], axis=2), atol=1e-5)
    assert float(jnp.max(jnp.abs(cache.k_hi[:, 0] - cache.k_hi[:, 1]))) > 1e-3
    # Decoding does not move the grid (codes already stored keep theirs).
    lo, hi = cache.k_lo, cache.k_hi
    _, cache = step(config, params, tokens[:, 10:11], jnp.ones((2, 1), jnp.int32), cache)
    np.testing.assert_array_equal(cache.k_lo, lo)
    np.testing.assert_array_equal(cache.k_hi, hi)
    # Runtime adaptation: the running range (mean over rows) blends into the next request's.
    running = kvcache.track_key_ranges(kv, cache)
    np.testing.assert_allclose(running.key_ranges.hi, jnp.mean(hi, axis=1), rtol=1e-6)
    ema = kvspec.KVQuantizer(running.key_ranges, dataclasses.replace(spec, ema=0.75))
    other = jnp.asarray(evals[2:3, :10])
    c2 = step(config, params, other, jnp.ones((1, 10), jnp.int32), init_cache(config, 1, 16, kv=ema))[1]
    obs = jnp.max(calibrate.collect_keys(config, params, np.asarray(other), pre_rope=True)[:, 0], axis=2)
    np.testing.assert_allclose(c2.k_hi[:, 0], 0.75 * running.key_ranges.hi + 0.25 * obs, atol=1e-5)
    # generate(..., return_cache=True) hands back the cache to track from.
    new, gen_cache = generate(config, params, tokens[:1, :10], 7, kv=ema, return_cache=True)
    assert new.shape == (1, 7) and int(gen_cache.length) == 16
    assert kvcache.track_key_ranges(ema, gen_cache).key_ranges.hi.shape == running.key_ranges.hi.shape
    with pytest.raises(kvspec.KVSpecError, match="for key_range='online'"):
        # a static-range quantizer (the ranges need no calibration pass to show the refusal)
        kvcache.track_key_ranges(kvspec.KVQuantizer(running.key_ranges, kvspec.KVSpec(bits=4)), cache)


def test_a_written_online_cache_leaves_its_key_grid_alone_in_the_trace():
    # After the first step (advance) the grid is fixed: a step's trace hands the grid arrays through untouched
    # (no range computed and discarded), where an unwritten cache's first step computes them.
    spec = kvspec.KVSpec(bits=8, key_range="online", prompt_tokens=4)
    cache = kvcache.init_quantized(2, 1, 2, 8, 16, kvspec.KVQuantizer(None, spec), inv_freq=np.ones(8, np.float32))
    assert not cache.written
    keys = jax.random.normal(jax.random.key(0), (1, 2, 1, 16))

    def grid_after_update(c):
        c = kvcache.update(c, 1, keys, keys, k_raw=keys)
        return c.k_scale, c.k_lo, c.k_hi

    def passed_through(c):
        jaxpr = jax.make_jaxpr(grid_after_update)(c).jaxpr
        flat = jax.tree_util.tree_leaves_with_path(c)
        ins = {id(v): jax.tree_util.keystr(p) for (p, _), v in zip(flat, jaxpr.invars)}
        return [ins.get(id(v)) for v in jaxpr.outvars]

    assert passed_through(cache) == [None, None, None]
    written = kvcache.advance(cache, jnp.ones((1, 1), jnp.int32))
    assert written.written and int(written.length) == 1
    assert passed_through(written) == [".k_scale", ".k_lo", ".k_hi"]


def test_sink_tokens_are_read_in_float_and_decode_equals_prefill(stories):
    """The first N real tokens of each row (left padding does not count) are attended exactly."""
    config, params, _, _, evals = stories
    spec = kvspec.KVSpec(bits=2, sink_tokens=3)
    kv = _quantizer(stories, spec)
    tokens = jnp.asarray(evals[:2, :24])
    mask = jnp.asarray([[0, 0, 0] + [1] * 21, [1] * 24])
    step = jax.jit(forward_step, static_argnums=0)
    cache = init_cache(config, 2, 24, kv=kv)
    logits, cache = step(config, params, tokens[:, :8], mask[:, :8], cache)
    outs = [logits]
    for i in range(8, 24):
        logits, cache = step(config, params, tokens[:, i:i + 1], mask[:, i:i + 1], cache)
        outs.append(logits)
    np.testing.assert_array_equal(cache.sink_slot, [[3, 4, 5], [0, 1, 2]])
    # The sink store holds the float model's keys (post-RoPE) and values of those slots.
    ref = init_cache(config, 2, 24)
    _, ref = step(config, params, tokens, mask, ref)
    for row, first in ((0, 3), (1, 0)):
        np.testing.assert_allclose(cache.k_sink[:, row], ref.k[:, row, :, first:first + 3], atol=1e-5)
        np.testing.assert_allclose(cache.v_sink[:, row], ref.v[:, row, :, first:first + 3], atol=1e-5)
    # Decoding step by step sees what the full-sequence prefill path sees (row 1: no padding).
    prefill = jax.jit(lambda t: _forward(config, params, t, kv=kv))(tokens[1:])
    decoded = jnp.concatenate(outs, axis=1)[1:]
    np.testing.assert_allclose(decoded, prefill, atol=5e-3)
    # ... and keeping the sinks in float changes the int2 result (they were quantized before).
    no_sink = _quantizer(stories, dataclasses.replace(spec, sink_tokens=0))
    other = jax.jit(lambda t: _forward(config, params, t, kv=no_sink))(tokens[1:])
    assert float(jnp.max(jnp.abs(other - prefill))) > 1e-2


@pytest.mark.parametrize(
    "spec,t",
    [(kvspec.KVSpec(bits=2, window=32), 32), (kvspec.KVSpec(bits=2, sink_tokens=16), 12)],
    ids=["window-as-long-as-context", "more-sinks-than-context"],
)
def test_float_parts_covering_the_context_equal_float(stories, spec, t):
    """Every key/value read in float (from the window, or all sinks): the float model exactly."""
    config, params, _, _, evals = stories
    kv = _quantizer(stories, spec)
    tokens = jnp.asarray(evals[:2, :t])
    np.testing.assert_allclose(jax.jit(lambda x: _forward(config, params, x, kv=kv))(tokens),
                               forward(config, params, tokens), atol=1e-4)


def test_int8_greedy_text_equals_float(stories):
    config, params, tokenizer, _, _ = stories
    prompt = jnp.asarray([tokenizer.encode("Once upon a time")])
    float_new = np.asarray(generate(config, params, prompt, 40))
    # Static key ranges calibrated in the model's domain (WikiText keys are out of domain for a
    # TinyStories model): its own stories from other one-word prompts, not the test prompt.
    starts = [tokenizer.encode(w)[-1] for w in ("One", "Tom", "The", "Sue")]
    seeds = jnp.asarray([[config.bos_token_id, s] for s in starts])
    calib = np.concatenate([np.asarray(seeds), np.asarray(generate(config, params, seeds, 62))], axis=1)
    kv = calibrate.make_kv_quantizer(kvspec.spec_from("int8"), config, params, calib)
    int8_new = np.asarray(generate(config, params, prompt, 40, kv=kv))
    assert tokenizer.decode(int8_new[0]) == tokenizer.decode(float_new[0])
    np.testing.assert_array_equal(int8_new, float_new)


def _layer_qkv(config, params, tokens):
    """Real queries/keys/values of every layer (post-RoPE, [B, T, H, D] / [B, KV, T, D]) of stories260K."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    h = embed(config, params, tokens, positions)
    out = []
    for i in range(config.num_layers):
        p = params[f"layers_{i}"]
        x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + config.norm_eps) * p["input_norm"]["scale"]
        proj = lambda name, heads: (x @ p["attn"][name]["kernel"]).reshape(b, t, heads, config.head_dim)
        q = apply_rope(proj("q_proj", config.num_heads), positions, inv)
        k = apply_rope(proj("k_proj", config.num_kv_heads), positions, inv).transpose(0, 2, 1, 3)
        v = proj("v_proj", config.num_kv_heads).transpose(0, 2, 1, 3)
        out.append((q, k, v))
        h = apply_block(config, p, h, positions, layer=i)
    return out


def test_per_channel_keys_beat_per_token_keys_on_real_attention(stories):
    """KVQuant's reason for per-channel keys: lower attention-output error on real activations (int4)."""
    config, params, _, calib, evals = stories
    keys = calibrate.collect_keys(config, params, calib, pre_rope=False)
    ranges = kvgrid.key_ranges_from_keys(keys)
    tokens = jnp.asarray(evals[:2])
    mask = attention_mask(jnp.arange(tokens.shape[1]), jnp.ones(tokens.shape, bool))
    err_ch = err_tok = 0.0
    for i, (q, k, v) in enumerate(_layer_qkv(config, params, tokens)):
        # The manual q/k/v must be the model's: the float cache holds the same keys.
        ref = dot_product_attention(q, k, v, mask)
        k_ch = kvgrid.quantize_dequantize_keys_per_channel(
            k, ranges.lo[i][None, :, None], ranges.hi[i][None, :, None], 4)
        k_tok = kvgrid.quantize_dequantize_values(k, 4)  # per-token grid, as values get
        err_ch += float(jnp.sum((dot_product_attention(q, k_ch, v, mask) - ref) ** 2))
        err_tok += float(jnp.sum((dot_product_attention(q, k_tok, v, mask) - ref) ** 2))
    assert err_ch < 0.8 * err_tok, (err_ch, err_tok)


@pytest.mark.parametrize("layers, heads, bits, kept", [(30, 3, 8, True), (30, 3, 4, True), (10, 3, 4, False),
                                                       (5, 4, 8, False)])
def test_cos_sin_tables_are_kept_where_they_are_cheap(layers, heads, bits, kept):
    # Where the native kernel reads a pre-RoPE store, each slot's cos/sin (4 x D bytes per token) is kept
    # when that adds at most 5 % to the codes' bytes: SmolLM2's 30 layers of 3 heads at int8/int4, not 10
    # layers at int4 (+13 %) or 5 layers of 4 heads at int8 (+10 %).
    d = 64
    ranges = kvspec.KeyRanges(-jnp.ones((layers, heads, d)), jnp.ones((layers, heads, d)))
    kv = kvspec.KVQuantizer(ranges, kvspec.KVSpec(bits=bits, pre_rope=True))
    make = lambda: kvcache.init_quantized(layers, 2, heads, 16, d, kv, inv_freq=rope_inv_freq(d, 1e4, None))
    cache = make()
    assert (cache.rope_cos is not None) == kept and (cache.rope_sin is not None) == kept
    with native.disabled():  # no native kernel: no tables
        assert make().rope_cos is None
        without = kvmemory.memory(make())["bytes_per_token"]
    assert kvmemory.memory(cache)["bytes_per_token"] - without == (4 * d if kept else 0)


def test_manual_keys_match_the_cache(stories):
    config, params, _, _, evals = stories
    tokens = jnp.asarray(evals[:1, :16])
    cache = init_cache(config, 1, 16)
    _, cache = forward_step(config, params, tokens, jnp.ones((1, 16), jnp.int32), cache)
    for i, (_, k, v) in enumerate(_layer_qkv(config, params, tokens)):
        np.testing.assert_allclose(cache.k[i], k, atol=1e-4)
        np.testing.assert_allclose(cache.v[i], v, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_bytes_per_token_from_packed_arrays(stories, bits):
    config = stories[0]
    kv = _quantizer(stories, kvspec.KVSpec(bits=bits))
    mem = kvmemory.memory(init_cache(config, 2, 24, kv=kv))
    heads = config.num_layers * config.num_kv_heads
    # keys: bits/8 bytes per element; values: the same + float16 scale and min per token and head;
    # bookkeeping: the valid flag (1 byte) and the slot's position id (int32, for pre-RoPE keys). No cos/sin
    # tables: for 5 layers of 4 heads they would add 10 % or more to the codes.
    assert mem["bytes_per_token"] == heads * (2 * config.head_dim * bits // 8 + 2 * 2) + 1 + 4
    float_mem = kvmemory.memory(init_cache(config, 2, 24))
    assert float_mem["bytes_per_token"] == heads * 2 * config.head_dim * 4 + 1
    assert kvmemory.longest_context(mem["bytes_per_token"], mem["fixed_bytes"], 2**20) > 2**20 // float_mem[
        "bytes_per_token"]


def test_window_longer_than_context_is_an_error(stories):
    config, params, _, _, evals = stories
    kv = kvspec.KVQuantizer(None, kvspec.KVSpec(bits=4, key_granularity="token", window=64))
    with pytest.raises(kvspec.KVSpecError, match=r"float window \(64 tokens\) is longer than the context \(16"):
        _forward(config, params, jnp.asarray(evals[:1, :16]), kv=kv)


def test_key_ranges_of_another_model_are_an_error(stories):
    config = stories[0]
    wrong = kvspec.KeyRanges(jnp.zeros((5, 3, 8)), jnp.ones((5, 3, 8)))  # 3 KV heads; stories260K has 4
    with pytest.raises(kvspec.KVSpecError, match=r"the model needs \[layers, kv_heads, head_dim\] = \[5, 4, 8\]"):
        init_cache(config, 1, 8, kv=kvspec.KVQuantizer(wrong, kvspec.KVSpec(bits=4)))
