"""The quantized cache read by the Pallas decode kernel (interpret mode here) equals the XLA path."""

from __future__ import annotations

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate, native
from llmeq_jax.kv import attention as kvattention
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params
from pallas_kernels import config as kernel_config

# head_dim 64: pre-RoPE int4 keys need 16-wide dots on each quarter of the head dim.
LLAMA = ModelConfig("llama", 64, 128, 2, 4, 2, 64, 96, 1e-5, 64, False)
MISTRAL = ModelConfig("mistral", 64, 128, 2, 4, 2, 64, 96, 1e-5, 64, True, sliding_window=5)
PROMPT_MASK = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 left-padded


def _model(config):
    params = init_params(config, jax.random.key(0))
    return jax.tree.map(lambda a: a * 4, params)  # sharper attention than the 0.02 init, but not one-hot


def _same_codes_model(config):
    """``_model`` with layer 0's attention output projection zeroed, for kernel-vs-XLA comparisons.

    The kernel and XLA read the store with float sums in different orders, so layer 0's
    attention output differs in its last bits between the two paths; layer 1 then quantizes
    slightly different K/V and one code can flip on a rounding boundary, which moves the logits
    by a whole quantization step (seen: one int8 value code, 5e-3 on the logits, on some
    machines only). With that output zeroed (0 * x is exactly 0 on both paths), every layer
    quantizes bit-identical inputs, so the paths store identical codes and only the reads
    differ -- by summation order, which a tight tolerance covers on any machine. Layer 1,
    whose store the logits still depend on, keeps the multi-layer indexing under test.
    """
    params = _model(config)
    o_proj = params["layers_0"]["attn"]["o_proj"]
    return {**params, "layers_0": {**params["layers_0"], "attn": {**params["layers_0"]["attn"],
                                                                   "o_proj": jax.tree.map(jnp.zeros_like, o_proj)}}}


def _step_jaxpr(config, params, kv, tokens) -> str:
    """A decode step traced under the current switches, as text (nothing compiled)."""
    cache = init_cache(config, 2, tokens.shape[1], kv=kv)
    step = lambda p, t, m, c: forward_step(config, p, t, m, c)  # noqa: E731  (traced under this context)
    return str(jax.make_jaxpr(step)(params, tokens[:, 6:7], jnp.ones((2, 1), jnp.int32), cache))


def _step_uses_pallas(config, params, kv, tokens) -> bool:
    """Whether a decode step traced under the current switches calls a Pallas kernel."""
    return "pallas_call" in _step_jaxpr(config, params, kv, tokens)


def _decode(config, params, kv, tokens):
    """Logits of a 6-token prompt then one token per step, whether a Pallas kernel ran, the last cache."""
    step = lambda p, t, m, c: forward_step(config, p, t, m, c)  # a fresh function: traced under this context
    cache = init_cache(config, 2, tokens.shape[1], kv=kv)
    logits, cache = jax.jit(step)(params, tokens[:, :6], jnp.asarray(PROMPT_MASK), cache)
    outs, one = [logits[:, -1:]], jnp.ones((2, 1), jnp.int32)
    decode = jax.jit(step)
    for i in range(6, tokens.shape[1]):
        logits, cache = decode(params, tokens[:, i : i + 1], one, cache)
        outs.append(logits)
    return jnp.concatenate(outs, axis=1), _step_uses_pallas(config, params, kv, tokens), cache


CASES = {
    "int4-preRoPE-static": (LLAMA, kvspec.KVSpec(bits=4, sink_tokens=0)),
    "int8-postRoPE-w3-sinks2": (LLAMA, kvspec.KVSpec(bits=8, pre_rope=False, window=3, sink_tokens=2)),
    "int4-online-w4-sinks4": (LLAMA, kvspec.KVSpec(bits=4, key_range="online", prompt_tokens=6, window=4)),
    "int8-preRoPE-sliding5": (MISTRAL, kvspec.KVSpec(bits=8, window=2)),
    "int8-preRoPE-sinks4": (LLAMA, kvspec.KVSpec(bits=8)),  # the default: no window, 4 float sinks
}


