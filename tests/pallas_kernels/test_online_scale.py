import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.online_scale import online_quantize, online_quantize_reference


@pytest.mark.parametrize(
    "r,c,per_channel,with_state,bits",
    [(5, 70, True, False, 8), (37, 200, True, True, 8), (33, 150, False, True, 4), (1, 64, False, False, 8)],
)
def test_kernel_matches_reference(r, c, per_channel, with_state, bits):
    k1, k2 = jax.random.split(jax.random.key(r))
    x = jax.random.normal(k1, (r, c)) * 3
    state = jax.random.uniform(k2, (c,) if per_channel else (), minval=0.5, maxval=4) if with_state else None
    q, new, scale, zp = online_quantize(x, state, per_channel=per_channel, bits=bits, interpret=True)
    rq, rnew, rscale, rzp = online_quantize_reference(x, state, per_channel=per_channel, bits=bits)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_allclose(new, rnew, rtol=1e-6)
    np.testing.assert_allclose(scale, rscale, rtol=1e-6)
    np.testing.assert_array_equal(zp, rzp)
    assert q.dtype == jnp.int8 and int(jnp.max(jnp.abs(q))) <= 2 ** (bits - 1) - 1


def test_ema_follows_the_formula_over_steps():
    """delta_t = a * delta_{t-1} + (1 - a) * max(absmax_t, eps), carried through three calls."""
    alpha, state = 0.75, None
    expected = None
    for t in range(3):
        x = jax.random.normal(jax.random.key(t), (8, 16)) * (t + 1)
        _, state, _, _ = online_quantize(x, state, alpha=alpha, per_channel=False, interpret=True)
        amax = float(jnp.max(jnp.abs(x)))
        expected = amax if expected is None else alpha * expected + (1 - alpha) * amax
        assert float(state) == pytest.approx(expected, rel=1e-6)


def test_zero_input_uses_eps_not_nan():
    q, new, scale, _ = online_quantize(jnp.zeros((4, 32)), None, eps=1e-6, interpret=True)
    assert np.all(np.asarray(q) == 0) and np.all(np.isfinite(np.asarray(scale)))
    np.testing.assert_allclose(new, 1e-6)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_cuda(cuda_lowering, per_channel, dtype):
    sds = jax.ShapeDtypeStruct
    shape = (4096, 4096) if per_channel else (300, 1000)
    state = sds((shape[1],) if per_channel else (), jnp.float32)
    cuda_lowering(lambda x, s: online_quantize(x, s, per_channel=per_channel), sds(shape, dtype), state)
