import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache import (
    can_use,
    decode_splits,
    reads_words,
    store_decode_attention,
    store_decode_attention_reference,
)


def test_default_splits_fill_the_gpu_at_long_context():
    assert decode_splits(1, 8, 32768, 64) == 33  # 8 heads x 33 splits >= 264 programs
    assert decode_splits(1, 8, 300, 64) == 1  # short caches: one program per head
    assert decode_splits(64, 8, 32768, 64) == 1  # a large batch fills the GPU already


def test_can_use():
    assert can_use(128, 4, jnp.bfloat16) == (True, "")
    assert not can_use(80, 8, jnp.bfloat16)[0]
    assert can_use(16, 8, jnp.bfloat16)[0] and not can_use(16, 4, jnp.bfloat16)[0]  # int4 dots use head_dim / 2


# --------------------------------------------------------------------------- the store of kv.cache.QuantKVCache


def _store(b, h, t, d, bits, seed=0):
    """Codes and grids exactly as the cache writes them (llmeq_jax.kv.grid), from uneven random keys/values."""
    from llmeq_jax.kv import grid as kvgrid

    ks = jax.random.split(jax.random.key(seed), 2)
    k = jax.random.normal(ks[0], (b, h, t, d)) * jnp.linspace(0.5, 3, d) + jnp.linspace(-1, 1, d)
    v = jax.random.normal(ks[1], (b, h, t, d))
    hi = jnp.max(k, axis=(0, 2))[None, :, None]
    scale, lo = kvgrid.grid_from_range(jnp.min(k, axis=(0, 2))[None, :, None], hi, bits)
    kq = kvgrid.quantize_per_channel(k, scale, lo, hi, bits, 0)
    vq = kvgrid.quantize_per_token(v, bits, 0)
    return kq.q, vq.q, scale, lo, vq.scale, vq.lo


def _rope_args(b, t, d):
    return dict(slot_pos=jnp.broadcast_to(jnp.arange(t) * 7 + 3, (b, t)), inv_freq=1.0 / 10000 ** (jnp.arange(0, d, 2) / d))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rope", [False, True], ids=["postRoPE", "preRoPE"])
def test_store_decode_matches_reference(bits, rope):
    b, h, g, t, d = 2, 2, 3, 70, 64
    store = _store(b, h, t, d, bits)
    q = jax.random.normal(jax.random.key(9), (b, h * g, d))
    kw = dict(bits=bits, allowed=jax.random.bernoulli(jax.random.key(3), 0.7, (b, t)), **(_rope_args(b, t, d) if rope else {}))
    length = jnp.array([t, 41])
    ref_out, ref_lse = store_decode_attention_reference(q, *store, length, **kw)
    for splits in (1, 3):
        out, lse = store_decode_attention(q, *store, length, block_t=16, num_splits=splits, interpret=True, **kw)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref_out))))
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    # The mask matters: reading every slot gives another answer.
    everything, _ = store_decode_attention(q, *store, length, block_t=16, interpret=True, **{**kw, "allowed": None})
    assert float(jnp.max(jnp.abs(everything - ref_out))) > 1e-2


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rope", [False, True], ids=["postRoPE", "preRoPE"])
def test_bf16_query_uses_bf16_operands_within_bf16_error(bits, rope):
    """A bf16 query's scores and weights go to the dots as one bf16 part (a float32 query's as three; pre-RoPE
    keys: one bf16 dot of the rotated keys, not TF32x3): within bf16's error of the float32 reference, and
    not the float32 path's result to the bit. (int8 post-RoPE at this head_dim reads words: float16.)"""
    b, h, g, t, d = 1, 2, 3, 70, 64
    store = _store(b, h, t, d, bits)
    q = jax.random.normal(jax.random.key(9), (b, h * g, d)).astype(jnp.bfloat16)
    length = jnp.array([t])
    kw = _rope_args(b, t, d) if rope else {}
    ref_out, ref_lse = store_decode_attention_reference(q.astype(jnp.float32), *store, length, bits=bits, **kw)
    out, lse = store_decode_attention(q, *store, length, bits=bits, block_t=16, interpret=True, **kw)
    scale = float(jnp.max(jnp.abs(ref_out)))
    np.testing.assert_allclose(out, ref_out, atol=1e-2 * scale)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-2, rtol=1e-3)
    exact, _ = store_decode_attention(q.astype(jnp.float32), *store, length, bits=bits, block_t=16, interpret=True,
                                      **kw)
    np.testing.assert_allclose(exact, ref_out, rtol=1e-5, atol=1e-5 * scale)
    assert float(jnp.max(jnp.abs(out - exact))) > 1e-6 * scale  # the bf16 operands are what ran