@functools.lru_cache(maxsize=None)
def _reference(case):
    """A case's model, tokens and quantizer, with what the kernels are compared against: XLA's decode
    (native kernel off) and the float model's logits. Built once for the tests of a case (one process
    runs this file)."""
    config, spec = CASES[case]
    params = _same_codes_model(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 14)))
    calib = np.random.default_rng(1).integers(0, config.vocab_size, (4, 16))
    kv = calibrate.make_kv_quantizer(spec, config, params, calib)
    with native.disabled():  # the CPU's native kernel otherwise reads the store
        xla_logits, used, xla_cache = _decode(config, params, kv, tokens)
    assert not used  # no GPU here: the XLA path
    float_logits = _decode(config, params, None, tokens)[0]
    return config, params, tokens, kv, (xla_logits, xla_cache), float_logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_through_the_kernel_equals_xla(case):
    config, params, tokens, kv, xla, float_logits = _reference(case)
    with kernel_config.interpret(True):
        kernel, used, kernel_cache = _decode(config, params, kv, tokens)
    assert used, "the decode step did not go through the Pallas kernel"
    with kernel_config.interpret(True):
        # the step's key and value written by the store's own kernel (its codes and grids: XLA's, checked below)
        text = _step_jaxpr(config, params, kv, tokens)
        assert f"name=kv_store_append_int{kv.spec.bits}" in text
        # float sinks without a window: read by the kernel in its softmax, nothing merged after it
        assert ("logaddexp" in text) == bool(kv.spec.window), "the float parts' merge"
    with kernel_config.interpret(True), kernel_config.disabled():
        assert not _step_uses_pallas(config, params, kv, tokens)  # the off switch (CLI --xla) holds
    _assert_same_decode((kernel, kernel_cache), xla, float_logits)


def test_a_short_prompts_sinks_are_written_by_the_decode_steps_kernel(monkeypatch):
    """Row 0's prompt has 2 real tokens: its decode steps write sink tokens 2 and 3 -- through the store's write kernel
    (the float copies, keys after RoPE) -- and the sink stores, codes and logits equal XLA's path."""
    monkeypatch.setitem(globals(), "PROMPT_MASK", np.array([[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]]))
    config, spec = CASES["int8-preRoPE-sinks4"]
    params = _same_codes_model(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 10)))
    kv = calibrate.make_kv_quantizer(spec, config, params, np.random.default_rng(1).integers(0, config.vocab_size,
                                                                                             (4, 16)))
    with native.disabled():
        xla_logits, _, xla_cache = _decode(config, params, kv, tokens)
    with kernel_config.interpret(True):
        assert "name=kv_store_append_int8" in _step_jaxpr(config, params, kv, tokens)
        logits, _, cache = _decode(config, params, kv, tokens)
    assert np.all(np.asarray(xla_cache.sink_slot) >= 0)  # all four of row 0's sinks written, two of them by decode
    for name in ("k_sink", "v_sink"):
        np.testing.assert_array_equal(np.asarray(getattr(cache, name), np.float32),
                                      np.asarray(getattr(xla_cache, name), np.float32), err_msg=name)
    np.testing.assert_array_equal(cache.k.q, xla_cache.k.q)
    np.testing.assert_allclose(logits, xla_logits, atol=5e-5 * float(jnp.max(jnp.abs(xla_logits))))


def _assert_same_decode(ours, xla, float_logits):
    """Two paths' ``(logits, cache)`` of :func:`_decode` agree; returns the tolerance used."""
    (logits, cache), (xla_logits, xla_cache) = ours, xla
    # The premise of the tolerance below: both paths stored the same codes (see _same_codes_model).
    for name in ("k", "v"):
        np.testing.assert_array_equal(getattr(cache, name).q, getattr(xla_cache, name).q,
                                      err_msg=f"{name} codes differ: the paths quantized different inputs")
    for grid in ("scale", "lo"):  # the values' per-token grids, bit for bit (the native write makes its own)
        np.testing.assert_array_equal(np.asarray(getattr(cache.v, grid)).view(np.uint16),
                                      np.asarray(getattr(xla_cache.v, grid)).view(np.uint16))
    # Seen here: within 5.4e-6 of the logits' scale (float32 sums in another order); a wrong
    # rotation or log-sum-exp moves them by more than 1e-2 of it.
    tol = 5e-5 * float(jnp.max(jnp.abs(xla_logits)))
    np.testing.assert_allclose(logits, xla_logits, atol=tol)
    # The comparison means something: this cache moves the logits away from the float model's.
    assert float(jnp.max(jnp.abs(float_logits - xla_logits))) > 100 * tol
    return tol


