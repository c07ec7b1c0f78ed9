"""Split codes: int2-int6 row-major kernels stored as 2-6 bits a value (low bits and high bits apart,
each 256 values lane-interleaved) for the native AVX-512 VNNI decode tile, which reads them with the
same integer sums as the int8-stored (int4: two a byte; int2 / int3 in int4 slots) codes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import decode_layout, native, ops
from llmeq_jax.core.qarray import QArray, pack
from llmeq_jax.decode_layout import RowMajorKernel, join_codes, split_codes, split_rows
from llmeq_jax.layer_slice import LayerSlice

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are CPU kernels"),
    pytest.mark.skipif(not native.available(), reason=f"native library: {native.unavailable_reason()}"),
]


def _codes(rng, shape, bits: int) -> np.ndarray:
    return rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), shape).astype(np.int8)


def _kernel(rng, n: int, k: int, bits: int, group: int, zero_point: bool, lead=()) -> QArray:
    """An (out, in) weight-only kernel with ``bits``-bit codes stored as decode_layout lays one out (int4 two a
    byte along ``in``, 2- and 3-bit codes in int4 slots as GGUF Q2_K / Q3_K reach it, else int8)."""
    groups = -(-k // group)
    zp = jnp.asarray(rng.uniform(-3, 3, (*lead, n, groups)).astype(np.float32)) if zero_point else None
    codes = jnp.asarray(_codes(rng, (*lead, n, k), bits))
    return QArray(qvalue=pack(codes, 4, axis=codes.ndim - 1) if bits <= 4 else codes,
                  scale=jnp.asarray(rng.uniform(0.5, 2.0, (*lead, n, groups)).astype(np.float32)), zero_point=zp,
                  bits=max(bits, 4), shape=(n, k), tile=(1, min(group, k)), dtype=jnp.float32, pack_axis=1)


def _split(w: QArray, bits: int | None = None) -> QArray:
    """``w`` with its codes split in ``bits`` (default ``w.bits``) a value."""
    bits = bits or w.bits
    return dataclasses.replace(w, qvalue=decode_layout.split_qvalue(w.qvalue, w.bits, w.shape[1], bits), bits=bits)


def _stored_value(row: np.ndarray, bits: int, k: int) -> int:
    """Value ``k`` of one split row, read from the layout as documented (independent of join_codes)."""
    low = 4 if bits >= 4 else 2  # low bits: nibbles (int4-int6) or crumbs (int2 / int3), then the high ones
    h, block = bits - low, 8 * bits
    whole = len(row) // block * 64 // 256 * 256
    if k < whole:  # value 16i + 4b + j sits at position 64b + 4i + j of its 256
        c, v = divmod(k, 256)
        pos = c * 256 + 64 * (v // 4 % 4) + 4 * (v // 16) + v % 4
    else:
        pos = k
    b, q = divmod(pos, 64)
    base = row[b * block:(b + 1) * block].astype(np.int32)
    bits_low = (base[q % (8 * low)] >> (low * (q // (8 * low)))) & ((1 << low) - 1)
    high = (base[8 * low + q % (8 * h)] >> (h * (q // (8 * h)))) & ((1 << h) - 1) if h else 0
    return int(bits_low | (high << low)) - 2 ** (bits - 1)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("k", [64, 256, 576, 1024])
def test_split_codes_store_bits_per_value_in_the_documented_layout(bits, k):
    rng = np.random.default_rng(k + bits)
    v = _codes(rng, (3, k), bits)
    s = np.asarray(split_codes(jnp.asarray(v), bits))
    assert s.dtype == np.uint8 and s.shape == (3, k * bits // 8)
    for r in range(3):
        assert [_stored_value(s[r], bits, i) for i in range(k)] == v[r].tolist()
    np.testing.assert_array_equal(np.asarray(join_codes(jnp.asarray(s), bits, k)), v)
    # a stack [L, N, K] splits row by row
    stacked = np.asarray(split_codes(jnp.asarray(np.stack([v, v[::-1]])), bits))
    np.testing.assert_array_equal(stacked[1], s[::-1])


def test_split_codes_refuse_other_widths_and_lengths():
    with pytest.raises(ValueError, match="int2-int6"):
        split_codes(jnp.zeros((2, 64), jnp.int8), 8)
    with pytest.raises(ValueError, match="int2-int6"):
        split_codes(jnp.zeros((2, 64), jnp.int8), 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        split_codes(jnp.zeros((2, 96), jnp.int8), 6)


CASES = [  # n, k, bits, group, zero point
    (37, 256, 6, 16, False),   # Q6_K's grid
    (21, 512, 4, 32, True),    # Q4_K / Q4_1's
    (11, 576, 4, 16, False),   # Q3_K / Q2_K's in int4 slots, a 256 tail of 64 values
    (6, 1024, 4, 128, True),
    (16, 512, 5, 32, True),    # Q5_K / Q5_1's
    (9, 576, 5, 32, False),    # a 256 tail of 64 values
    (12, 320, 6, 64, True),
    (8, 768, 6, 128, False),
    (7, 1024, 5, 256, True),
    (6, 1536, 6, 512, False),  # a group over two interleaved 256s
    (5, 576, 6, 576, True),    # one scale a row: flush groups of 128, the last 64
    (4, 64, 5, 64, False),
    (11, 576, 2, 16, True),    # Q2_K's grid: 2-bit codes (in int4 slots) split in 2 bits
    (13, 512, 3, 16, False),   # Q3_K's: 3 bits
    (7, 1024, 2, 32, True),
    (6, 320, 3, 64, True),     # a 256 tail of 64 values
    (5, 512, 3, 512, False),   # one scale a row
]


@pytest.mark.parametrize("n,k,bits,group,zp", CASES)
def test_split_rows_give_the_int8_kernels_products(n, k, bits, group, zp):
    rng = np.random.default_rng(n * k)
    w = _kernel(rng, n, k, bits, group, zp)
    s = _split(w, bits)
    f = jax.jit(lambda x, a: native.row_major_matmul(x, a))
    g = jax.jit(lambda x, a: native.row_major_matmul(x, a, split=True))
    deq = np.asarray(w.dequantize())
    for m in (1, 2, 3, 4, 5, 9):
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        want = np.asarray(f(x, w))
        got = np.asarray(g(x, s))
        # the same exact integer sums; float32 scaling and reduction in another order
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(got, np.asarray(x) @ deq.T, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        with native.force_scalar():  # the portable loop reads split rows too
            scalar = np.asarray(jax.jit(lambda x, a: native.row_major_matmul(x, a, split=True) * 1.0)(x, s))
        np.testing.assert_allclose(scalar, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_split_rows_with_scale_codes_and_a_stacked_layer():
    rng = np.random.default_rng(3)
    d = rng.normal(0, 1e-2, (2, 24, 1)).astype(np.float16).astype(np.float32)
    scale = (d * rng.integers(-128, 128, (2, 24, 16))).reshape(2, 24, 16).astype(np.float32)  # K-quant scales
    stack = dataclasses.replace(_kernel(rng, 24, 256, 6, 16, False, lead=(2,)), scale=jnp.asarray(scale))
    codes = decode_layout.scale_codes(stack.scale, 16)
    assert codes is not None
    x = jnp.asarray(rng.standard_normal((1, 256)).astype(np.float32))
    at = jax.jit(lambda a, b, l, c: native.row_major_matmul(a, b, layer=l, codes=c, split=True))
    for layer in (0, 1):
        one = jax.tree.map(lambda a: a[layer], stack)
        want = np.asarray(native.row_major_matmul(x, one))
        got = np.asarray(at(x, _split(stack), jnp.int32(layer), codes))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # ops.linear on a LayerSlice of a split RowMajorKernel: the native kernel, and XLA through qarray()
    kernel = RowMajorKernel(_split(stack), codes, split=True)
    want = np.asarray(native.row_major_matmul(x, jax.tree.map(lambda a: a[1], stack)))
    for backend in ("auto", "xla"):
        y = jax.jit(lambda a, i: ops.linear(a, LayerSlice(kernel, i), backend=backend))(x, jnp.int32(1))
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_split_rows_converts_only_what_the_split_tile_takes():
    rng = np.random.default_rng(4)
    six = RowMajorKernel(_kernel(rng, 8, 256, 6, 16, False))
    eight = RowMajorKernel(_kernel(rng, 8, 256, 8, 16, False))
    four = RowMajorKernel(_kernel(rng, 8, 256, 4, 32, True))
    four_g128 = RowMajorKernel(_kernel(rng, 8, 256, 4, 128, False))  # measured no faster split
    odd_group = RowMajorKernel(_kernel(rng, 8, 384, 5, 96, False))  # 96 does not divide 256
    short = RowMajorKernel(_kernel(rng, 8, 96, 5, 32, False))  # K not a multiple of 64
    two = RowMajorKernel(_kernel(rng, 8, 256, 2, 16, True))  # Q2_K: 2-bit codes in int4 slots
    three = RowMajorKernel(_kernel(rng, 8, 256, 3, 16, False))  # Q3_K: 3-bit codes in int4 slots
    tree = {"a": {"kernel": six}, "b": {"kernel": eight}, "c": {"kernel": odd_group}, "d": {"kernel": short},
            "e": {"kernel": four}, "f": {"kernel": four_g128}, "g": {"kernel": two}, "h": {"kernel": three},
            "n": jnp.ones(3)}
    if not native.vnni():
        assert split_rows(tree) is tree or split_rows(tree)["a"]["kernel"] is six
        return
    out = split_rows(tree)
    a = out["a"]["kernel"]
    assert a.split and a.w.qvalue.dtype == jnp.uint8 and a.w.qvalue.shape == (8, 192)
    np.testing.assert_array_equal(np.asarray(a.qarray().qvalue), np.asarray(six.w.qvalue))
    e = out["e"]["kernel"]  # int4: two a byte again for the other paths
    assert e.split and e.w.bits == 4 and e.w.qvalue.shape == (8, 128)
    np.testing.assert_array_equal(np.asarray(e.qarray().qvalue), np.asarray(four.w.qvalue))
    for key, source, bits in (("g", two, 2), ("h", three, 3)):  # int4 slots holding 2 / 3 bits: split that narrow
        narrow = out[key]["kernel"]
        assert narrow.split and narrow.w.bits == bits and narrow.w.qvalue.shape == (8, 256 * bits // 8)
        joined = narrow.qarray()  # back in int4 slots for the other paths
        assert joined.bits == 4
        np.testing.assert_array_equal(np.asarray(joined.qvalue), np.asarray(source.w.qvalue))
        x = jnp.asarray(rng.standard_normal((3, 256)).astype(np.float32))
        want = np.asarray(ops.linear(x, source))
        for backend in ("auto", "xla"):
            got = np.asarray(jax.jit(lambda v, k: ops.linear(v, k, backend=backend))(x, narrow))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert all(out[key]["kernel"] is tree[key]["kernel"] for key in "bcdf")
    wide = split_rows(tree, rows=8)  # int4 splits for decode loops of up to 4 rows; int5 / int6 for any
    assert wide["e"]["kernel"] is four and wide["a"]["kernel"].split
    assert split_rows(out)["a"]["kernel"] is a  # idempotent
    with native.without_vnni():  # only the VNNI tile reads split rows: nothing is split without it
        assert split_rows(tree)["a"]["kernel"] is six
    x = jnp.asarray(rng.standard_normal((2, 256)).astype(np.float32))
    want = np.asarray(ops.linear(x, six))
    for backend in ("auto", "xla"):
        got = np.asarray(jax.jit(lambda v, k: ops.linear(v, k, backend=backend))(x, a))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_split_call_errors_name_what_was_wrong():
    rng = np.random.default_rng(5)
    w = _kernel(rng, 4, 384, 6, 96, False)
    x = jnp.ones((1, 384))
    with pytest.raises(ValueError, match="split codes need"):  # groups of 96 have no split tile
        native.row_major_matmul(x, dataclasses.replace(w, qvalue=jnp.zeros((4, 288), jnp.uint8)), split=True)
    w = _kernel(rng, 4, 256, 6, 16, False)
    with pytest.raises(ValueError, match="split codes need"):  # int8-stored codes passed as split
        native.row_major_matmul(jnp.ones((1, 256)), w, split=True)
