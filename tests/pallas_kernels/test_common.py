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


def test_span_drops_the_mask_only_when_the_caller_says_every_index_is_in_bounds():
    ds, mask = common.span(16, 16, 40)
    np.testing.assert_array_equal(np.asarray(mask), np.arange(16, 32) < 40)
    assert common.span(16, 16, 48, in_bounds=True)[1] is None
    rows, cols = common.span(0, 4, 2), common.span(0, 8, 8, in_bounds=True)
    np.testing.assert_array_equal(np.asarray(common.tile_mask(rows, cols)), np.repeat([[1], [1], [0], [0]], 8, 1))
    assert common.tile_mask(common.span(0, 4, 4, in_bounds=True), cols) is None


@pytest.mark.parametrize("m,k,n,group", [(32, 256, 128, None), (32, 256, 128, 128), (3, 384, 128, 128)])
def test_matmuls_with_unmasked_tiles_match_their_references(m, k, n, group):
    """Shapes the blocks divide (every load unmasked), and K = 384 in K steps of 256 with groups of 128: the
    last step's second group lies past K and must stay masked."""
    from pallas_kernels.blocks import Blocks
    from pallas_kernels.w8a8 import w8a8_matmul, w8a8_reference
    from pallas_kernels.weight_only import weight_only_matmul, weight_only_reference

    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (m, k))
    groups = 1 if group is None else k // group
    s = jax.random.uniform(ks[2], (groups, n), minval=1e-3, maxval=1e-2)
    w8 = jax.random.randint(ks[1], (k, n), -127, 128).astype(jnp.int8)
    w4 = jax.random.randint(ks[3], (k // 2, n), 0, 256).astype(jnp.uint8)
    blocks = Blocks(16, 64, 256 if m == 3 else (group or 128))
    y = weight_only_matmul(x, w4, s, bits=4, group=group, blocks=blocks, k_splits=1, interpret=True)
    r = weight_only_reference(x, w4, s, bits=4, group=group)
    np.testing.assert_allclose(np.asarray(y), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
    if m != 3:  # W8A8 steps K by the group
        y = w8a8_matmul(x, w8, s, group=group, blocks=Blocks(16, 64, group or 128), k_splits=2, interpret=True)
        r = w8a8_reference(x, w8, s, group=group)
        np.testing.assert_allclose(np.asarray(y), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