@pytest.mark.parametrize("case, tables", [(c, "computed") for c in sorted(CASES)] +
                         [(c, "kept") for c in sorted(CASES) if CASES[c][1].pre_rope])
def test_decode_through_the_native_kernel_equals_xla(case, tables, monkeypatch):
    """On a CPU the native kernel (native.kv_store_attention) reads the store in place -- int8/int4,
    pre- and post-RoPE keys, static and online grids, windows, sinks, a sliding window, left padding --
    and the logits equal XLA's dequantize-then-attend path's. Pre-RoPE keys rotate with cos/sin computed
    every step, or with the tables kept with the slots (models where they are cheap: forced here, this
    2-layer model's would add 50-100 % to its codes)."""
    config, params, tokens, kv, xla, float_logits = _reference(case)  # XLA's path keeps no tables either way
    if tables == "kept":
        monkeypatch.setattr(kvcache, "TABLE_SHARE_MAX", 1.0)
    spec = CASES[case][1]
    assert kvcache.store_path(spec, config.head_dim, jnp.float32, 4, 14) == "native"
    with native.disabled():
        assert kvcache.store_path(spec, config.head_dim, jnp.float32, 4, 14) != "native"
    ours, _, our_cache = _decode(config, params, kv, tokens)
    assert (our_cache.rope_cos is not None) == (tables == "kept")
    cache = init_cache(config, 2, 14, kv=kv)
    step = lambda p, t, m, c: forward_step(config, p, t, m, c)  # noqa: E731
    hlo = jax.jit(step).lower(params, tokens[:, :1], jnp.ones((2, 1), jnp.int32), cache).as_text()
    assert hlo.count("llmeq_kv_store_attention") >= config.num_layers
    assert hlo.count("llmeq_kv_store_append") >= config.num_layers  # the codes and grids written by one call
    if spec.sink_tokens and not spec.window:  # the kernel read the sinks too: no merge of two softmaxes after it
        assert "log_plus_one" not in hlo
    tol = _assert_same_decode((ours, our_cache), xla, float_logits)
    if case == "int4-preRoPE-static":  # the scan over stacked blocks: the layer index traced
        from llmeq_jax.models import stacked

        scanned, _, _ = _decode(config, stacked.stack_blocks(config, params), kv, tokens)
        np.testing.assert_allclose(scanned, xla[0], atol=tol)


@pytest.mark.parametrize(
    "spec, why",
    [
        (kvspec.KVSpec(bits=4, outlier_frac=0.02), "outliers"),
        (kvspec.KVSpec(bits=4, key_granularity="token"), "per-token keys"),
        (kvspec.KVSpec(bits=2), "int2"),
    ],
)
def test_settings_the_kernel_cannot_read_fall_back_to_xla(spec, why):
    ok, reason = kvcache.kernel_reads_store(spec, 64, jnp.float32)
    assert not ok and why in reason
    assert kvcache.kernel_reads_store(kvspec.KVSpec(bits=4), 64, jnp.float32) == (True, "")
    assert not kvcache.kernel_reads_store(kvspec.KVSpec(bits=4), 32, jnp.float32)[0]  # pre-RoPE int4: 16-wide quarters
    assert kvcache.kernel_reads_store(kvspec.KVSpec(bits=4, pre_rope=False), 32, jnp.float32)[0]


