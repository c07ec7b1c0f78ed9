import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.blocks import MATMUL_TABLE, matmul_blocks
from pallas_kernels.common import high_nibble, low_nibble, pack_nibbles, round_half_even, split_pairs, interleave_pairs


def test_round_half_even_matches_jnp_round_including_ties():
    halves = np.arange(-20, 20) + 0.5
    rng = np.random.default_rng(0)
    near = np.nextafter(halves, np.inf), np.nextafter(halves, -np.inf)
    big = np.array([2.0**23 + 1, -(2.0**24) - 2, 1e30, -1e30, 0.0, -0.0, 0.49999997, -0.49999997])
    v = np.concatenate([halves, *near, rng.normal(size=500) * 300, big]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(round_half_even(jnp.asarray(v))), np.asarray(jnp.round(v)))


def test_nibbles_round_trip_every_pair():
    even, odd = np.meshgrid(np.arange(-8, 8), np.arange(-8, 8))
    b = pack_nibbles(jnp.asarray(even, jnp.int32), jnp.asarray(odd, jnp.int32))
    assert int(b.min()) >= 0 and int(b.max()) <= 255
    np.testing.assert_array_equal(low_nibble(b), even)
    np.testing.assert_array_equal(high_nibble(b), odd)


def test_nibble_layout_is_the_qarray_layout():
    from llmeq_jax.core.qarray import pack

    v = jnp.asarray(np.random.default_rng(1).integers(-8, 8, size=(10, 3)), jnp.int8)
    packed = pack(v, 4, axis=0).astype(jnp.int32)  # (5, 3): rows 2i (low) and 2i+1 (high)
    np.testing.assert_array_equal(low_nibble(packed), v[0::2])
    np.testing.assert_array_equal(high_nibble(packed), v[1::2])


def test_split_and_interleave_pairs_are_inverse():
    x = jnp.arange(24.0).reshape(3, 8)
    e, o = split_pairs(x)
    np.testing.assert_array_equal(e, x[:, 0::2])
    np.testing.assert_array_equal(o, x[:, 1::2])
    np.testing.assert_array_equal(interleave_pairs(e, o), x)


@pytest.mark.parametrize("m", [1, 16, 17, 300, 4096])
@pytest.mark.parametrize("group", [None, 32, 128])
def test_block_table_gives_powers_of_two_at_least_16(m, group):
    b = matmul_blocks(m, 11008, 4096, group)
    for size in (b.bm, b.bn, b.bk):
        assert common.is_pow2(size) and size >= common.MIN_DOT
    assert b.bk == (group or b.bk)
    assert b.bm <= max(16, common.next_pow2(m))
    assert len(MATMUL_TABLE) >= 2


def test_round_primitive_still_fails_triton_lowering():
    """Canary for the README's finding: if a JAX upgrade adds round_p, the workaround can go."""

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.round(x_ref[...])

    def f(x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=common.compiler_params()
        )(x)

    with pytest.raises(NotImplementedError, match="round"):
        jax.jit(f).trace(jnp.ones((16, 16))).lower(lowering_platforms=("cuda",))


def test_k_splits_only_for_small_grids():
    assert common.splits_for(1000, 64) == 1  # prefill: the (M, N) grid fills the GPU
    assert common.splits_for(64, 86) == 5  # decode 11008 -> 4096: 64 tiles x 5 splits
    assert common.splits_for(64, 8) == 2  # never below 4 K blocks per split
    assert common.splits_for(1, 3) == 1
