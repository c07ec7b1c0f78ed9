"""The Hopper weight-only kernel in Mosaic GPU: GPU interpret mode against the dequantized product; lowering for
CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import config
from pallas_kernels.weight_only_hopper import WeightOnlyBlocks, can_use, weight_only_hopper
from tests.pallas_kernels.weight_only_cases import FAKE_A100, FAKE_H100, kernel_scales, quantized


def _quantized(k, n, group, zero_point, seed, bits=8):
    return quantized(k, n, group, zero_point, seed, bits)


_kernel_args = kernel_scales


def _exact_product(x, q, group):
    """The product in float64 of what the kernel multiplies: with group scales, the weights dequantized into x's
    dtype (``QArray.dequantize``, the operand the kernel builds); per channel, ``(x @ (q - z)) * s``."""
    x64 = np.asarray(x, np.float64)
    if group is not None:
        return x64 @ np.asarray(q.dequantize(x.dtype), np.float64)
    codes = np.asarray(q.values(), np.float64)
    if q.zero_point is not None:
        codes = codes - np.asarray(q.zero_point, np.float64)
    return (x64 @ codes) * np.asarray(q.scale, np.float64)


def _assert_one_rounding(got, exact, dtype):
    """Within one rounding of x's dtype of the exact product (float32 sums add far less at these K)."""
    eps = float(jnp.finfo(dtype).eps)
    got = np.asarray(got, np.float64)
    assert np.all(np.abs(got - exact) <= eps * np.abs(exact) + 1e-6 * np.abs(exact).max())


INT4_BLOCKS = WeightOnlyBlocks(tile_m=64, tile_n=64, tile_k=128, stages=2)
CASES = [  # m, k, n, group, zero point, dtype, blocks, bits
    (200, 256, 256, None, False, jnp.bfloat16, WeightOnlyBlocks(tile_m=128, tile_n=64, stages=2), 8),  # padded rows
    (128, 256, 256, None, True, jnp.float16, WeightOnlyBlocks(tile_m=64, tile_n=64, stages=2), 8),  # (x@q - sum(x) z) s
    (128, 256, 256, 128, True, jnp.bfloat16, WeightOnlyBlocks(tile_m=64, tile_n=64, stages=3, snake_minor_n=False,
                                                              snake_width=2), 8),
    (64, 384, 128, 64, False, jnp.bfloat16, WeightOnlyBlocks(tile_m=64, tile_n=64, stages=4), 8),  # a group a step
    # int4 pairs packed along K: the even rows' codes, then the odd rows', against x's columns in that order
    (128, 256, 256, 128, True, jnp.bfloat16, INT4_BLOCKS, 4),
    (200, 512, 256, None, False, jnp.float16, None, 4),  # int4's default blocks (128 x 128 tiles)
]


@pytest.mark.parametrize("m,k,n,group,zp,dtype,blocks,bits", CASES)
def test_kernel_is_the_dequantized_product_rounded_once(m, k, n, group, zp, dtype, blocks, bits):
    q = _quantized(k, n, group, zp, seed=m + k, bits=bits)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    scale, zero = _kernel_args(q, group)
    got = weight_only_hopper(x, q.qvalue, scale, zero_point=zero, group=group, bits=bits, blocks=blocks,
                             interpret=True)
    assert got.dtype == x.dtype and got.shape == (m, n)
    _assert_one_rounding(got, _exact_product(x, q, group), dtype)
    if group is not None:  # the same operand as XLA's path: its rounded result, up to the sums' order
        xla = jnp.matmul(x, q.dequantize(x.dtype), preferred_element_type=jnp.float32).astype(dtype)
        eps = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32), rtol=eps, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_layer_of_a_stack_is_read_in_place_with_a_bias(bits):
    k, n, group = 256, 256, 128
    qs = [_quantized(k, n, group, True, seed=s, bits=bits) for s in range(3)]
    args = [_kernel_args(q, group) for q in qs]
    stack = jnp.stack([q.qvalue for q in qs])
    scales, zps = jnp.stack([a[0] for a in args]), jnp.stack([a[1] for a in args])
    x = jax.random.normal(jax.random.key(4), (64, k)).astype(jnp.bfloat16)
    bias = jnp.linspace(-2, 2, n).astype(jnp.bfloat16)
    blocks = WeightOnlyBlocks(tile_m=64, tile_n=64, stages=2) if bits == 8 else INT4_BLOCKS
    got = weight_only_hopper(x, stack, scales, zero_point=zps, group=group, bias=bias, layer=jnp.int32(1), bits=bits,
                             blocks=blocks, interpret=True)
    _assert_one_rounding(got, _exact_product(x, qs[1], group) + np.asarray(bias, np.float64), jnp.bfloat16)
    other = _exact_product(x, qs[0], group) + np.asarray(bias, np.float64)
    assert not np.allclose(np.asarray(got, np.float64), other, atol=0.1)


