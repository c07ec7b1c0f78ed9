"""XLA's dots over the quantized KV store (llmeq_jax.kv.store_attention) against the dequantize-and-attend
reference, and the choice between them and the Pallas kernel (kv.cache.store_path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import dispatch_table, native
from llmeq_jax.core.rope import rope_tables
from llmeq_jax.core.qarray import int_range, pack
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.kv.store_attention import codes, store_attention
from pallas_kernels import config as kernel_config
from pallas_kernels.kv_cache import store_decode_attention_reference


def _store(bits, b=2, h=2, t=70, d=64, layers=None, seed=0):
    """A random store as the cache keeps it (codes packed, per-channel key grid, float16 per-token value grid)."""
    ks = jax.random.split(jax.random.key(seed), 6)
    lead = (layers,) if layers else ()
    lo, hi = int_range(bits)
    kc, vc = (pack(jax.random.randint(k, (*lead, b, h, t, d), lo, hi + 1).astype(jnp.int8), bits, -1) for k in ks[:2])
    k_scale = jax.random.uniform(ks[2], (1, h, 1, d), minval=0.01, maxval=0.05)
    k_lo = jax.random.normal(ks[3], (1, h, 1, d)) * 0.3
    v_scale = jax.random.uniform(ks[4], (*lead, b, h, t, 1), minval=0.01, maxval=0.05).astype(jnp.float16)
    v_lo = (jax.random.normal(ks[5], (*lead, b, h, t, 1)) * 2).astype(jnp.float16)
    return kc, vc, k_scale, k_lo, v_scale, v_lo


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_are_the_packed_values_without_unpacking(bits):
    lo, hi = int_range(bits)
    values = jnp.arange(lo, hi + 1, dtype=jnp.int8).reshape(1, -1)[:, : 16 if bits == 4 else 256]
    values = jnp.tile(values, (3, 4))  # both nibble positions see every code
    got = codes(pack(values, bits, -1), bits)
    assert got.shape == values.shape
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.int32)), np.asarray(values, np.int32))


# float32 queries: dots at HIGHEST precision, only the summation order differs (seen: 5e-7 of the output).
# Half queries: q * s_k and p * s_v rounded to bf16, as a bf16 cache's attention rounds q and p (seen: 2.3e-3).
@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 1e-2)])
@pytest.mark.parametrize("bits", [4, 8])
def test_equals_the_dequantizing_reference(bits, dtype, rtol):
    kc, vc, ks, kl, vs, vl = _store(bits, seed=bits)
    q = (jax.random.normal(jax.random.key(7), (2, 8, 64)) * 2).astype(dtype)
    length = jnp.array([70, 33])
    allowed = jax.random.bernoulli(jax.random.key(8), 0.8, (2, 70))
    out, lse = jax.jit(lambda *a: store_attention(*a, bits=bits, allowed=allowed))(q, kc, vc, ks, kl, vs, vl, length)
    want, want_lse = store_decode_attention_reference(q, kc, vc, ks, kl, vs, vl, length, bits=bits, allowed=allowed)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(out, want, atol=rtol * scale)
    np.testing.assert_allclose(lse, want_lse, atol=rtol * float(jnp.max(jnp.abs(want_lse))))
    # the comparison is not trivially met: without the value offsets the output moves by far more, without
    # the key offsets (the same shift for every slot of a row) the log-sum-exp does
    wrong, _ = store_attention(q, kc, vc, ks, kl, vs, jnp.zeros_like(vl), length, bits=bits, allowed=allowed)
    assert float(jnp.max(jnp.abs(wrong - want))) > 3 * rtol * scale
    _, wrong_lse = store_attention(q, kc, vc, ks, jnp.zeros_like(kl), vs, vl, length, bits=bits, allowed=allowed)
    assert float(jnp.max(jnp.abs(wrong_lse - want_lse))) > 3 * rtol * float(jnp.max(jnp.abs(want_lse)))


def test_a_layer_of_a_stack_and_a_row_with_no_slot():
    kc, vc, ks, kl, vs, vl = _store(8, layers=3)
    q = jax.random.normal(jax.random.key(2), (2, 4, 64))
    length = jnp.array([0, 70])  # row 0 reads nothing
    out, lse = store_attention(q, kc, vc, ks, kl, vs, vl, length, bits=8, layer=jnp.int32(2))
    want, want_lse = store_decode_attention_reference(q, kc[2], vc[2], ks, kl, vs[2], vl[2], length, bits=8)
    np.testing.assert_allclose(out[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[1], want_lse[1], atol=1e-5 * float(jnp.max(jnp.abs(want_lse[1]))))
    assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(lse[0] < -1e29))  # weighs nothing in a merge


def test_bad_query_shape_is_named():
    kc, vc, ks, kl, vs, vl = _store(8)
    with pytest.raises(ValueError, match="q must be"):
        store_attention(jnp.zeros((2, 3, 64)), kc, vc, ks, kl, vs, vl, 70, bits=8)
    with pytest.raises(ValueError, match="q must be"):
        store_attention(jnp.zeros((2, 64)), kc, vc, ks, kl, vs, vl, 70, bits=8)
    with pytest.raises(ValueError, match="bits=2"):
        codes(kc, 2)


def _table(choice: str, spec, rows=2, slots=16, dtype=jnp.float32):
    key = dispatch_table.Key(jax.devices()[0].device_kind, "kv_attention", spec.bits, None, 64, slots, rows,
                             jnp.dtype(dtype).name)
    pallas, xla = (2.0, 1.0) if choice == "xla" else (1.0, 2.0)
    return dispatch_table.from_json(dispatch_table.to_json(key.device, [(key, {"pallas_s": pallas, "xla_s": xla,
                                                                               "bf16_s": 1.5})]))


def test_store_path_follows_the_measured_table():
    post, pre = kvspec.KVSpec(bits=8, pre_rope=False), kvspec.KVSpec(bits=8)
    path = lambda spec: kvcache.store_path(spec, 64, jnp.float32, 2, 16)  # noqa: E731
    assert path(post) == path(pre) == "native"  # a CPU with the native kernels: they read the store
    with native.disabled():
        assert path(post) is None  # CPU, no kernel, no table: dequantize
    with kernel_config.interpret(True):
        assert path(post) == "pallas"  # the static rule: the kernel where it runs
        with dispatch_table.use(_table("xla", post)):
            assert path(post) == "xla"
            assert path(pre) == "pallas"  # pre-RoPE keys: no single dot over the codes
            assert kvcache.store_path(post, 64, jnp.float32, 2, 100) == "xla"  # the nearest measured length: 16
            assert kvcache.store_path(post, 64, jnp.float32, 2, 4096) == "pallas"  # nothing measured near 4096
            assert kvcache.store_path(post, 64, jnp.float32, 4, 16) == "pallas"  # nor at 4 query rows
        with dispatch_table.use(_table("pallas", post)):
            assert path(post) == "pallas"
    with dispatch_table.use(_table("xla", post)), native.disabled():
        assert path(post) == "xla"  # measured faster here: no kernel needed
    assert kvcache.store_path(kvspec.KVSpec(bits=8, outlier_frac=0.02, pre_rope=False), 64, jnp.float32, 2, 16) is None


# --------------------------------------------------------------------------- the native CPU kernel


def _native_store(bits, d, key_rows, rng, L=3, b=2, kv=2, t=300):
    lo_c, hi_c = int_range(bits)
    codes_ = [jnp.asarray(rng.integers(lo_c, hi_c + 1, (L, b, kv, t, d)), jnp.int8) for _ in range(2)]
    if bits == 4:
        codes_ = [pack(c, 4, axis=-1) for c in codes_]
    k_scale = jnp.asarray(rng.random((key_rows, kv, 1, d)) * 0.1 + 0.01, jnp.float32)
    k_lo = jnp.asarray(rng.standard_normal((key_rows, kv, 1, d)), jnp.float32)
    v_scale = jnp.asarray(rng.random((L, b, kv, t, 1)) * 0.1 + 0.01, jnp.float16)
    v_lo = jnp.asarray(rng.standard_normal((L, b, kv, t, 1)), jnp.float16)
    return (*codes_, k_scale, k_lo, v_scale, v_lo)


def _simd_path(path: str):
    """The kernel's code path for a test: "blocks" (AVX-512, 16 slots a step, where the CPU has it), "avx2"
    (the AVX2 loops) or "scalar" (the portable loops)."""
    if path == "avx2":
        return native.without_vnni()
    return native.force_scalar(path == "scalar")


# (d, hq): head dims of every block width (32 .. 128) and one the blocks do not take (12); query heads per
# KV head 3, 5 and 7 (the value sums' register groups of 4 or 3 heads and their remainders).
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("d,hq,rope,masked,key_rows", [(64, 6, False, False, 1), (64, 6, True, True, 1),
                                                       (12, 6, True, True, 2), (64, 6, False, True, 2),
                                                       (128, 10, True, True, 1), (32, 14, False, True, 2),
                                                       (96, 10, False, False, 1)])
@pytest.mark.parametrize("path", ["blocks", "avx2", "scalar"])
def test_native_store_attention_equals_the_reference(bits, d, hq, rope, masked, key_rows, path):
    """native.kv_store_attention (layer 1 of a stack read in place, slots up to ``scan``, float16 value
    grids, static or per-row key grids, pre-RoPE keys rotated by tables) equals the dequantize-rotate-
    attend reference, out and log-sum-exp, on each of its code paths; a row that may read no slot gives
    lse -1e30 and zeros."""
    from pallas_kernels.kv_cache import store_decode_attention_reference

    rng = np.random.default_rng(bits * d + rope)
    kc, vc, ks, kl, vs, vl = _native_store(bits, d, key_rows, rng)
    b, t = 2, kc.shape[3]
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    allowed = jnp.asarray(rng.random((b, t)) < 0.7).at[1].set(False) if masked else None
    slot_pos = jnp.asarray(rng.integers(0, 1000, (b, t)), jnp.int32)
    inv_freq = jnp.asarray(1.0 / (10000 ** (np.arange(0, d, 2) / d)), jnp.float32)
    extra = dict(slot_pos=slot_pos, inv_freq=inv_freq) if rope else {}
    scan = 250  # not a multiple of the 16-slot block; several tasks' chunks
    ref_out, ref_lse = store_decode_attention_reference(q, kc, vc, ks, kl, vs, vl, scan, bits=bits, allowed=allowed,
                                                        layer=1, **extra)
    tables = rope_tables(slot_pos, np.asarray(inv_freq)) if rope else None
    run = jax.jit(lambda *a: native.kv_store_attention(*a, bits=bits, layer=jnp.int32(1), allowed=allowed,
                                                       rope_tables=tables))
    with _simd_path(path):
        out, lse = run(q, kc, vc, ks, kl, vs, vl, scan)
    seen = np.isfinite(np.asarray(ref_lse))
    assert seen.any()
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(ref_out)[seen], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(ref_lse)[seen], rtol=1e-6, atol=1e-4)
    if masked:
        assert not seen[1].any()
        np.testing.assert_array_equal(np.asarray(lse)[1], np.float32(-1e30))
        np.testing.assert_array_equal(np.asarray(out)[1], 0.0)


@pytest.mark.parametrize("path", ["blocks", "scalar"])
def test_native_store_attention_reads_a_float_part_in_the_same_softmax(path):
    """``extra`` (the cache's float sinks [L, B, KV, N, D] and which of them each row sees): out and lse are
    the attention over the store and those entries together, as merging the two parts' own softmaxes gives;
    a row that sees no store slot still attends to its sinks."""
    from llmeq_jax.kv.attention import merge_attention
    from pallas_kernels.kv_cache import store_decode_attention_reference

    rng = np.random.default_rng(3)
    kc, vc, ks, kl, vs, vl = _native_store(8, 64, 1, rng)
    b, hq, kv, n, layers = 2, 6, 2, 4, kc.shape[0]
    q = jnp.asarray(rng.standard_normal((b, hq, 64)), jnp.float32)
    allowed = jnp.asarray(rng.random((b, kc.shape[3])) < 0.7).at[1].set(False)
    k_sink, v_sink = (jnp.asarray(rng.standard_normal((layers, b, kv, n, 64)), jnp.float32) for _ in range(2))
    seen = jnp.asarray([[True, False, True, True], [True, True, False, True]])
    with _simd_path(path):
        out, lse = native.kv_store_attention(q, kc, vc, ks, kl, vs, vl, 250, bits=8, layer=jnp.int32(1),
                                             allowed=allowed, extra=(k_sink, v_sink, seen))
    store = store_decode_attention_reference(q, kc, vc, ks, kl, vs, vl, 250, bits=8, allowed=allowed, layer=1)
    qg = q.reshape(b, kv, hq // kv, 64) / 8.0  # 1 / sqrt(D)
    scores = jnp.where(seen[:, None, None, :], jnp.einsum("bkgd,bknd->bkgn", qg, k_sink[1]), -jnp.inf)
    sink_out = jnp.einsum("bkgn,bknd->bkgd", jax.nn.softmax(scores, -1), v_sink[1]).reshape(b, hq, 64)
    sink_lse = jax.nn.logsumexp(scores, -1).reshape(b, hq)
    store = (jnp.nan_to_num(store[0]), jnp.where(jnp.isfinite(store[1]), store[1], -1e30))  # row 1 reads no slot
    want, want_lse = merge_attention(store, (sink_out, sink_lse))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(out[1], sink_out[1], rtol=1e-5, atol=1e-5)  # row 1: its sinks alone
    assert float(jnp.max(jnp.abs(out[0] - store[0][0]))) > 1e-2  # the sinks weigh in row 0 too
    with pytest.raises(ValueError, match="the float part must be"):
        native.kv_store_attention(q, kc, vc, ks, kl, vs, vl, 250, bits=8, layer=1, extra=(k_sink[1], v_sink[1], seen))


def test_native_store_attention_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    kc, vc, ks, kl, vs, vl = _native_store(8, 16, 1, rng, t=8)
    q = jnp.ones((2, 4, 16))
    with pytest.raises(ValueError, match="do not hold 4-bit rows of head dim 16"):
        native.kv_store_attention(q, kc, vc, ks, kl, vs, vl, 8, bits=4, layer=0)
    with pytest.raises(ValueError, match="for batch 3"):
        native.kv_store_attention(jnp.ones((3, 4, 16)), kc, vc, ks, kl, vs, vl, 8, bits=8, layer=0)
