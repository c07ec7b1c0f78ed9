"""The prompt kernel over the int4 decode words: the weights as the dot's A operand (interpret mode; lowering)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_words as iw
from pallas_kernels.blocks import Blocks
from pallas_kernels.int4_words_prefill import default_blocks, int4_words_prefill


def _weights(k, n, group, zp, seed=3, lead=()):
    rng = np.random.default_rng(seed)
    groups = 1 if group is None else -(-k // group)
    q = jnp.asarray(rng.integers(-8, 8, (*lead, k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, (*lead, groups, n)), jnp.float32)
    zero = jnp.asarray(rng.integers(-8, 8, (*lead, groups, n)), jnp.int8) if zp else None
    return iw.pack_words(q, group), scale, zero


def _dequantized_in(dtype, words, scale, zero, k, group):
    """The weights as x's dtype -- what the kernel multiplies: (value - zero point) * scale in float32, rounded
    once, as ``QArray.dequantize(x.dtype)`` makes them (per channel: scaled after the sum)."""
    q = iw.unpack_words(words, k).astype(jnp.float32)
    per_k = lambda a: jnp.repeat(a, group, axis=0)[:k] if group else a  # noqa: E731
    if zero is not None:
        q = q - per_k(zero.astype(jnp.float32))
    if group is None:
        return q.astype(dtype), scale
    return (q * per_k(scale.astype(jnp.float32))).astype(dtype), None


CASES = [  # m, k, n, group, zero points, bias, dtype, blocks
    (64, 256, 128, 128, True, False, jnp.bfloat16, None),
    (40, 300, 200, 64, True, True, jnp.bfloat16, None),  # ragged M, K, N; groups shorter than a word block
    (33, 576, 96, 32, False, False, jnp.float16, None),
    (20, 512, 130, 256, True, False, jnp.bfloat16, None),  # groups of two word blocks
    (20, 250, 130, None, True, True, jnp.float16, None),  # per channel
    (300, 256, 128, 128, True, False, jnp.bfloat16, Blocks(256, 64, 128, 4, 2)),  # two row blocks, one ragged
]


@pytest.mark.parametrize("m,k,n,group,zp,bias,dtype,blocks", CASES)
def test_kernel_is_the_product_with_the_weights_in_x_dtype(m, k, n, group, zp, bias, dtype, blocks):
    """Against the weights dequantized once into x's dtype (the kernel's operands) with float32 sums: the same
    up to the order of the sums and the output's rounding; against the float32 reference within x's dtype."""
    words, scale, zero = _weights(k, n, group, zp, seed=m)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    b = jnp.linspace(-1, 1, n) if bias else None
    got = int4_words_prefill(x, words, scale, group=group, w_zero_point=zero, bias=b, blocks=blocks, interpret=True)
    assert got.dtype == x.dtype and got.shape == (m, n)
    w, after = _dequantized_in(dtype, words, scale, zero, k, group)
    exact = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    exact = (exact if after is None else exact * after) + (0.0 if b is None else b)
    top = float(jnp.max(jnp.abs(exact)))
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exact), rtol=eps, atol=1e-3 * eps * top)
    want = iw.int4_words_reference(x, words, scale, group=group, w_zero_point=zero, bias=b)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=4 * eps * top)


def test_float16_keeps_small_scales_bits():
    """Scales of 5e-7..2e-6 (float16 subnormals, 2^-24 apart) scale the weights in float32 before their one
    rounding: the product is the float32 reference's within float16's precision, where float16 scales would be off
    by up to a third."""
    words, scale, zero = _weights(256, 64, 128, True)
    scale = scale * 1e-4
    x = jax.random.normal(jax.random.key(2), (32, 256)).astype(jnp.float16) * 1000
    got = int4_words_prefill(x, words, scale, group=128, w_zero_point=zero, interpret=True)
    want = iw.int4_words_reference(x, words, scale, group=128, w_zero_point=zero)
    top = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=4e-3 * top)


def test_kernel_reads_one_layer_of_a_stack_in_place():
    words, scale, zero = _weights(256, 64, 128, True, lead=(3,))
    x = jax.random.normal(jax.random.key(9), (40, 256)).astype(jnp.bfloat16)
    at = jax.jit(lambda x, w, s, z, i: int4_words_prefill(x, w, s, group=128, w_zero_point=z, layer=i,
                                                          interpret=True))
    for i in range(3):
        want = int4_words_prefill(x, words[i], scale[i], group=128, w_zero_point=zero[i], interpret=True)
        np.testing.assert_array_equal(np.asarray(at(x, words, scale, zero, jnp.int32(i)), np.float32),
                                      np.asarray(want, np.float32))


def test_bad_inputs_are_refused_with_what_was_expected():
    words, scale, _ = _weights(256, 32, 128, False)
    x = jnp.ones((32, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="int4_words_prefill: x must be bfloat16 or float16"):
        int4_words_prefill(x.astype(jnp.float32), words, scale, group=128, interpret=True)
    with pytest.raises(ValueError, match=r"int4_words_prefill: words for K=256 \(group 128\) must be int32 with 32"):
        int4_words_prefill(x, words[:16], scale, group=128, interpret=True)
    with pytest.raises(ValueError, match=r"the K block is one word block \(128 rows\), got 256"):
        int4_words_prefill(x, words, scale, group=128, blocks=Blocks(32, 32, 256), interpret=True)


def test_default_blocks_take_256_rows_for_long_prompts():
    assert (default_blocks(4096, 4096).bm, default_blocks(512, 4096).bm, default_blocks(20, 4096).bm) == (256, 128, 32)
    assert default_blocks(4096, 4096).bk == iw.WORD_BLOCK


def test_kernel_lowers_for_cuda_to_one_dot_a_word_block(cuda_lowering):
    """What makes it fast on Hopper, as far as the IR shows: one (128 x 128) x (128 x 256) dot a word block whose
    A operand is computed (the dequantized weights, from eight two-word nibble PTX calls), B being x's tile
    transposed -- so Triton chains eight wgmma steps with the A operand in registers."""
    from pallas_kernels.ttir import triton_modules

    sds = jax.ShapeDtypeStruct
    args = [sds((2048, 4096), jnp.bfloat16), sds((iw.word_rows(4096, 128), 11008), jnp.int32),
            sds((32, 11008), jnp.bfloat16), sds((32, 11008), jnp.int8)]
    f = lambda x, w, s, z: int4_words_prefill(x, w, s, group=128, w_zero_point=z)  # noqa: E731
    (kernel,) = triton_modules(f, *args)
    assert kernel.ttir.count("tt.elementwise_inline_asm") == 8 and "packed_element = 2" in kernel.ttir
    (dot,) = [line for line in kernel.ttir.splitlines() if "tt.dot " in line]
    assert "tensor<128x128xbf16> * tensor<128x256xbf16> -> tensor<128x256xf32>" in dot
    assert kernel.grid == (86, 8, 1) and kernel.num_warps == 8
    cuda_lowering(f, *args)
