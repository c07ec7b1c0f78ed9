"""One query token's attention over an int8 / int4 KV store in Mosaic GPU (pallas_kernels.kv_attention_hopper): GPU
interpret mode against XLA's dots over the codes and the dequantizing reference; what it refuses; lowering for CUDA;
the cache's choice of it (kv.cache.store_path)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import dispatch_table
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.kv.store_attention import store_attention
from pallas_kernels import config
from pallas_kernels.kv_attention_hopper import AttentionBlocks, can_use, kv_attention_hopper, splits_for
from pallas_kernels.kv_cache import store_decode_attention_reference
from tests.kv.test_store_attention import _store
from tests.pallas_kernels.weight_only_cases import FAKE_H100


CASES = [  # bits, b, h, g, t, length, masked, layers, dtype, blocks
    (8, 1, 2, 4, 512, [300], True, None, jnp.bfloat16, AttentionBlocks(splits=2)),  # GQA; 2 SMs, 2 items each
    (8, 2, 2, 1, 256, [256, 100], False, None, jnp.float16, None),  # one query head a KV head; two lengths
    (8, 1, 2, 8, 384, [384], True, 3, jnp.bfloat16, AttentionBlocks(splits=3)),  # layer 1 of a stack; 3 splits
    (8, 2, 1, 5, 256, [0, 200], True, None, jnp.bfloat16, AttentionBlocks(splits=1)),  # a row with nothing to read
    (4, 1, 2, 4, 512, [400], True, 2, jnp.bfloat16, AttentionBlocks(stages=3, splits=2)),  # int4, stacked
    (4, 2, 2, 2, 256, [256, 130], False, None, jnp.float16, None),  # int4, two lengths
]


@pytest.mark.parametrize("bits,b,h,g,t,length,masked,layers,dtype,blocks", CASES)
def test_kernel_is_xlas_dots_over_the_codes(bits, b, h, g, t, length, masked, layers, dtype, blocks):
    """The same folded grids and the same bf16 roundings of q s_k and p s_v as XLA's path, but an online softmax
    (p rounded against the running max): the outputs within bf16's rounding, the log-sum-exps within float32 sums;
    the dequantize-and-attend reference within the rounding XLA's path is tested to."""
    kc, vc, ks, kl, vs, vl = _store(bits, b, h, t, d=128, layers=layers, seed=t + g)
    q = (jax.random.normal(jax.random.key(g), (b, h * g, 128)) * 2).astype(dtype)
    allowed = jax.random.bernoulli(jax.random.key(t), 0.8, (b, t)) if masked else None
    layer = None if layers is None else jnp.int32(1)
    length = jnp.asarray(length, jnp.int32)
    got, got_lse = kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, length, bits=bits, allowed=allowed, layer=layer,
                                       blocks=blocks, interpret=True)
    want, want_lse = store_attention(q, kc, vc, ks, kl, vs, vl, length, bits=bits, allowed=allowed, layer=layer)
    assert got.shape == (b, h * g, 128) and got_lse.shape == (b, h * g) and got.dtype == jnp.float32
    seen = np.asarray(want_lse) > -1e29  # rows with a slot to read (the others: lse ~ -1e30, any output)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], atol=4e-3 * scale)
    np.testing.assert_allclose(np.asarray(got_lse)[seen], np.asarray(want_lse)[seen], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(got_lse)[~seen] < -1e29)
    one = (lambda a: a) if layers is None else (lambda a: a[1])  # noqa: E731
    ref, _ = store_decode_attention_reference(q, one(kc), one(vc), ks, kl, one(vs), one(vl), length, bits=bits,
                                              allowed=allowed)
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(ref)[seen], atol=1e-2 * scale)
    if layers is not None:  # not trivially met (checked once a bit width): the value offsets move the output by more
        wrong, _ = kv_attention_hopper(q, kc, vc, ks, kl, vs, jnp.zeros_like(vl), length, bits=bits, allowed=allowed,
                                       layer=layer, blocks=blocks, interpret=True)
        assert np.abs(np.asarray(wrong)[seen] - np.asarray(want)[seen]).max() > 0.1 * scale