@pytest.mark.parametrize("bits, rope, dtype", [(8, True, jnp.float32), (4, False, jnp.float32),
                                              (8, False, jnp.bfloat16), (4, True, jnp.bfloat16)])
def test_float_sinks_join_the_stores_softmax(bits, rope, dtype):
    """sinks=(k, v, seen): N float tokens attended in the same softmax as the store (split 0's starting carry), the
    reference's answer with those tokens beside the store's, on a stacked layer, over one and several splits; a
    row that sees no sink, and sinks alone (no store slot allowed), included."""
    b, h, g, t, d, n, layers = 2, 2, 3, 70, 64, 4, 2
    store = _store(b, h, t, d, bits)
    stacks = [jnp.stack([a, a[..., ::-1, :]]) for a in (store[0], store[1], store[4], store[5])]
    k_sink, v_sink = (jax.random.normal(key, (layers, b, h, n, d)) * 2 for key in jax.random.split(jax.random.key(5)))
    seen = jnp.array([[True, False, True, True], [False, False, False, False]])
    q = jax.random.normal(jax.random.key(9), (b, h * g, d)).astype(dtype)
    allowed = jax.random.bernoulli(jax.random.key(3), 0.7, (b, t))
    kw = dict(bits=bits, allowed=allowed, layer=jnp.int32(1), **(_rope_args(b, t, d) if rope else {}))
    length = jnp.array([t, 41])
    sinks = (k_sink.astype(dtype), v_sink.astype(dtype), seen)
    ref_out, ref_lse = store_decode_attention_reference(q.astype(jnp.float32), stacks[0], stacks[1], *store[2:4],
                                                        stacks[2], stacks[3], length, sinks=sinks, **kw)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    scale = float(jnp.max(jnp.abs(ref_out)))
    for splits in (1, 3):
        out, lse = store_decode_attention(q, stacks[0], stacks[1], *store[2:4], stacks[2], stacks[3], length,
                                          sinks=sinks, block_t=16, num_splits=splits, interpret=True, **kw)
        np.testing.assert_allclose(out, ref_out, atol=tol * scale)
        np.testing.assert_allclose(lse, ref_lse, atol=tol, rtol=tol)
    without, _ = store_decode_attention(q, stacks[0], stacks[1], *store[2:4], stacks[2], stacks[3], length,
                                        block_t=16, interpret=True, **kw)
    assert float(jnp.max(jnp.abs(without[0] - out[0]))) > 1e-2 * scale  # row 0's sinks count
    np.testing.assert_allclose(without[1], out[1], atol=tol * scale)  # row 1 sees none of them
    alone, _ = store_decode_attention(q, stacks[0], stacks[1], *store[2:4], stacks[2], stacks[3], length, sinks=sinks,
                                      block_t=16, interpret=True, **{**kw, "allowed": jnp.zeros((b, t), bool)})
    ref_alone, _ = store_decode_attention_reference(q.astype(jnp.float32), stacks[0], stacks[1], *store[2:4],
                                                    stacks[2], stacks[3], length, sinks=sinks,
                                                    **{**kw, "allowed": jnp.zeros((b, t), bool)})
    np.testing.assert_allclose(alone[0], ref_alone[0], atol=tol * scale)
    with pytest.raises(ValueError, match="sinks must be"):
        store_decode_attention(q, stacks[0], stacks[1], *store[2:4], stacks[2], stacks[3], length,
                               sinks=(k_sink[1], v_sink[1], seen), interpret=True, **kw)  # one layer for a stack


