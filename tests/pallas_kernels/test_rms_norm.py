"""RMSNorm of a decode step's rows in one kernel (pallas_kernels/rms_norm.py): interpret mode, refusals, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rms_norm as rn


@pytest.mark.parametrize("m, k, dtype", [(1, 4096, jnp.bfloat16), (3, 300, jnp.float32), (16, 576, jnp.float16),
                                         (2, 8192, jnp.bfloat16)])
@pytest.mark.parametrize("stacked", [False, True])
def test_kernel_matches_the_models_norm(m, k, dtype, stacked):
    x = (jax.random.normal(jax.random.key(m), (m, k)) * 3 + 0.5).astype(dtype)
    scale = jax.random.uniform(jax.random.key(k), (k,), minval=0.5, maxval=1.5)
    if stacked:  # layer 2 of a stack, read in place
        got = rn.rms_norm(x, jnp.stack([scale * 0, scale * 3, scale]), 1e-5, layer=jnp.int32(2), interpret=True)
    else:
        got = rn.rms_norm(x, scale, 1e-5, interpret=True)
    want = rn.rms_norm_reference(x, scale, 1e-5)
    assert got.dtype == x.dtype and got.shape == x.shape
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 1e-3}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_bad_inputs_are_refused_with_what_was_expected():
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="17 rows"):
        rn.rms_norm(jnp.ones((17, 64)), jnp.ones(64), 1e-5, interpret=True)
    with pytest.raises(ValueError, match=f"{rn.MAX_K + 1} features"):
        rn.rms_norm(jnp.ones((1, rn.MAX_K + 1)), jnp.ones(rn.MAX_K + 1), 1e-5, interpret=True)
    with pytest.raises(ValueError, match=r"scale must be \(64,\), got \(3, 64\)"):
        rn.rms_norm(x, jnp.ones((3, 64)), 1e-5, interpret=True)
    with pytest.raises(ValueError, match=r"scale must be a stack \(L, 64\) with layer=, got \(64,\)"):
        rn.rms_norm(x, jnp.ones(64), 1e-5, layer=0, interpret=True)
    with pytest.raises(ValueError, match="float32/bfloat16/float16, got int32"):
        rn.rms_norm(jnp.ones((1, 64), jnp.int32), jnp.ones(64), 1e-5, interpret=True)


def test_kernel_lowers_for_cuda(cuda_lowering):
    x = jnp.ones((1, 4096), jnp.bfloat16)
    cuda_lowering(lambda x, s, i: rn.rms_norm(x, s, 1e-5, layer=i), x, jnp.ones((4, 4096)), jnp.int32(1))
    cuda_lowering(lambda x, s: rn.rms_norm(x, s, 1e-6), jnp.ones((3, 300), jnp.float32), jnp.ones(300))