ROPE_CASES = [  # bits, b, h, g, t, length, masked, layers, dtype, blocks
    (8, 1, 2, 4, 512, [300], True, None, jnp.bfloat16, AttentionBlocks(splits=2)),  # GQA; 2 items an SM
    (4, 2, 1, 2, 256, [256, 130], False, 2, jnp.float16, None),  # int4, layer 1 of a stack, two lengths
]


@pytest.mark.parametrize("bits,b,h,g,t,length,masked,layers,dtype,blocks", ROPE_CASES)
def test_pre_rope_keys_are_dequantized_and_rotated_by_their_slots_position(bits, b, h, g, t, length, masked, layers,
                                                                           dtype, blocks):
    """Keys stored before RoPE: each dequantized with the per-channel grid and rotated by its slot's position (up to
    a 32K context's angles, slots out of order) in the kernel, then q K^T in bf16 -- the dequantize, rotate and attend
    reference within bf16's rounding of the rotated keys; other positions give another answer."""
    from llmeq_jax.core.rope import rope_inv_freq

    kc, vc, ks, kl, vs, vl = _store(bits, b, h, t, d=128, layers=layers, seed=t + g)
    q = (jax.random.normal(jax.random.key(g), (b, h * g, 128)) * 2).astype(dtype)
    allowed = jax.random.bernoulli(jax.random.key(t), 0.8, (b, t)) if masked else None
    layer = None if layers is None else jnp.int32(1)
    length = jnp.asarray(length, jnp.int32)
    slot_pos = jax.random.randint(jax.random.key(7), (b, t), 0, 32768)
    inv_freq = jnp.asarray(rope_inv_freq(128, 10000.0, None))
    run = lambda pos: kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, length, bits=bits, allowed=allowed,  # noqa: E731
                                          layer=layer, slot_pos=pos, inv_freq=inv_freq, blocks=blocks, interpret=True)
    got, got_lse = run(slot_pos)
    one = (lambda a: a) if layers is None else (lambda a: a[1])  # noqa: E731
    want, want_lse = store_decode_attention_reference(q, one(kc), one(vc), ks, kl, one(vs), one(vl), length, bits=bits,
                                                      allowed=allowed, slot_pos=slot_pos, inv_freq=inv_freq)
    seen = np.asarray(want_lse) > -1e29
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], atol=1e-2 * scale)
    np.testing.assert_allclose(np.asarray(got_lse)[seen], np.asarray(want_lse)[seen], atol=0.05)
    wrong, _ = run(slot_pos + 1)  # every key rotated one position further
    assert np.abs(np.asarray(wrong)[seen] - np.asarray(want)[seen]).max() > 0.05 * scale


def test_a_cache_steps_arguments_every_layers_key_grid_its_mask_and_sinks():
    """What a cache's decode step passes (int4, pre-RoPE keys): every layer's per-row key grid [L, B, H, 1, D] (read
    at the layer in place), the step's one-byte mask and no length, and the float sinks (merged with the kernel's
    splits): the reference over the store and the sinks; a row that sees no sink gets what it gets without them, one
    that sees some does not. (Post-RoPE keys with these arguments: the cache's decode test below.)"""
    from llmeq_jax.core.rope import rope_inv_freq

    bits, b, h, g, t, layers = 4, 2, 2, 4, 256, 2
    kc, vc, _, _, vs, vl = _store(bits, b, h, t, d=128, layers=layers, seed=11)
    keys = jax.random.split(jax.random.key(12), 6)
    ks = jax.random.uniform(keys[0], (layers, b, h, 1, 128), minval=0.01, maxval=0.05)
    kl = jax.random.normal(keys[1], (layers, b, h, 1, 128)) * 0.3
    allowed = jax.random.bernoulli(keys[4], 0.8, (b, t)).astype(jnp.int8)
    q = (jax.random.normal(keys[5], (b, h * g, 128)) * 2).astype(jnp.bfloat16)
    # sinks as attention sinks are: keys near each head's queries (scores as high as the store's highest)
    near = 0.6 * q.astype(jnp.float32).reshape(b, h, g, 128).mean(2)[None, :, :, None]
    sink_k = near + jax.random.normal(keys[2], (layers, b, h, 3, 128)) * 0.3
    sink_v = jax.random.normal(keys[3], (layers, b, h, 3, 128)) * 2
    sinks = (sink_k.astype(jnp.bfloat16), sink_v.astype(jnp.bfloat16),
             jnp.array([[True, False, True], [False, False, False]]))
    rope_args = dict(slot_pos=jax.random.randint(jax.random.key(7), (b, t), 0, 32768),
                     inv_freq=jnp.asarray(rope_inv_freq(128, 10000.0, None)))
    run = lambda sinks: kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, None, bits=bits, allowed=allowed,  # noqa: E731
                                            layer=jnp.int32(1), sinks=sinks, interpret=True, **rope_args)
    got, got_lse = run(sinks)
    want, want_lse = store_decode_attention_reference(q, kc, vc, ks, kl, vs, vl, t, bits=bits, allowed=allowed,
                                                      layer=1, sinks=sinks, **rope_args)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-2 * scale)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=0.05)
    alone, _ = run(None)
    # row 1 sees no sink: the same up to the merge's summation order
    np.testing.assert_allclose(np.asarray(alone[1]), np.asarray(got[1]), rtol=1e-6, atol=1e-6 * scale)
    # row 0 sees two (the sinks' share of its softmax: ~95 % with these draws; ~18 % in an int8 post-RoPE draw)
    assert np.abs(np.asarray(alone[0]) - np.asarray(want[0])).max() > 0.05 * scale