@pytest.mark.parametrize("bits", [8, 4])
def test_store_decode_reads_a_layer_of_a_stacked_store_in_place(bits):
    """layer= (traced): the kernel reads that layer of every layer's store, with that layer's result --
    and another layer's store gives another one."""
    b, h, g, t, d, layers = 1, 2, 2, 40, 64, 3
    stores = [_store(b, h, t, d, bits, seed=i) for i in range(layers)]
    k_grid = stores[1][2:4]  # the key grid is one layer's
    stacks = [jnp.stack([s[i] for s in stores]) for i in (0, 1, 4, 5)]
    q = jax.random.normal(jax.random.key(2), (b, h * g, d))
    length = jnp.array([33])
    kw = dict(bits=bits, block_t=16, num_splits=2, interpret=True)
    want = store_decode_attention(q, *stores[1][:2], *k_grid, *stores[1][4:], length, **kw)

    @jax.jit
    def at_layer(layer):
        kc, vc, vs, vl = stacks
        return store_decode_attention(q, kc, vc, *k_grid, vs, vl, length, layer=layer, **kw)

    for got, ref in zip(at_layer(jnp.int32(1)), want):  # the same sums (to float rounding: jit vs eager merge)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    ref_out, _ = store_decode_attention_reference(q, stacks[0], stacks[1], *k_grid, stacks[2], stacks[3], length,
                                                  bits=bits, layer=1)
    np.testing.assert_allclose(want[0], ref_out, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref_out))))
    assert float(jnp.max(jnp.abs(at_layer(jnp.int32(2))[0] - want[0]))) > 1e-2
    # no slice of the stack in the traced call: the kernel is handed the stack itself
    text = str(jax.make_jaxpr(at_layer)(jnp.int32(1)))
    assert "dynamic_slice" not in text and "pallas_call" in text
    # every layer's key grid [L, 1, H, 1, D] (kv.cache's): read at the layer in place too, the same result
    grids = [jnp.stack([s[i] for s in stores]) for i in (2, 3)]
    every = jax.jit(lambda layer: store_decode_attention(q, *stacks[:2], *grids, *stacks[2:], length, layer=layer,
                                                         **kw))
    for got, ref in zip(every(jnp.int32(1)), want):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert float(jnp.max(jnp.abs(every(jnp.int32(2))[0] - at_layer(jnp.int32(2))[0]))) > 1e-2  # layer 2's grid
    with pytest.raises(ValueError, match="every layer's"):
        store_decode_attention(q, *stacks[:2], grids[0][:2], grids[1][:2], *stacks[2:], length, layer=0, **kw)


@pytest.mark.parametrize("bits, d, dtype", [(8, 128, jnp.bfloat16), (4, 128, jnp.bfloat16), (8, 64, jnp.float16),
                                             (4, 128, jnp.float16)])
def test_half_query_reads_the_store_as_words_within_float16_error(bits, d, dtype):
    """bf16/f16 queries over post-RoPE keys: the store read as 32-bit words (float16 operands, exact codes, the
    float side scaled into float16's range by powers of two): within float16's error of the float32
    reference, masks, ragged lengths, splits and a stacked store's layer included."""
    b, h, g, t = 2, 2, 3, 70
    assert reads_words(d, bits, dtype) and not reads_words(d, bits, jnp.float32)
    assert not reads_words(d, bits, dtype, rope=True) and not reads_words(64, 4, dtype)  # int4 lanes: 128 / 8
    store = _store(b, h, t, d, bits)
    q = (jax.random.normal(jax.random.key(9), (b, h * g, d)) * 3).astype(dtype)
    kw = dict(bits=bits, allowed=jax.random.bernoulli(jax.random.key(3), 0.7, (b, t)))
    length = jnp.array([t, 41])
    ref_out, ref_lse = store_decode_attention_reference(q.astype(jnp.float32), *store, length, **kw)
    scale = float(jnp.max(jnp.abs(ref_out)))
    for splits in (1, 3):
        out, lse = store_decode_attention(q, *store, length, block_t=16, num_splits=splits, interpret=True, **kw)
        np.testing.assert_allclose(out, ref_out, atol=2e-3 * scale)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-3, rtol=2.0**-11)  # float16 operands
    stacked = [jnp.stack([a, a[::-1]]) for a in (store[0], store[1], store[4], store[5])]
    out, _ = store_decode_attention(q, stacked[0], stacked[1], *store[2:4], stacked[2], stacked[3], length, layer=0,
                                    block_t=16, interpret=True, **kw)
    np.testing.assert_allclose(out, ref_out, atol=2e-3 * scale)


