"""Split-K partial sums added by the kernel's last program of each tile (pallas_kernels/split_fixup.py): the int4 word
and float kernels with the scan's counters held, against their references plus the residual, in interpret mode; the
counters left zero; where the counters are not taken; lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import config, settings, split_fixup
from pallas_kernels.float_matmul import float_matmul
from pallas_kernels.int4_words import int4_words_matmul, int4_words_reference, pack_words
from pallas_kernels.norm_fold import NormFold
from pallas_kernels.rms_norm import rms_norm_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}


def _held(product):
    """``product`` traced as a scan's layer calls it: the counters held, (its result, the counters handed back)."""
    def call(*args):
        with split_fixup.scope(split_fixup.zeros()) as held:
            return product(*args), held.value
    return jax.jit(call)


def _close(got, want, dtype):
    assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0,
                               atol=TOL[dtype] * scale)


def _words(m, k, n, group, zp, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.randint(keys[0], (3, k, n), -8, 8)
    groups = -(-k // group)
    s = 0.01 * (1 + jax.random.uniform(keys[1], (3, groups, n)))
    z = jax.random.randint(keys[2], (3, groups, n), -3, 4).astype(jnp.int8) if zp else None
    x = jax.random.normal(keys[3], (m, k)) * 3 + 0.5
    residual = jax.random.normal(keys[4], (m, n)) * 4
    return pack_words(q, group), s, z, x, residual


@pytest.mark.parametrize("m, k, n, splits, zp, bias, folded, dtype", [
    (3, 1000, 200, 3, True, True, False, jnp.bfloat16),  # ragged K and N, zero points, bias before the residual
    (2, 512, 384, 3, False, False, True, jnp.bfloat16),  # the norm folded: x's squares summed by the last program
    (16, 384, 128, 1, True, False, True, jnp.float32),   # no split: every program finishes its own tile
])
def test_word_kernel_finishes_its_split_product(m, k, n, splits, zp, bias, folded, dtype):
    words, s, z, x, residual = _words(m, k, n, 128, zp)
    x, residual = x.astype(dtype), residual.astype(dtype)
    scales = 1 + 0.5 * jax.random.normal(jax.random.key(9), (3, k))
    b = jax.random.normal(jax.random.key(8), (n,)) if bias else None
    norm = NormFold(scales, 1e-5) if folded else None
    got, counters = _held(lambda x, r: int4_words_matmul(x, words, s, group=128, w_zero_point=z, bias=b,
                                                         layer=jnp.int32(1), norm=norm, residual=r, k_splits=splits,
                                                         interpret=True))(x, residual)
    x_in = rms_norm_reference(x, scales[1], 1e-5) if folded else x
    want = int4_words_reference(x_in, words[1], s[1], group=128, w_zero_point=None if z is None else z[1], bias=b)
    _close(got, (want.astype(jnp.float32) + residual.astype(jnp.float32)).astype(dtype), dtype)
    assert not np.any(np.asarray(counters))  # every tile's counter set back: the next kernel finds them zero


@pytest.mark.parametrize("m, k, n, splits, folded, dtype", [
    (1, 1024, 256, 8, False, jnp.float32), (4, 1000, 130, 3, True, jnp.bfloat16),
])
def test_float_kernel_finishes_its_split_product(m, k, n, splits, folded, dtype):
    keys = jax.random.split(jax.random.key(3), 4)
    w = (jax.random.normal(keys[0], (3, k, n)) * 0.05).astype(dtype)
    x = (jax.random.normal(keys[1], (m, k)) * 3).astype(dtype)
    residual = (jax.random.normal(keys[2], (m, n)) * 4).astype(dtype)
    scales = 1 + 0.5 * jax.random.normal(keys[3], (3, k))
    norm = NormFold(scales, 1e-5) if folded else None
    got, counters = _held(lambda x, r: float_matmul(x, w, layer=jnp.int32(2), norm=norm, residual=r, k_splits=splits,
                                                    interpret=True))(x, residual)
    x_in = rms_norm_reference(x, scales[2], 1e-5) if folded else x
    want = jnp.dot(x_in, w[2], preferred_element_type=jnp.float32) + residual.astype(jnp.float32)
    _close(got, want.astype(dtype), dtype)
    assert not np.any(np.asarray(counters))


def test_without_counters_the_residual_is_added_after_the_rounded_product():
    """Outside a scan's scope (or ``reduce=xla``) XLA adds the splits, then the residual: what ``x + linear(...)`` did."""
    words, s, _, x, residual = _words(2, 512, 256, 128, False, seed=4)
    x, residual = x.astype(jnp.bfloat16), residual.astype(jnp.bfloat16)
    plain = int4_words_matmul(x, words, s, group=128, layer=jnp.int32(0), k_splits=4, interpret=True)
    got = int4_words_matmul(x, words, s, group=128, layer=jnp.int32(0), k_splits=4, residual=residual, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(residual + plain))
    with settings.override("int4_words", reduce="xla"):
        kept = jax.jit(lambda x, r: _held_value(lambda: int4_words_matmul(
            x, words, s, group=128, layer=jnp.int32(0), k_splits=4, residual=r, interpret=True)))(x, residual)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(got))


def _held_value(product):
    initial = split_fixup.zeros()
    with split_fixup.scope(initial) as held:
        y = product()
    assert held.value is initial  # no kernel took the counters
    return y


def test_the_counters_are_taken_only_at_the_scopes_own_trace_level_and_size():
    seen = []

    def layer(x):
        with split_fixup.scope(split_fixup.zeros()):
            seen.append(split_fixup.take(8) is not None)
            seen.append(split_fixup.take(split_fixup.CAPACITY + 1) is None)  # more tiles than counters
            jax.lax.fori_loop(0, 1, lambda i, c: (seen.append(split_fixup.take(8) is None), c)[1], x)  # nested
        return x

    jax.jit(layer)(jnp.zeros(3))
    assert seen == [True, True, True]
    assert split_fixup.take(1) is None  # no scope


def test_a_held_launch_updates_the_counters_in_place_and_lowers_for_cuda():
    k = n = 4096
    sds = jax.ShapeDtypeStruct
    args = (sds((1, k), jnp.bfloat16), sds((2, k // 8, n), jnp.int32), sds((2, k // 128, n), jnp.bfloat16),
            sds((1, n), jnp.bfloat16))
    call = _held(lambda x, w, s, r: int4_words_matmul(x, w, s, group=128, layer=jnp.int32(1), residual=r))
    jaxpr = str(jax.make_jaxpr(call)(*args))
    assert jaxpr.count("pallas_call") == 1 and "input_output_aliases=((" in jaxpr  # the counters, in place
    lowered = call.trace(*args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def _gated(y):
    half = y.shape[-1] // 2
    return jax.nn.silu(y[..., :half].astype(jnp.float32)) * y[..., half:].astype(jnp.float32)


@pytest.mark.parametrize("splits, folded, held", [(3, True, True), (1, False, True), (3, False, False)])
def test_word_kernel_gates_a_paired_gate_up_product(splits, folded, held):
    """``act="swiglu"`` on words whose columns pair gate and up (``decode_layout.pair_swiglu``): the kernel gates its
    finished tiles (held counters or no split), else XLA gates the summed product -- silu(gate) * up either way."""
    from llmeq_jax.decode_layout import pair_swiglu, Int4WordKernel
    from llmeq_jax.core.quantize import Spec, quantize
    from llmeq_jax.decode_layout import int4_word_kernel

    k, i = 512, 192
    q = quantize(jax.random.normal(jax.random.key(6), (k, 2 * i)), Spec(bits=4, granularity="group", group_size=128,
                                                                       symmetric=False))
    joined = int4_word_kernel(q)
    paired = pair_swiglu({"gate_up_proj": {"kernel": joined}})["gate_up_proj"]["kernel"]
    assert isinstance(paired, Int4WordKernel) and paired.paired and paired.shape == joined.shape
    x = (jax.random.normal(jax.random.key(7), (2, k)) * 2).astype(jnp.bfloat16)
    scales = 1 + 0.5 * jax.random.normal(jax.random.key(10), (k,))
    norm = NormFold(scales, 1e-5) if folded else None
    w = paired.w

    def product(x):
        return int4_words_matmul(x, w.qvalue, w.scale, group=128, w_zero_point=w.zero_point, norm=norm,
                                 k_splits=splits, act="swiglu", interpret=True)

    got = _held(product)(x)[0] if held else product(x)
    x_in = rms_norm_reference(x, scales, 1e-5) if folded else x
    want = _gated(int4_words_reference(x_in, joined.w.qvalue, q.scale, group=128, w_zero_point=q.zero_point))
    assert got.shape == (2, i)
    _close(got, want.astype(jnp.bfloat16), jnp.bfloat16)


@pytest.mark.parametrize("fp8, splits, held", [(False, 3, True), (True, 3, True), (False, 1, False)])
def test_w8a8_kernel_gates_a_paired_gate_up_product(fp8, splits, held):
    """``w8a8_matmul(act="swiglu")`` over K-major rows whose outputs pair gate and up (``decode_layout.pair_swiglu``
    of a W8A8 kernel, int8 or E4M3): the kernel gates its finished tiles -- silu(gate) * up of the joined kernel's own
    W8A8 product, from its float32 sums where XLA would gate the product rounded to bf16."""
    from llmeq_jax.core.quantize import Spec, quantize
    from llmeq_jax.decode_layout import RowMajorKernel, pair_swiglu, transpose_kernel
    from pallas_kernels.w8a8 import w8a8_matmul

    k, i = 512, 192
    spec = Spec(bits=8, grid="fp8") if fp8 else Spec(bits=8)
    act = Spec(bits=8, granularity="token", grid="fp8" if fp8 else "uniform")
    joined = RowMajorKernel(transpose_kernel(quantize(jax.random.normal(jax.random.key(15), (k, 2 * i)), spec,
                                                      act_spec=act)))
    paired = pair_swiglu({"gate_up_proj": {"kernel": joined}})["gate_up_proj"]["kernel"]
    assert paired.paired and paired.shape == joined.shape
    x = (jax.random.normal(jax.random.key(16), (2, k)) * 2).astype(jnp.bfloat16)

    def product(x, w, act=None):
        return w8a8_matmul(x, w.qvalue, w.scale.T, w_layout="nk", fp8=fp8, k_splits=splits, act=act, interpret=True)

    got = _held(lambda x: product(x, paired.w, "swiglu"))(x)[0] if held else product(x, paired.w, "swiglu")
    want = _gated(product(x, joined.w).astype(jnp.float32))
    assert got.shape == (2, i)
    _close(got, want.astype(jnp.bfloat16), jnp.bfloat16)


@pytest.mark.parametrize("layout", ["words", "rows"])
def test_a_paired_kernel_outside_the_decode_kernels_is_gated_after_its_product(layout):
    """Every other path (XLA's, here) reads a paired kernel's product with its outputs interleaved: ``ops.swiglu``
    gates the pairs, and is what the joined kernel gives gated halves -- an int4 word kernel, an int8 row-major one."""
    from llmeq_jax import ops
    from llmeq_jax.core.quantize import Spec, quantize
    from llmeq_jax.decode_layout import RowMajorKernel, int4_word_kernel, pair_swiglu, transpose_kernel

    if layout == "words":
        q = quantize(jax.random.normal(jax.random.key(11), (256, 128)), Spec(bits=4, granularity="group",
                                                                            group_size=128))
        joined = int4_word_kernel(q)
    else:
        q = quantize(jax.random.normal(jax.random.key(11), (256, 128)), Spec(bits=8, symmetric=False))
        joined = RowMajorKernel(transpose_kernel(q))
    paired = pair_swiglu({"gate_up_proj": {"kernel": joined}})["gate_up_proj"]["kernel"]
    assert ops.paired_swiglu(paired) and not ops.paired_swiglu(joined)
    x = jax.random.normal(jax.random.key(12), (3, 256))
    got = ops.swiglu(x, paired, backend="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(_gated(ops.linear(x, joined, backend="xla"))),
                               rtol=1e-5, atol=1e-5)
    assert pair_swiglu({"gate_up_proj": {"kernel": paired}})["gate_up_proj"]["kernel"] is paired  # once only
    with_bias = {"gate_up_proj": {"kernel": joined, "bias": jnp.zeros(128)}}
    assert pair_swiglu(with_bias)["gate_up_proj"]["kernel"] is joined  # a bias would need pairing too: left


def test_kernel_dispatch_gates_only_where_a_kernel_does():
    """``kernel_dispatch.linear(..., swiglu=True)``: never required nor with a residual; None where the product goes to
    XLA (here: kernels unavailable), for the caller to gate the paired product."""
    from llmeq_jax import kernel_dispatch
    from llmeq_jax.core.quantize import Spec, quantize
    from llmeq_jax.decode_layout import transpose_kernel

    w = transpose_kernel(quantize(jax.random.normal(jax.random.key(13), (256, 128)), Spec(bits=8)))
    x = jnp.ones((1, 256), jnp.bfloat16)
    with config.interpret(True):
        with pytest.raises(ValueError, match="SwiGLU gate is taken where a kernel gates"):
            kernel_dispatch.linear(x, w, require=True, w_layout="nk", swiglu=True)
        with pytest.raises(ValueError, match="without a residual"):
            kernel_dispatch.linear(x, w, w_layout="nk", swiglu=True, residual=jnp.ones((1, 128), jnp.bfloat16))
    with config.disabled():
        assert kernel_dispatch.linear(x, w, w_layout="nk", swiglu=True) is None


def test_a_gated_launch_takes_no_residual():
    words, s, _, x, residual = _words(1, 256, 128, 128, False)
    with pytest.raises(ValueError, match="act must be one of"):
        int4_words_matmul(x, words[0], s[0], group=128, act="swiglu", residual=residual[:, :128], interpret=True)


@pytest.mark.parametrize("kernel", ["int8_f16", "weight_only", "w8a8"])
def test_int8_kernels_finish_their_split_products_with_the_residual(kernel):
    """The K-major int8 kernels of rtn-w8 / rtn-w8a8 decode layers: the residual added by the last program, the same
    product as without it (XLA's sum) plus the residual, the counters left zero."""
    from pallas_kernels import w8a8, weight_only

    m, k, n = 2, 512, 256
    keys = jax.random.split(jax.random.key(13), 4)
    x = jax.random.normal(keys[0], (m, k)).astype(jnp.bfloat16)
    wq = jax.random.randint(keys[1], (3, n, k), -127, 128).astype(jnp.int8)
    scale = jax.random.uniform(keys[2], (3, 1, n), minval=0.001, maxval=0.002)
    residual = (jax.random.normal(keys[3], (m, n)) * 4).astype(jnp.bfloat16)

    def product(x, r=None):
        if kernel == "w8a8":
            return w8a8.w8a8_matmul(x, wq, scale, layer=jnp.int32(1), w_layout="nk", k_splits=4, residual=r,
                                    interpret=True)
        return weight_only.weight_only_matmul(x, wq, scale, bits=8, layer=jnp.int32(1), w_layout="nk", k_splits=4,
                                              dequant="f16" if kernel == "int8_f16" else None, residual=r,
                                              interpret=True)

    got, counters = _held(product)(x, residual)
    want = product(x).astype(jnp.float32) + residual.astype(jnp.float32)
    _close(got, want.astype(jnp.bfloat16), jnp.bfloat16)
    assert not np.any(np.asarray(counters))


def test_the_float_caches_attention_merges_its_splits_in_the_kernel():
    """append_decode_attention with the counters held: the splits' last program merges them (flash decoding's
    merge, in split order), bit for bit XLA's merge of the same partials; the cache written as before."""
    from pallas_kernels.decode_attention import append_decode_attention, append_decode_attention_reference

    b, t, d, heads, kv, splits = 2, 256, 64, 8, 2, 3  # grouped query heads; uneven splits of the slots
    keys = jax.random.split(jax.random.key(14), 5)
    q = jax.random.normal(keys[0], (b, heads, d)).astype(jnp.bfloat16)
    k_new, v_new = (jax.random.normal(key, (b, kv, d)).astype(jnp.bfloat16) for key in keys[1:3])
    k_cache, v_cache = (jax.random.normal(key, (3, b, kv, t, d)).astype(jnp.bfloat16) for key in keys[3:5])
    slot = jnp.int32(200)
    allowed = jnp.broadcast_to(jnp.arange(t) <= 200, (b, t)).at[1, :40].set(False)

    def attend(q):
        return append_decode_attention(q, k_new, v_new, k_cache, v_cache, slot, allowed, layer=jnp.int32(1),
                                       num_splits=splits, interpret=True)

    (out, k_out, v_out), counters = _held(attend)(q)
    merged_by_xla, _, _ = attend(q)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(merged_by_xla))
    want = append_decode_attention_reference(q, k_new, v_new, k_cache, v_cache, slot, allowed, layer=jnp.int32(1))
    _close(out, want[0], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(want[1]))
    assert not np.any(np.asarray(counters))
    with settings.override("append_decode_attention", reduce="xla"):
        kept = jax.jit(lambda q: _held_value(lambda: attend(q)[0]))(q)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(out))


def test_the_attention_kernel_takes_no_launch_settings_but_reduce_and_rope():
    with pytest.raises(ValueError, match="takes reduce, rope only, got bn"):
        with settings.override("append_decode_attention", bn=64):
            pass
