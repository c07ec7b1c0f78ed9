"""The float matmul that reads a layer of a stacked kernel in place (interpret mode; lowering for CUDA)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.float_matmul import can_use, float_matmul

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


@pytest.mark.parametrize("m,k,n,dtype,layer,bias,splits", [
    (1, 256, 96, jnp.bfloat16, None, False, None),
    (5, 300, 40, jnp.float32, 1, True, None),  # ragged K and N, a layer of a stack, bias
    (16, 512, 128, jnp.float16, 2, False, 3),  # split K
    (20, 128, 64, jnp.bfloat16, 0, True, 2),  # two row blocks, bias after the splits
])
def test_float_matmul_matches_a_float32_dot(m, k, n, dtype, layer, bias, splits):
    rng = np.random.default_rng(m)
    stack = jnp.asarray(rng.standard_normal((3, k, n)), dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    b = jnp.linspace(-1, 1, n) if bias else None
    w = stack if layer is not None else stack[0]
    got = float_matmul(x, w, bias=b, layer=None if layer is None else jnp.int32(layer), k_splits=splits,
                       interpret=True)
    want = x.astype(jnp.float32) @ stack[layer or 0].astype(jnp.float32) + (0 if b is None else b)
    assert got.dtype == x.dtype and got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=TOL[dtype],
                               atol=TOL[dtype] * float(jnp.max(jnp.abs(want))))


def test_bad_inputs_say_what_was_expected():
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="must be one float dtype"):
        float_matmul(x, jnp.ones((64, 32), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match=r"expects x \(M, K\) and w \(K, N\) stacked \[L, K, N\] with layer="):
        float_matmul(x, jnp.ones((64, 32), jnp.bfloat16), layer=jnp.int32(0), interpret=True)
    assert can_use((17, 64), jnp.bfloat16, jnp.bfloat16) == (False, "17 rows (the kernel is for decode steps of <= 16)")


def test_float_matmul_lowers_for_cuda(cuda_lowering):
    sds = jax.ShapeDtypeStruct
    cuda_lowering(lambda x, w, i: float_matmul(x, w, layer=i), sds((1, 4096), jnp.bfloat16),
                  sds((4, 4096, 11008), jnp.bfloat16), sds((), jnp.int32))
