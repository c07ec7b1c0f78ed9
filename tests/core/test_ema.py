"""The pure EMA math of online activation scales."""

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core import ema


def test_update_follows_the_formula():
    s = ema.update(None, jnp.float32(4.0), 0.9)
    assert float(s) == 4.0  # first observation taken as is
    s = ema.update(s, jnp.float32(2.0), 0.9)
    assert np.isclose(float(s), 0.9 * 4.0 + 0.1 * 2.0)
    # an EMPTY state behaves like None (jit-able "nothing seen yet")
    assert float(ema.update(jnp.float32(ema.EMPTY), jnp.float32(3.0), 0.5)) == 3.0
    # an all-zero input keeps a positive range
    assert float(ema.update(None, jnp.float32(0.0), 0.9)) == ema.TINY
    assert np.isclose(float(ema.scale(jnp.float32(127.0))), 1.0)


def test_absmax_per_tensor_and_per_channel():
    x = jnp.array([[[1.0, -5.0], [2.0, 3.0]]])
    assert float(ema.absmax(x)) == 5.0
    np.testing.assert_array_equal(np.asarray(ema.absmax(x, per_channel=True)), [2.0, 5.0])


@pytest.mark.parametrize("bad", [1.0, -0.1, "0.9", True])
def test_bad_decay_is_named(bad):
    with pytest.raises(ValueError, match=r"not a decay in \[0, 1\)"):
        ema.check_alpha(bad)
