"""Scale codes: a row-major kernel's float scales found again as int8 codes times one float step per
super-block of 256 values (a GGUF K-quant's sub-block and super-block scales), and the native decode
kernel reading them instead of the float scales -- the same products, bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import decode_layout, native
from llmeq_jax.core.qarray import QArray, pack
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.decode_layout import RowMajorKernel, ScaleCodes, compact_scales, scale_codes

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are CPU kernels"),
    pytest.mark.skipif(not native.available(), reason=f"native library: {native.unavailable_reason()}"),
]


def _k_quant_scales(rng, rows: int, groups: int, per_step: int, low: int, high: int) -> np.ndarray:
    """(rows, groups) float32 scales as a K-quant stores them: a float16 super-block scale ``d`` (some
    negative) times integer sub-block scales in [low, high]."""
    d = rng.normal(0, 1e-2, (rows, groups // per_step, 1)).astype(np.float16).astype(np.float32)
    sc = rng.integers(low, high + 1, (rows, groups // per_step, per_step)).astype(np.float32)
    return (d * sc).reshape(rows, groups)


def _row_major(rng, n: int, k: int, bits: int, group: int, zero_point: bool) -> QArray:
    """An (out, in) kernel as decode_layout lays one out for the native kernels, with K-quant scales."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    v = jnp.asarray(rng.integers(lo, hi + 1, (n, k)).astype(np.int8))
    per_step = decode_layout.SCALE_STEP_VALUES // group
    scale = _k_quant_scales(rng, n, k // group, per_step, -128 if bits > 4 else 0, 127 if bits > 4 else 63)
    zp = jnp.asarray(rng.uniform(-2, 2, (n, k // group)).astype(np.float32)) if zero_point else None
    return QArray(qvalue=pack(v, 4, axis=1) if bits == 4 else v, scale=jnp.asarray(scale), zero_point=zp,
                  bits=bits, shape=(n, k), tile=(1, group), dtype=jnp.float32, pack_axis=1)


def test_scale_codes_are_the_k_quant_scales_exactly():
    rng = np.random.default_rng(0)
    s = _k_quant_scales(rng, 64, 32, 16, -128, 127)
    s[0, :16] = 0.0  # a block of zero scales
    s[1, :16] = np.float32(-0.0078125) * np.arange(-128, 128, 16, dtype=np.float32)  # +1 with a negative d
    found = scale_codes(jnp.asarray(s), 16)
    assert found is not None and found.codes.dtype == jnp.int8 and found.steps.shape == (64, 2)
    np.testing.assert_array_equal(np.asarray(found.scales()), s)
    assert np.abs(np.asarray(found.codes, np.int32)).max() >= 64  # codes use the int8 range, not a coarse step
    # a stack [L, rows, groups] keeps its leading axis
    stacked = scale_codes(jnp.asarray(np.stack([s, 2 * s])), 16)
    assert stacked.codes.shape == (2, 64, 32) and stacked.steps.shape == (2, 64, 2)
    np.testing.assert_array_equal(np.asarray(stacked.scales())[1], 2 * s)


def test_float_scales_that_are_not_codes_stay_float():
    rng = np.random.default_rng(1)
    rtn = quantize(jnp.asarray(rng.normal(size=(256, 16)).astype(np.float32)),
                   Spec(bits=4, granularity="group", group_size=32))
    assert scale_codes(rtn.scale.T, 8) is None  # RTN's absmax / 7 per group: no common step with int8 codes
    s = _k_quant_scales(rng, 8, 16, 16, -128, 127)
    wide = s.copy()
    wide[3, 5] = s[3, 4] * 1000.0 + s[3, 5]  # one block whose values no 8-bit code range spans
    assert scale_codes(jnp.asarray(wide), 16) is None
    bad = s.copy()
    bad[2, 2] = np.nan
    assert scale_codes(jnp.asarray(bad), 16) is None
    assert scale_codes(jnp.asarray(s[:, :12]), 16) is None  # groups that no whole number of steps covers


@pytest.mark.parametrize("bits,group,zero_point", [(6, 16, False), (8, 32, False), (4, 32, True), (4, 16, False),
                                                   (4, 16, True)])
def test_the_kernel_reads_the_codes_and_gives_the_float_scales_products(bits, group, zero_point):
    """Q6_K (int6 in groups of 16, paired a step), Q5_K-like int8 in groups of 32, Q4_K (int4 g32 with float
    zero points), Q3_K / Q2_K (int4 slots in groups of 16, four a step): outputs equal to the last bit on the
    VNNI, AVX2 and portable paths; doubling the steps doubles them (the kernel reads the codes)."""
    rng = np.random.default_rng(bits * 100 + group)
    w = _row_major(rng, 45, 512, bits, group, zero_point)  # 45 rows: tiles of 4 and a tail of one
    codes = scale_codes(w.scale, decode_layout.SCALE_STEP_VALUES // group)
    assert codes is not None
    f = jax.jit(lambda x, a, c: native.row_major_matmul(x, a, codes=c))
    paths = [contextlib.nullcontext, native.without_vnni, native.force_scalar]
    for rows in (1, 3, 6):
        x = jnp.asarray(rng.normal(size=(rows, 512)).astype(np.float32))
        for path in paths:
            with path():
                want = np.asarray(jax.jit(lambda a, b: native.row_major_matmul(a, b) * 1.0)(x, w))
                got = np.asarray(jax.jit(lambda a, b, c: native.row_major_matmul(a, b, codes=c) * 1.0)(x, w, codes))
            np.testing.assert_array_equal(got, want, err_msg=f"{rows} rows")
        doubled = np.asarray(f(x, w, ScaleCodes(codes.codes, 2 * codes.steps)))
        symmetric = np.asarray(f(x, dataclasses.replace(w, zero_point=None), codes))
        if not zero_point:  # (with zero points, the offsets scale too: 2 x every term)
            np.testing.assert_allclose(doubled, 2 * symmetric, rtol=1e-6, atol=1e-6 * np.abs(symmetric).max())
        else:
            np.testing.assert_allclose(doubled, 2 * np.asarray(f(x, w, codes)), rtol=1e-6,
                                       atol=1e-6 * np.abs(doubled).max())


def test_a_layer_of_a_stack_reads_its_codes_in_place():
    rng = np.random.default_rng(3)
    layers = [_row_major(rng, 20, 256, 6, 16, False) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    codes = scale_codes(stack.scale, 16)
    x = jnp.asarray(rng.normal(size=(2, 256)).astype(np.float32))
    at = jax.jit(lambda a, b, l, c: native.row_major_matmul(a, b, layer=l, codes=c))
    for i, one in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(at(x, stack, jnp.int32(i), codes)),
                                      np.asarray(native.row_major_matmul(x, one)))


def test_codes_are_weight_only_and_steps_must_fit_the_codes():
    rng = np.random.default_rng(4)
    w = _row_major(rng, 8, 256, 8, 16, False)
    codes = scale_codes(w.scale, 16)
    with pytest.raises(ValueError, match="weight-only"):
        native.row_major_matmul(jnp.ones((1, 256)), w, Spec(bits=8, granularity="token"), codes=codes)
    uneven = ScaleCodes(codes.codes, jnp.ones((8, 3), jnp.float32))  # 16 groups do not split into 3 steps
    with pytest.raises(Exception, match="step_groups must divide the scale groups"):
        np.asarray(native.row_major_matmul(jnp.ones((1, 256)), w, codes=uneven))
    short = ScaleCodes(codes.codes, jnp.ones((7, 1), jnp.float32))  # a step for 7 of the 8 rows
    with pytest.raises(Exception, match="steps must be"):
        np.asarray(native.row_major_matmul(jnp.ones((1, 256)), w, codes=short))


def test_compact_scales_gives_codes_to_the_kernels_whose_scales_are_codes():
    rng = np.random.default_rng(5)
    k_quant = RowMajorKernel(_row_major(rng, 16, 256, 6, 16, False))
    rtn = RowMajorKernel(decode_layout.transpose_kernel(quantize(
        jnp.asarray(rng.normal(size=(256, 16)).astype(np.float32)), Spec(bits=4, granularity="group", group_size=32))))
    wide = RowMajorKernel(_row_major(rng, 16, 256, 4, 32, False))
    wide = RowMajorKernel(dataclasses.replace(wide.w, tile=(1, 64), scale=wide.w.scale[:, ::2]))  # groups of 64
    out = compact_scales({"a": {"kernel": k_quant}, "b": {"kernel": rtn}, "c": {"kernel": wide}, "n": jnp.ones(3)})
    assert isinstance(out["a"]["kernel"].codes, ScaleCodes)
    assert out["b"]["kernel"].codes is None and out["c"]["kernel"].codes is None
    assert compact_scales(out)["a"]["kernel"] is out["a"]["kernel"]  # idempotent