def test_splits_fill_the_sms_and_divide_the_steps():
    assert splits_for(8, 256, 132) == 32  # Llama-3-8B's 8 KV heads at 32K tokens: 256 items on 132 SMs
    assert splits_for(32, 256, 132) == 8  # Llama-2-7B's 32 heads
    assert splits_for(8, 3, 132) == 1  # at least two steps a split
    assert all(256 % splits_for(h, 256, 132) == 0 for h in range(1, 65))


def test_can_use_names_what_the_kernel_does_not_take():
    ok = lambda **kw: can_use(**{**dict(q_shape=(1, 32, 128), q_dtype=jnp.bfloat16,  # noqa: E731
                                        codes_shape=(1, 8, 4096, 128), bits=8), **kw})
    with config.interpret(True):
        assert ok() == (True, "")
        assert ok(bits=4, codes_shape=(1, 8, 4096, 64)) == (True, "")  # int4: D / 2 bytes a slot
        assert "int2" in ok(bits=2)[1]
        assert "head_dim 64" in ok(q_shape=(1, 32, 64), codes_shape=(1, 8, 4096, 64))[1]
        assert "at most 64" in ok(q_shape=(1, 8 * 65, 128))[1]
        assert "multiple of 128" in ok(codes_shape=(1, 8, 4000, 128))[1]
        assert "half queries only" in ok(q_dtype=jnp.float32)[1]
    with config.compiling_for(FAKE_H100):
        assert ok() == (True, "")


def test_bad_input_gets_one_clear_error():
    kc, vc, ks, kl, vs, vl = _store(8, 1, 2, 256, d=128)
    q = jnp.zeros((1, 8, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="int2"):
        kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, 256, bits=2, interpret=True)
    with pytest.raises(ValueError, match="value grids"):
        kv_attention_hopper(q, kc, vc, ks, kl, vs[..., 0], vl, 256, interpret=True)
    with pytest.raises(ValueError, match="3 splits of 2 steps"):
        kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, 256, blocks=AttentionBlocks(splits=3), interpret=True)
    with pytest.raises(ValueError, match="head_dim 256"):  # int8 codes read as int4 bytes: twice the width
        kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, 256, bits=4, interpret=True)
    with pytest.raises(ValueError, match=r"slot_pos \[1, 256\] and inv_freq \[64\] together"):
        kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, 256, slot_pos=jnp.zeros((1, 256), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="without a length, allowed must be the int8"):
        kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, None, allowed=jnp.ones((1, 256), bool), interpret=True)
    with pytest.raises(ValueError, match=r"kv_attention_hopper: sinks must be"):
        kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, 256, sinks=(vs, vs, jnp.ones((1, 2), bool)), interpret=True)
    with pytest.raises(ValueError, match=r"k_scale must be \(1 or 1, 2, 1, 128\)"):
        kv_attention_hopper(q, kc, vc, ks[0], kl[0], vs, vl, 256, interpret=True)
    with pytest.raises(ValueError, match="stages >= 2"):
        AttentionBlocks(stages=1)


