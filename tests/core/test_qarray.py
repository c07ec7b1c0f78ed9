"""QArray: packing, storage accounting (nbytes), dequantize, pytree behaviour, repr."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from llmeq_jax.core.qarray import (
    SUPPORTED_BITS,
    QArray,
    check_bits,
    expand_to,
    int_range,
    pack,
    tree_nbytes,
    unpack,
    packed_length,
    packing,
)
from llmeq_jax.core.quantize import Spec, quantize

PROPS = settings(max_examples=40, deadline=None)

# Jitted once per (shape, spec): far faster than eager op-by-op dispatch on CPU.
qz = jax.jit(quantize, static_argnums=1)
jpack = jax.jit(pack, static_argnums=(1, 2))
junpack = jax.jit(unpack, static_argnums=(1, 2, 3))


# --------------------------------------------------------------------------- packing


@st.composite
def int_values(draw):
    """(values, bits, axis): random signed ``bits``-bit integers of a small random shape."""
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    lo, hi = int_range(bits)
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=9))
    values = draw(hnp.arrays(np.int8, shape, elements=st.integers(lo, hi)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return values, bits, axis


@PROPS
@given(int_values())
def test_pack_unpack_round_trips(case):
    values, bits, axis = case
    packed = jpack(jnp.asarray(values), bits, axis)
    n = values.shape[axis]
    per_chunk, nbytes = packing(bits)
    assert packed.shape[axis] == math.ceil(n / per_chunk) * nbytes == packed_length(n, bits)
    assert packed.dtype == (jnp.int8 if per_chunk == 1 else jnp.uint8)
    back = junpack(packed, bits, axis, n)
    np.testing.assert_array_equal(np.asarray(back), values)


def test_pack_layout_is_low_bits_first_twos_complement():
    # 4-bit: [-1, 2] -> slot0 = 0xF (low nibble), slot1 = 0x2 (high nibble) -> 0x2F.
    packed = pack(jnp.array([-1, 2], jnp.int8), 4, 0)
    assert packed.tolist() == [0x2F]
    # 2-bit: [1, -2, 0, -1] -> 01, 10, 00, 11 from the low bits up -> 0b11_00_10_01.
    packed = pack(jnp.array([1, -2, 0, -1], jnp.int8), 2, 0)
    assert packed.tolist() == [0b11001001]
    # 3-bit: eight values in one 24-bit little-endian word, three bytes; a length that is not a
    # multiple of eight is zero-padded: [3, -4, 1] -> 011, 100, 001 -> 0b001_100_011 = 0x063.
    packed = pack(jnp.array([3, -4, 1], jnp.int8), 3, 0)
    assert packed.tolist() == [0x63, 0x00, 0x00]
    values = np.array([-1, 0, 1, 2, 3, -4, -3, -2], np.int8)
    word = sum((int(v) & 7) << (3 * i) for i, v in enumerate(values))
    assert pack(jnp.asarray(values), 3, 0).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]


@pytest.mark.parametrize("bits,per_chunk,nbytes", [(2, 4, 1), (3, 8, 3), (4, 2, 1), (5, 1, 1), (8, 1, 1)])
def test_packing_chunks(bits, per_chunk, nbytes):
    assert packing(bits) == (per_chunk, nbytes)
    # Stored bits per value: exactly `bits` for 2-4 (whole chunks), 8 for wider values.
    assert packed_length(8 * per_chunk, bits) * 8 == 8 * per_chunk * (bits if per_chunk > 1 else 8)


@pytest.mark.parametrize("bits", [0, 1, 9, 16, 4.0, "4", None, True])
def test_unsupported_bits_is_one_clear_error(bits):
    with pytest.raises(ValueError, match="not supported"):
        check_bits(bits)
    with pytest.raises(ValueError, match="not supported"):
        Spec(bits=bits)


# --------------------------------------------------------------------------- nbytes


def _rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


@pytest.mark.parametrize("k,n", [(64, 48), (576, 172), (37, 5)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_nbytes_of_packed_values(k, n, bits):
    """Per-channel weights: value bytes are 1/2 (4 bit), 3/8 (3 bit) or 1/4 (2 bit) of int8, rounded up
    to whole chunks per column."""
    q = qz(_rand((k, n)), Spec(bits=bits, granularity="channel"))
    per_chunk, nbytes = {2: (4, 1), 3: (8, 3), 4: (2, 1), 8: (1, 1)}[bits]
    value_bytes = math.ceil(k / per_chunk) * nbytes * n
    assert q.qvalue.size * q.qvalue.dtype.itemsize == value_bytes
    assert q.nbytes == value_bytes + n * 4  # one float32 scale per output channel
    assert tree_nbytes({"w": q}) == q.nbytes
    assert q.values().shape == (k, n)


@pytest.mark.parametrize("k,n,g", [(576, 40, 128), (172, 24, 64), (100, 8, 7), (300, 16, 128)])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (3, False), (2, True), (8, False)])
def test_nbytes_with_group_size_that_does_not_divide(k, n, g, bits, symmetric):
    assert k % g != 0
    q = qz(_rand((k, n)), Spec(bits=bits, granularity="group", group_size=g, symmetric=symmetric))
    groups = math.ceil(k / g)
    assert q.scale.shape == (groups, n)
    assert q.tile == (g, 1)
    value_bytes = packed_length(k, bits) * n
    meta_bytes = groups * n * (4 + (0 if symmetric else 1))
    assert q.nbytes == value_bytes + meta_bytes
    assert q.dequantize().shape == (k, n)


def test_int4_is_half_and_int2_a_quarter_of_int8():
    w = _rand((512, 256))
    nb = {b: qz(w, Spec(bits=b, granularity="channel")).qvalue.nbytes for b in (8, 4, 2)}
    assert nb[4] * 2 == nb[8]
    assert nb[2] * 4 == nb[8]


def test_tree_nbytes_counts_float_and_quantized_leaves():
    w = _rand((64, 32))
    tree = {"a": {"kernel": qz(w, Spec(bits=4, granularity="group", group_size=16))}, "b": jnp.ones(10)}
    assert tree_nbytes(tree) == tree["a"]["kernel"].nbytes + 40


# --------------------------------------------------------------------------- dequantize / values


def test_dequantize_matches_manual_formula_asymmetric_grouped():
    w = _rand((50, 6), seed=1)
    q = qz(w, Spec(bits=4, granularity="group", group_size=16, symmetric=False))
    vals = np.asarray(q.values(), np.float32)
    s = np.repeat(np.asarray(q.scale), 16, axis=0)[:50]
    zp = np.repeat(np.asarray(q.zero_point, np.float32), 16, axis=0)[:50]
    np.testing.assert_allclose(np.asarray(q.dequantize()), (vals - zp) * s, rtol=1e-6, atol=0)


def test_dequantize_dtype():
    q = qz(_rand((16, 8)).astype(jnp.bfloat16), Spec(bits=8))
    assert q.dtype == jnp.bfloat16
    assert q.dequantize().dtype == jnp.bfloat16
    assert q.dequantize(jnp.float32).dtype == jnp.float32


def test_expand_to_cuts_the_shorter_last_group():
    a = jnp.arange(3.0).reshape(3, 1)
    out = expand_to(a, (7, 2), (3, 2))
    np.testing.assert_array_equal(np.asarray(out)[:, 0], [0, 0, 0, 1, 1, 1, 2])


# --------------------------------------------------------------------------- pytree / repr


def test_qarray_is_a_pytree_with_static_metadata():
    q = qz(_rand((40, 12)), Spec(bits=4, granularity="group", group_size=16, symmetric=False))
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3  # qvalue, scale, zero_point (act_scale None is no leaf)
    q2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (q2.bits, q2.shape, q2.tile, q2.pack_axis) == (4, (40, 12), (16, 1), 0)
    # Passes through jit untouched and dequantizes the same inside.
    out = jax.jit(lambda a: a.dequantize())(q)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(q.dequantize()))
    # tree_map touches only the arrays.
    doubled = jax.tree_util.tree_map(lambda a: a, q)
    assert isinstance(doubled, QArray) and doubled.shape == q.shape


def test_repr_is_readable():
    q = qz(_rand((576, 64)), Spec(bits=4, granularity="group", group_size=128))
    r = repr(q)
    for part in ("int4", "symmetric", "(576, 64)", "group(0:128)", "scale=(5, 64)", f"nbytes={q.nbytes}"):
        assert part in r, (part, r)
    r8 = repr(qz(_rand((8, 4)), Spec(bits=8, granularity="tensor", symmetric=False)))
    assert "int8 asymmetric" in r8 and "per-tensor" in r8


def test_transpose_is_refused_clearly():
    q = qz(_rand((8, 4)), Spec(bits=8))
    with pytest.raises(TypeError, match="transpose"):
        q.T