def test_store_decode_ignores_slots_past_length():
    b, h, t, d, bits = 1, 1, 48, 32, 8
    kc, vc, *grids = _store(b, h, t, d, bits)
    q = jax.random.normal(jax.random.key(5), (b, 2, d))
    out, _ = store_decode_attention(q, kc, vc, *grids, jnp.array([20]), bits=bits, block_t=16, interpret=True)
    garbage = kc.at[:, :, 20:].set(127), vc.at[:, :, 20:].set(-127)
    out2, _ = store_decode_attention(q, *garbage, *grids, jnp.array([20]), bits=bits, block_t=16, interpret=True)
    np.testing.assert_array_equal(out, out2)


def test_store_decode_with_nothing_allowed_weighs_nothing():
    b, h, t, d = 1, 1, 32, 32
    store = _store(b, h, t, d, 8)
    q = jax.random.normal(jax.random.key(1), (b, 2, d))
    for length, allowed in ((0, None), (t, jnp.zeros((b, t), bool))):
        out, lse = store_decode_attention(q, *store, length, bits=8, allowed=allowed, interpret=True)
        np.testing.assert_array_equal(out, 0.0)
        assert bool(jnp.all(lse < -1e29)) and bool(jnp.all(jnp.isfinite(lse)))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rope", [False, True], ids=["postRoPE", "preRoPE"])