def test_merge_attention_equals_one_softmax_over_both_parts():
    split = jax.jit(kvattention.split_attention, static_argnames="with_lse")  # compiled: faster than op by op
    merge = jax.jit(kvattention.merge_attention)
    rng = np.random.default_rng(0)  # numpy draws: each eager jax.random call compiles a program
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 8)), jnp.float32)

    def part(s):
        mask = rng.random((2, 1, s)) < 0.8
        mask[:, :, 0] = True
        return (jnp.asarray(rng.normal(size=(2, 2, s, 8)) * 2, jnp.float32),
                jnp.asarray(rng.normal(size=(2, 2, s, 8)), jnp.float32), jnp.asarray(mask))

    a, b = part(5), part(7)
    want, want_lse = split(q, [a, b], with_lse=True)
    got, lse = merge(split(q, [a], with_lse=True), split(q, [b], with_lse=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    # An empty part (everything masked) weighs nothing.
    empty = (a[0], a[1], jnp.zeros_like(a[2]))
    got, _ = merge(split(q, [empty], with_lse=True), split(q, [b], with_lse=True))
    np.testing.assert_allclose(got, split(q, [b]), rtol=1e-5, atol=1e-6)


def test_generate_compiles_once_per_kernel_switch_state():
    """generate's jitted loop is keyed by the kernel switches: the off switch is not defeated by
    a loop compiled earlier with kernels on, and greedy text through the kernel equals XLA's."""
    from llmeq_jax import generate as gen

    config, params, _, kv, _, _ = _reference("int4-preRoPE-static")  # greedy tokens equal only if no code flips
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (2, 5)))
    before = gen._decode_loop._cache_size()
    with kernel_config.interpret(True):
        with_kernel = gen.generate(config, params, prompt, 6, kv=kv)
        with kernel_config.disabled():
            without = gen.generate(config, params, prompt, 6, kv=kv)
    assert gen._decode_loop._cache_size() == before + 2
    np.testing.assert_array_equal(with_kernel, without)


def _store_slices(config, params, cache, token) -> int:
    """Slices of a layer's int8 code store ([B, KV, S, D], with or without the layer axis) in a traced step."""
    one = jnp.ones((token.shape[0], 1), jnp.int32)
    text = str(jax.make_jaxpr(lambda p, t, c: forward_step(config, p, t, one, c))(params, token, cache))
    store = ",".join(map(str, cache.k.q.shape[1:]))
    return sum(1 for line in text.splitlines()
               if re.search(r"= (dynamic_)?slice", line) and re.search(rf":i8\[(1,)?{store}\]", line.split(" = ")[0]))


