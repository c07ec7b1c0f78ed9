"""pallas_kernels/kv_words.py: the KV cache's codes as 32-bit words, read lane by lane as float16 operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.qarray import pack
from pallas_kernels import kv_words as kw
from tests.pallas_kernels.ptx import check_word_pair_asm


def _codes(bits, shape, seed=0):
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return jnp.asarray(np.random.default_rng(seed).integers(lo, hi + 1, shape), jnp.int8)


@pytest.mark.parametrize("bits", [8, 4])
def test_lanes_are_the_codes_plus_the_fold_exactly(bits):
    """Stored as the cache stores them (int8, or int4 packed two per byte), bitcast to words: lane j of word w
    is channel P w + j, as its exact float16 code."""
    codes = _codes(bits, (3, 64))
    stored = codes if bits == 8 else pack(codes, 4, -1)
    words = kw.as_words(stored, bits)
    p = kw.LANES[bits]
    assert words.shape == (3, 64 // p) and words.dtype == jnp.int32
    for j in range(p):
        got = kw.lane_values(words, j, bits)
        assert got.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(codes[:, j::p], np.float32))


@pytest.mark.parametrize("bits", [8, 4])
def test_channel_tile_is_the_codes_in_channel_order(bits):
    codes = _codes(bits, (16, 128), seed=1)
    stored = codes if bits == 8 else pack(codes, 4, -1)
    tile = kw.channel_tile(kw.as_words(stored, bits), bits, interpret=True)
    assert tile.shape == (16, 128) and tile.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(tile, np.float32), np.asarray(codes, np.float32))


@pytest.mark.parametrize("bits", [8, 4])
def test_lane_ptx_gives_the_jnp_bit_patterns_for_every_byte(bits):
    """The inline PTX (which runs only on a GPU), emulated: for each lane, every byte value of one word paired
    with every byte value of the other gives :func:`lane_values`' two float16 bit patterns."""
    for j in range(kw.LANES[bits]):
        check_word_pair_asm(kw.lane_asm(j, bits), lambda w, j=j: kw.lane_values(jnp.asarray(w), j, bits),
                            j if bits == 8 else j // 2)


def test_words_of_a_stacked_store_are_a_bitcast():
    """as_words of the cache's [L, B, H, T, D'] store traces to a reshape and a bitcast (no gather, no copy)."""
    store = jax.ShapeDtypeStruct((2, 1, 4, 64, 128), jnp.int8)
    text = str(jax.make_jaxpr(lambda s: kw.as_words(s, 8))(store))
    assert "bitcast_convert_type" in text and "gather" not in text and "transpose" not in text