def test_can_use_names_what_the_kernel_does_not_take():
    ok = lambda **kw: can_use(**{**dict(x_shape=(64, 256), x_dtype=jnp.bfloat16, wq_dtype=jnp.int8, k=256,  # noqa: E731
                                        n=256, group=None), **kw})
    with config.interpret(True):
        assert ok() == (True, "") and ok(group=128) == (True, "")
        assert "bfloat16/float16" in ok(x_dtype=jnp.float32)[1]
        assert "not packed" in ok(wq_dtype=jnp.uint8)[1]
        assert "not of 256" in ok(n=384)[1] and "multiple of 64" in ok(k=288, x_shape=(64, 288))[1]
        assert "group 32" in ok(group=32)[1] and "group 192" in ok(group=192)[1]  # 192 does not divide 256
        int4 = dict(wq_dtype=jnp.uint8, bits=4)
        assert ok(**int4) == (True, "") and ok(**int4, group=128) == (True, "")
        assert "two codes a byte" in ok(bits=4)[1] and "expected int8" in ok(wq_dtype=jnp.uint8)[1]
        assert "multiples of 128 K values" in ok(**int4, blocks=WeightOnlyBlocks(tile_k=64))[1]
        assert "group 64" in ok(**int4, group=64)[1] and "int3" in ok(bits=3)[1]
        assert "at least two" in ok(**int4, k=128, x_shape=(64, 128))[1]  # slots released a step late: 2 steps
    with config.compiling_for(FAKE_H100):
        assert ok() == (True, "")
    with config.compiling_for(FAKE_A100):
        assert not ok()[0] and "Hopper" in ok()[1]


def test_bad_input_gets_one_clear_error():
    q = _quantized(256, 256, None, False, seed=1)
    scale, _ = _kernel_args(q, None)
    x = jnp.zeros((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"expects x \(M, K\) and int8 wq \(K, N\)"):
        weight_only_hopper(jnp.zeros((8, 128), jnp.bfloat16), q.qvalue, scale, interpret=True)
    with pytest.raises(ValueError, match="per channel"):
        weight_only_hopper(x, q.qvalue, jnp.ones((2, 256)), interpret=True)
    with pytest.raises(ValueError, match="groups of 128"):
        weight_only_hopper(x, q.qvalue, scale, group=128, interpret=True)
    with pytest.raises(ValueError, match="zero_point"):
        weight_only_hopper(x, q.qvalue, scale, zero_point=jnp.zeros((1, 256), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="bias"):
        weight_only_hopper(x, q.qvalue, scale, bias=jnp.zeros((7,)), interpret=True)
    with pytest.raises(ValueError, match="bfloat16/float16"):
        weight_only_hopper(x.astype(jnp.float32), q.qvalue, scale, interpret=True)
    with pytest.raises(ValueError, match="multiples of 64"):
        WeightOnlyBlocks(tile_k=32)
    with pytest.raises(ValueError, match=r"int4 wq \(K / 2, N\)"):  # int8 codes given as int4 pairs
        weight_only_hopper(x, q.qvalue, scale, bits=4, interpret=True)
    with pytest.raises(ValueError, match="bits=3"):
        weight_only_hopper(x, q.qvalue, scale, bits=3, interpret=True)


@pytest.mark.parametrize("group,zp,bias,stacked,bits", [(None, False, False, False, 8), (None, True, True, True, 8),
                                                        (128, True, False, False, 8), (128, False, True, True, 8),
                                                        (None, True, False, False, 4), (128, True, True, True, 4)])
def test_kernel_lowers_for_cuda_to_one_mosaic_gpu_call(group, zp, bias, stacked, bits):
    """Lowered for a Hopper GPU on this CPU: Mosaic GPU's layout inference accepts the dequantization into shared
    memory (codes loaded from a swizzled int8 tile, group rows broadcast onto them, stored as a wgmma operand)."""
    m, k, n = 256, 512, 1024
    lead = (4,) if stacked else ()
    groups = 1 if group is None else k // group
    codes = jax.ShapeDtypeStruct((*lead, k, n), jnp.int8) if bits == 8 else jax.ShapeDtypeStruct((*lead, k // 2, n),
                                                                                               jnp.uint8)
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), codes,
            jax.ShapeDtypeStruct((*lead, groups, n), jnp.float32),
            jax.ShapeDtypeStruct((*lead, groups, n), jnp.int8) if zp else None,
            jax.ShapeDtypeStruct((n,), jnp.bfloat16) if bias else None,
            jax.ShapeDtypeStruct((), jnp.int32) if stacked else None]

    def f(x, w, s, z, b, layer):
        return weight_only_hopper(x, w, s, zero_point=z, group=group, bias=b, layer=layer, bits=bits)

    with config.compiling_for(FAKE_H100):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "__gpu$xla.gpu.triton" not in text