def test_store_decode_lowers_for_cuda(cuda_lowering, bits, rope):
    b, h, g, t, d = 2, 8, 4, 32768, 128
    sds = jax.ShapeDtypeStruct
    cache = sds((b, h, t, d if bits == 8 else d // 2), jnp.int8 if bits == 8 else jnp.uint8)
    tok, grid = sds((b, h, t, 1), jnp.float16), sds((1, h, 1, d), jnp.float32)

    def attend(q, kc, vc, ks, kl, vs, vl, n, allowed, pos, freq):
        extra = dict(slot_pos=pos, inv_freq=freq) if rope else {}
        return store_decode_attention(q, kc, vc, ks, kl, vs, vl, n, bits=bits, allowed=allowed, **extra)

    args = (sds((b, h * g, d), jnp.bfloat16), cache, cache, grid, grid, tok, tok, sds((b,), jnp.int32),
            sds((b, t), bool), sds((b, t), jnp.int32), sds((d // 2,), jnp.float32))
    from pallas_kernels.ttir import triton_modules

    kernel, merge = triton_modules(attend, *args)  # first: a second lowering of the same call is cached
    cuda_lowering(attend, *args, calls=2)
    assert merge.name == "merge_splits"
    # Post-RoPE: the codes are read as words, every lane of the key and value tiles made float16 by inline PTX
    # (4 lanes for int8, 8 for int4). Pre-RoPE: int4 values become bf16 by inline PTX (low and high nibbles),
    # keys are dequantized in float32 to be rotated (cos.approx and sin.approx per key lane: even and odd
    # nibbles for int4), int8 codes are converted.
    want = ((2 if bits == 4 else 0) + 2 * (2 if bits == 4 else 1)) if rope else 2 * (32 // bits)
    assert kernel.ttir.count("tt.elementwise_inline_asm") == want


@pytest.mark.parametrize("bits, rope", [(8, False), (4, False), (8, True)], ids=["int8-words", "int4-words", "int8-rope"])
def test_store_decode_with_float_sinks_lowers_for_cuda(cuda_lowering, bits, rope):
    """The sinks' carry (float32 dots of the query heads over N = 4 tokens, padded to 16) lowers beside each way the
    store is read (words for post-RoPE bf16 queries, bytes rotated per tile for pre-RoPE keys), stacked layers."""
    b, h, g, t, d, n = 1, 8, 4, 4096, 128, 4
    sds = jax.ShapeDtypeStruct
    cache = sds((2, b, h, t, d if bits == 8 else d // 2), jnp.int8 if bits == 8 else jnp.uint8)
    tok, grid = sds((2, b, h, t, 1), jnp.float16), sds((1, h, 1, d), jnp.float32)
    sink = sds((2, b, h, n, d), jnp.bfloat16)

    def attend(q, kc, vc, ks, kl, vs, vl, length, allowed, pos, freq, k_sink, v_sink, seen, layer):
        extra = dict(slot_pos=pos, inv_freq=freq) if rope else {}
        return store_decode_attention(q, kc, vc, ks, kl, vs, vl, length, bits=bits, allowed=allowed,
                                      sinks=(k_sink, v_sink, seen), layer=layer, **extra)

    cuda_lowering(attend, sds((b, h * g, d), jnp.bfloat16), cache, cache, grid, grid, tok, tok, sds((b,), jnp.int32),
                  sds((b, t), bool), sds((b, t), jnp.int32), sds((d // 2,), jnp.float32), sink, sink, sds((b, n), bool),
                  sds((), jnp.int32), calls=2)  # the kernel, then the merge of its splits


@pytest.mark.parametrize("bits", [8, 4])
def test_pre_rope_approximate_cos_sin_only_for_half_queries(cuda_lowering, bits):
    """cos.approx / sin.approx (absolute error ~5e-7) for bf16/f16 queries; float32 queries keep accurate
    cos / sin of the reduced angle (their path promises float32 attention)."""
    b, h, g, t, d = 1, 2, 2, 256, 64
    sds = jax.ShapeDtypeStruct
    cache = sds((b, h, t, d if bits == 8 else d // 2), jnp.int8 if bits == 8 else jnp.uint8)
    tok, grid = sds((b, h, t, 1), jnp.float16), sds((1, h, 1, d), jnp.float32)

    def attend(q, kc, vc, ks, kl, vs, vl, n, pos, freq):
        return store_decode_attention(q, kc, vc, ks, kl, vs, vl, n, bits=bits, slot_pos=pos, inv_freq=freq)

    from pallas_kernels.ttir import triton_modules

    for dtype, approx in ((jnp.bfloat16, True), (jnp.float32, False)):
        args = (sds((b, h * g, d), dtype), cache, cache, grid, grid, tok, tok, sds((b,), jnp.int32),
                sds((b, t), jnp.int32), sds((d // 2,), jnp.float32))
        kernel, _ = triton_modules(attend, *args)  # the kernel, then the merge of its splits
        cuda_lowering(attend, *args, calls=2)
        assert ("cos.approx" in kernel.ttir and "sin.approx" in kernel.ttir) == approx, jnp.dtype(dtype).name


@pytest.mark.parametrize("masked, rope", [(True, False), (False, True)])
def test_token_rows_are_read_one_block_ahead(masked, rope):
    """The token loop carries the next block's allowed mask and value grid (scale, min): read where they
    were used, they compiled to synchronous global loads in every iteration (sm_90 SASS). RoPE positions
    are read where used (carried, they spilled the rotation loop)."""
    import re

    from pallas_kernels.ttir import triton_modules

    b, h, g, t, d = 1, 2, 2, 512, 64
    sds = jax.ShapeDtypeStruct
    cache, tok = sds((b, h, t, d), jnp.int8), sds((b, h, t, 1), jnp.float16)
    args = (sds((b, h * g, d), jnp.bfloat16), cache, cache, sds((1, h, 1, d), jnp.float32),
            sds((1, h, 1, d), jnp.float32), tok, tok, sds((b,), jnp.int32), sds((b, t), bool),
            sds((b, t), jnp.int32), sds((d // 2,), jnp.float32))

    def attend(q, kc, vc, ks, kl, vs, vl, n, allowed, pos, freq):
        extra = dict(slot_pos=pos, inv_freq=freq) if rope else {}
        return store_decode_attention(q, kc, vc, ks, kl, vs, vl, n, bits=8, allowed=allowed if masked else None,
                                      **extra)

    kernel, _ = triton_modules(attend, *args)  # the kernel, then the merge of its splits
    (results,) = re.findall(r"scf\.for .*?-> \((.*?)\)\s*:", kernel.ttir)
    # max, sum and output, then (allowed,) value scale, value min: one row of the block each
    assert results.count("tensor<") == 3 + (3 if masked else 2), results


def test_store_decode_bad_input_is_rejected_clearly():
    store = _store(1, 1, 16, 32, 4)
    q = jnp.ones((1, 1, 32))
    with pytest.raises(ValueError, match="head_dim 32 is not a power of two >= 64"):
        store_decode_attention(q, *store, 4, bits=4, **_rope_args(1, 16, 32), interpret=True)
    with pytest.raises(ValueError, match="need both slot_pos and inv_freq"):
        store_decode_attention(q, *store, 4, bits=4, slot_pos=jnp.zeros((1, 16), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="allowed must be"):
        store_decode_attention(q, *store, 4, bits=4, allowed=jnp.ones((1, 8), bool), interpret=True)
    with pytest.raises(ValueError, match="v_lo must be"):
        store_decode_attention(q, *store[:5], store[5][:, :, :8], 4, bits=4, interpret=True)
    with pytest.raises(ValueError, match="k_cache must be int8"):
        store_decode_attention(q, *store, 4, bits=8, interpret=True)
    with pytest.raises(ValueError, match="multiple of cache heads"):
        store_decode_attention(jnp.ones((1, 3, 32)), *_store(1, 2, 16, 32, 8), 4, bits=8, interpret=True)
    kc, vc, ks, kl, vs, vl = _store(1, 1, 16, 32, 8)
    with pytest.raises(ValueError, match="must be stacks"):
        store_decode_attention(q, jnp.stack([kc, kc]), vc[None], ks, kl, vs[None], vl[None], 4, bits=8, layer=0,
                               interpret=True)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        store_decode_attention(q, kc[None], vc[None], ks, kl, vs[None], vl[None], 4, bits=8, layer=jnp.zeros(2, int),
                               interpret=True)


def test_int4_operands_carry_the_fold_offset_only_for_half_queries():
    """bf16/f16 queries: each int4 code + INT4_FOLD (removed after the dots through sums of the float side).
    Float32 queries: the signed code itself, exact in bf16 -- carried through, the offset made the float32
    accumulators ~20x larger than the attention they hold (the suspected cause of two float32 cases
    missing their tolerance on an H200)."""
    from pallas_kernels.common import high_nibble, low_nibble
    from pallas_kernels.kv_cache import INT4_FOLD, _code_operands, _int4_fold

    assert _int4_fold(4, parts=1) == INT4_FOLD and _int4_fold(4, parts=3) == 0.0 and _int4_fold(8, parts=1) == 0.0
    stored = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8).reshape(16, 16)
    signed = [low_nibble(stored.astype(jnp.int32)), high_nibble(stored.astype(jnp.int32))]
    for fold in (INT4_FOLD, 0.0):
        ops = _code_operands(stored, 4, interpreted=True, fold=fold)
        assert all(o.dtype == jnp.bfloat16 for o in ops)
        for o, s in zip(ops, signed):
            np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(s, np.float32) + fold)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_gpus_default_merges_the_splits_by_xla_until_the_merge_kernel_is_checked(bits, monkeypatch):
    """Traced for a GPU with no unchecked kernel turned on (pallas_kernels.hardware_checked), the kernel's splits
    are merged by XLA (combine_splits: no merge_splits launch), in the output dtype asked for, with the reference's
    numbers; turned on, by the merge kernel."""
    import types

    from pallas_kernels import config, hardware_checked

    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    monkeypatch.delenv(hardware_checked.ENV, raising=False)
    b, h, g, t, d = 2, 2, 3, 70, 64
    store = _store(b, h, t, d, bits)
    q = jax.random.normal(jax.random.key(9), (b, h * g, d))
    length = jnp.array([t, 41])
    ref_out, ref_lse = store_decode_attention_reference(q, *store, length, bits=bits)

    def call(q):
        return store_decode_attention(q, *store, length, bits=bits, block_t=16, num_splits=3, interpret=True,
                                      out_dtype=jnp.bfloat16)

    def traced() -> str:  # a fresh function each time: JAX's trace cache does not know the setting
        return str(jax.make_jaxpr(lambda q: call(q))(q))

    with config.compiling_for(gpu):
        assert "merge_splits" not in traced()
        out, lse = call(q)
        monkeypatch.setenv(hardware_checked.ENV, "merge_splits")
        assert "merge_splits" in traced()
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=1e-2 * float(jnp.max(jnp.abs(ref_out))))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