@pytest.mark.parametrize("bits,rope", [(8, False), (8, True), (4, True)])
def test_kernel_lowers_for_cuda_to_one_mosaic_gpu_call_and_its_merge(bits, rope):
    """Lowered for a Hopper GPU on this CPU: the codes converted into shared memory (or dequantized and rotated:
    pre-RoPE keys, with a cache step's arguments: every layer's per-row key grid, the one-byte mask, sinks), the row
    reductions of the online softmax, P' V accumulated in place (run_state, which interpret mode does not run)."""
    b, h, g, t, layers = 1, 8, 4, 4096, 2
    codes = jax.ShapeDtypeStruct((layers, b, h, t, 128 * bits // 8), jnp.int8 if bits == 8 else jnp.uint8)
    grid = (layers, b, h, 1, 128) if rope else (1, h, 1, 128)
    args = [jax.ShapeDtypeStruct((b, h * g, 128), jnp.bfloat16), codes, codes,
            *[jax.ShapeDtypeStruct(grid, jnp.float32)] * 2,
            *[jax.ShapeDtypeStruct((layers, b, h, t, 1), jnp.float16)] * 2,
            jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.int8 if rope else jnp.bool_),
            jax.ShapeDtypeStruct((), jnp.int32)]
    sink = jnp.zeros((layers, b, h, 4, 128), jnp.bfloat16)
    rope_args = dict(slot_pos=jnp.zeros((b, t), jnp.int32), inv_freq=jnp.ones((64,), jnp.float32),
                     sinks=(sink, sink, jnp.ones((b, 4), bool))) if rope else {}

    def f(q, kc, vc, ks, kl, vs, vl, length, allowed, layer):
        return kv_attention_hopper(q, kc, vc, ks, kl, vs, vl, None if rope else length, bits=bits, allowed=allowed,
                                   layer=layer, **rope_args)

    with config.compiling_for(FAKE_H100):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # the kernel, and the Triton kernel merging its splits (and the sinks)
    assert text.count("mosaic_gpu") >= 1 and text.count("__gpu$xla.gpu.triton") == 1 and "merge_splits" in text


def test_the_cache_takes_the_kernel_only_where_a_table_measured_it_faster():
    """kv.cache.store_path: "hopper" for an int8 store where the table measured the Mosaic kernel faster than what it
    replaces: post-RoPE keys by kernel kv_attention_hopper (against the faster of the Triton kernel and XLA's dots),
    pre-RoPE keys by kv_attention_hopper_rope (against the Triton kernel), each by its own entry."""
    post, pre = kvspec.KVSpec(bits=8, pre_rope=False), kvspec.KVSpec(bits=8)
    device = config.target_device().device_kind
    key = dispatch_table.Key(device, "kv_attention_hopper", 8, None, 128, 4096, 4, "bfloat16")
    table = lambda p, k=key: dispatch_table.Table(device, {k: {"pallas_s": p, "xla_s": 1.0, "bf16_s": 1.5}})  # noqa: E731
    path = lambda spec, slots=4096: kvcache.store_path(spec, 128, jnp.bfloat16, 4, slots)  # noqa: E731
    with config.interpret(True):
        assert path(post) == "pallas" and path(pre) == "pallas"  # unmeasured: as before
        with dispatch_table.use(table(2.0)):
            assert path(post) == "pallas"
        with dispatch_table.use(table(0.5)):
            assert path(post) == "hopper"
            assert path(post, 8192) == "hopper"  # the nearest measured length
            assert path(pre) == "pallas"  # the post-RoPE kernel's time says nothing of rotating keys
        rope_key = dataclasses.replace(key, kernel="kv_attention_hopper_rope")
        with dispatch_table.use(table(0.5, rope_key)):
            assert path(pre) == "hopper" and path(post) == "pallas"
        with dispatch_table.use(table(2.0, rope_key)):
            assert path(pre) == "pallas"
            int4 = kvspec.KVSpec(bits=4, pre_rope=False)
            assert kvcache.store_path(int4, 128, jnp.bfloat16, 4, 4096) != "hopper"  # int4's own measurement
        with dispatch_table.use(dispatch_table.Table(device, {dataclasses.replace(key, bits=4): {
                "pallas_s": 0.5, "xla_s": 1.0, "bf16_s": 1.5}})):
            assert kvcache.store_path(int4, 128, jnp.bfloat16, 4, 4096) == "hopper"


@pytest.mark.parametrize("pre_rope", [False, True])
def test_a_decode_step_reads_the_store_through_the_kernel_where_a_table_says_so(monkeypatch, pre_rope):
    """A bf16 model (head_dim 128, GQA) decoding into an int8 cache of 128 slots in GPU interpret mode: with a table
    choosing the Mosaic kernel every layer's store is read by it, and the logits are those of the path it replaces
    within the kernel's roundings. Pre-RoPE keys with a float window and sinks beside the store (the sinks merged
    after the kernel), against the store dequantized, then attended; post-RoPE keys with sinks and no window (the
    sinks attended in the kernel's merge), against XLA's dots over the codes (the same bf16 roundings of q s_k and p
    s_v: with every recent token read from the store too, the float reference is 2-5 % of the logits away)."""
    from llmeq_jax import calibrate, native
    from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params
    from pallas_kernels import kv_attention_hopper as kv_hopper

    model = ModelConfig("llama", 64, 512, 2, 4, 2, 128, 256, 1e-5, 256, False)
    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(model, jax.random.key(0)))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.vocab_size, (2, 9)))  # a prompt of 6, three decode steps
    # pre-RoPE keys with a float window (the sinks merged after the kernel), post-RoPE without (in its merge)
    spec = kvspec.KVSpec(bits=8, pre_rope=pre_rope, window=3 if pre_rope else 0, sink_tokens=2)
    kv = calibrate.make_kv_quantizer(spec, model, params, rng.integers(0, model.vocab_size, (4, 16)))
    calls = []
    real = kv_hopper.kv_attention_hopper
    monkeypatch.setattr(kv_hopper, "kv_attention_hopper", lambda *a, **kw: calls.append(kw["layer"]) or real(*a, **kw))
    device = config.target_device().device_kind
    rows = dispatch_table.row_bucket(2 * model.num_heads // model.num_kv_heads)

    def decode():
        step = lambda p, t, m, c: forward_step(model, p, t, m, c)  # noqa: E731  a fresh function: traced here
        cache = init_cache(model, 2, 128, jnp.bfloat16, kv=kv)
        logits, cache = jax.jit(step)(params, tokens[:, :6], jnp.ones((2, 6), jnp.int32), cache)
        outs, run = [logits[:, -1]], jax.jit(step)
        for i in range(6, tokens.shape[1]):
            logits, cache = run(params, tokens[:, i:i + 1], jnp.ones((2, 1), jnp.int32), cache)
            outs.append(logits[:, 0])
        return jnp.stack(outs, 1).astype(jnp.float32)

    with native.disabled(), config.interpret(True):
        if pre_rope:
            with config.disabled():
                want = decode()  # the store dequantized, then attended
        else:
            dots = dispatch_table.Key(device, "kv_attention", 8, None, 128, 128, rows, "bfloat16")
            with dispatch_table.use(dispatch_table.Table(device, {dots: {"pallas_s": 2.0, "xla_s": 1.0,
                                                                         "bf16_s": 2.0}})):
                want = decode()  # XLA's dots over the codes, the sinks merged after them
        assert not calls
        hopper = dispatch_table.Key(device, kvcache.hopper_table_kernel(spec), 8, None, 128, 128, rows, "bfloat16")
        with dispatch_table.use(dispatch_table.Table(device, {hopper: {"pallas_s": 1.0, "xla_s": 2.0,
                                                                       "bf16_s": 2.0}})):
            got = decode()
    assert calls == list(range(model.num_layers))  # the decode step, traced once: every layer's store
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.02 * scale)
    assert float(jnp.max(jnp.abs(got[:, 1:] - got[:, :-1]))) > 0.2 * scale