def test_stacked_decode_reads_each_layers_store_in_place():
    """Inside the scan over stacked blocks the layer index is traced: the kernel is handed every layer's store
    and the index (slicing the layer out would copy its whole store for the custom call every step), with
    the unrolled model's logits. The XLA path (kernels off) does slice it, which is what the count detects."""
    from llmeq_jax.models import stacked

    config, params, tokens, kv, _, _ = _reference("int8-postRoPE-w3-sinks2")
    tokens = tokens[:, :10]
    scanned_params = stacked.stack_blocks(config, params)
    with kernel_config.interpret(True):
        unrolled, _, _ = _decode(config, params, kv, tokens)
        scanned, used, cache = _decode(config, scanned_params, kv, tokens)
        assert used
        assert _store_slices(config, scanned_params, cache, tokens[:, -1:]) == 0
        assert _store_slices(config, params, cache, tokens[:, -1:]) == 0
        with kernel_config.disabled():
            assert _store_slices(config, scanned_params, cache, tokens[:, -1:]) > 0
    np.testing.assert_allclose(scanned, unrolled, atol=5e-5 * float(jnp.max(jnp.abs(unrolled))))


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_through_xlas_dots_over_the_codes_equals_dequantizing(bits, monkeypatch):
    """Where the dispatch table measured XLA's dots over the codes (kv.store_attention) faster than the kernel,
    a decode step's store is read by them: the same logits as dequantizing the layer, on the stacked model too."""
    from llmeq_jax import dispatch_table
    from llmeq_jax.models import stacked

    config, spec = LLAMA, kvspec.KVSpec(bits=bits, pre_rope=False, window=3, sink_tokens=2)
    params = _same_codes_model(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 12)))
    kv = calibrate.make_kv_quantizer(spec, config, params, np.random.default_rng(1).integers(0, config.vocab_size, (4, 16)))
    key = dispatch_table.Key(jax.devices()[0].device_kind, "kv_attention", bits, None, config.head_dim,
                             dispatch_table.row_bucket(tokens.shape[1]), 2 * config.num_heads // config.num_kv_heads,
                             "float32")
    table = dispatch_table.from_json(dispatch_table.to_json(key.device, [(key, {"pallas_s": 2.0, "xla_s": 1.0,
                                                                                "bf16_s": 1.0})]))
    calls = []
    real = kvcache.store_attention
    monkeypatch.setattr(kvcache, "store_attention", lambda *a, **kw: calls.append(kw["layer"]) or real(*a, **kw))
    monkeypatch.setattr(kvcache, "native_reads_store", lambda *a: False)  # the CPU's kernel: its own test
    dequantized, _, _ = _decode(config, params, kv, tokens)
    assert not calls
    tol = 5e-5 * float(jnp.max(jnp.abs(dequantized)))
    with dispatch_table.use(table):
        dots, used_kernel, _ = _decode(config, params, kv, tokens)
        assert calls and not used_kernel
        np.testing.assert_allclose(dots, dequantized, atol=tol)
        if bits == 4:
            return  # the scan and the float model's distance: int8's case checks them
        scanned, _, _ = _decode(config, stacked.stack_blocks(config, params), kv, tokens)
    np.testing.assert_allclose(scanned, dequantized, atol=tol)
    float_logits = _decode(config, params, None, tokens)[0]
    assert float(jnp.max(jnp.abs(float_logits - dequantized))) > 100 * tol


def _loop_body_masks(jaxpr, shape) -> int:
    """Equations inside a loop (scan, while) of ``jaxpr`` that write a bool array of ``shape``."""
    def walk(jx, in_loop):
        n = 0
        for eqn in jx.eqns:
            if in_loop and any(getattr(v.aval, "shape", None) == shape and v.aval.dtype == jnp.bool_
                               for v in eqn.outvars):
                n += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += walk(sub, in_loop or eqn.primitive.name in ("scan", "while"))
        return n
    return walk(jaxpr.jaxpr, False)


def test_a_stacked_decode_step_plans_its_masks_once_for_all_layers(monkeypatch):
    """A decode step over stacked blocks derives the quantized store's mask, the sinks seen and the scan length
    once, before the loop over the layers (``kv.cache.with_step_plan``): derived in each layer, XLA evaluated them
    in every iteration (four launches a layer on a GPU). The loop's body then writes no [B, 1, S] mask (without
    the plan it does), and the logits are the unrolled model's."""
    from llmeq_jax.models import model, stacked

    config, params, tokens, kv, _, _ = _reference("int8-preRoPE-sinks4")
    tokens = tokens[:, :9]
    scanned_params = stacked.stack_blocks(config, params)
    cache = init_cache(config, 2, tokens.shape[1], kv=kv)
    shape = (2, 1, tokens.shape[1])

    def body_masks():
        step = lambda p, t, m, c: forward_step(config, p, t, m, c)  # noqa: E731  a fresh function: traced anew
        return _loop_body_masks(jax.make_jaxpr(step)(scanned_params, tokens[:, 6:7], jnp.ones((2, 1), jnp.int32),
                                                     cache), shape)

    with kernel_config.interpret(True):
        unrolled, _, _ = _decode(config, params, kv, tokens)
        scanned, used, _ = _decode(config, scanned_params, kv, tokens)
        assert used and body_masks() == 0
        monkeypatch.setattr(model.kvcache, "with_step_plan", lambda cache, mask: cache)
        assert body_masks() > 0
    np.testing.assert_allclose(scanned, unrolled, atol=5e-5 * float(jnp.max(jnp.abs(unrolled))))
