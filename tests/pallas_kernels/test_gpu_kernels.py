"""Every Pallas kernel compiled for the GPU (``interpret=False``) against its reference: ``gpu`` marker.

These run only where JAX's default backend is a GPU. Elsewhere ``tests/conftest.py``
deselects them at collection (they are not reported as skipped tests); the CPU tests
in tests/pallas_kernels cover interpret mode and the CUDA lowering there.

References run on the same GPU through XLA with ``jax.default_matmul_precision("highest")``
(so f32 dots are not TF32); the shapes include the CPU tests' ragged/edge cases
plus realistic LLM shapes. Each case passes when its max abs error is within
``rel * max |reference|`` (NaN never passes) and, for integer outputs, no element differs.

    pytest -m gpu tests/pallas_kernels/test_gpu_kernels.py [-k SUBSTRING]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import ops
from llmeq_jax.core.quantize import Spec, quantize
from pallas_kernels import config
from pallas_kernels.blocks import Blocks
from pallas_kernels.kv_cache import store_decode_attention, store_decode_attention_reference
from pallas_kernels.w8a8 import w8a8_matmul, w8a8_reference
from pallas_kernels.weight_only import weight_only_matmul, weight_only_reference

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# Relative tolerance (times max |reference|) by output dtype, as in tests/pallas_kernels.
REL = {F32: 1e-5, BF16: 2e-2, F16: 1e-2}

CASES = []
INTERPRET = False  # True runs the same cases in Pallas interpret mode (to check this file on a CPU; slow)
pytestmark = pytest.mark.gpu


def case(fn):
    CASES.append(fn)
    return fn


def compare(y, r, rel):
    """(max abs error, tolerance) with tolerance = rel * max |r|; NaN never passes."""
    y32, r32 = np.asarray(y, np.float32), np.asarray(r, np.float32)
    assert y32.shape == r32.shape, (y32.shape, r32.shape)
    err = float(np.max(np.abs(y32 - r32))) if y32.size else 0.0
    if not np.all(np.isfinite(y32)):
        err = float("nan")
    return err, rel * float(np.max(np.abs(r32)))


def reference(fn, *args, **kw):
    with jax.default_matmul_precision("highest"):
        return fn(*args, **kw)


# --------------------------------------------------------------------------- W8A8

W8A8_SHAPES = [  # (M, K, N, group, zero points, bias, static act scale, dtype)
    (1, 96, 80, None, False, False, False, F32),  # the CPU tests' ragged shapes
    (37, 130, 90, None, True, True, False, F32),
    (5, 100, 48, 32, True, False, False, F32),
    (20, 192, 40, 64, False, True, False, F32),
    (3, 300, 24, 128, False, False, False, F32),
    (4, 64, 24, None, False, False, True, F32),
    (6, 64, 40, None, False, True, False, F16),
    (1, 4096, 4096, None, False, False, False, BF16),  # decode row
    (300, 4096, 11008, 128, True, True, False, BF16),  # ragged M, groups, zp, bias
    (17, 11008, 4096, None, False, True, True, F32),  # static scale
    (2048, 4096, 4096, None, False, False, False, BF16),  # prefill (K-major weight tiles)
    (1030, 1000, 700, 128, True, True, False, F32),  # ragged, K-major weight tiles
]


def _w8a8_operands(m, k, n, group, zp, bias, static, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = (jax.random.normal(ks[0], (m, k)) * 2).astype(dtype)
    wq = jax.random.randint(ks[1], (k, n), -127, 128).astype(jnp.int8)
    groups = 1 if group is None else -(-k // group)
    s = jax.random.uniform(ks[2], (groups, n), minval=1e-3, maxval=1e-2)
    z = jax.random.randint(ks[3], (groups, n), -4, 5).astype(jnp.int8) if zp else None
    b = jax.random.normal(ks[4], (n,)) if bias else None
    a = jnp.float32(0.02) if static else None  # small: some activations clip
    return x, wq, s, dict(w_zero_point=z, bias=b, act_scale=a, group=group)


for _shape in W8A8_SHAPES:

    @case
    def _w8a8(shape=_shape):
        m, k, n, group, zp, bias, static, dtype = shape
        x, wq, s, kw = _w8a8_operands(*shape)
        y = jax.jit(lambda x, wq, s: w8a8_matmul(x, wq, s, interpret=INTERPRET, **kw))(x, wq, s)
        r = reference(w8a8_reference, x, wq, s, **kw)
        # f32: the CPU tests' 1e-6 plus room for one rounding tie of x / scale_x that
        # Triton's approximate f32 division may move by one step (see README).
        rel = 1e-5 if dtype == F32 else REL[dtype]
        flags = "".join(f for f, on in ((" zp", zp), (" bias", bias), (" static", static)) if on)
        return f"w8a8 M={m} K={k} N={n} group={group}{flags} {jnp.dtype(dtype).name}", *compare(y, r, rel), None


@case
def _w8a8_integer_exact():
    rng = np.random.default_rng(0)
    xi, wi = rng.integers(-127, 128, size=(9, 77)), rng.integers(-127, 128, size=(77, 40))
    y = w8a8_matmul(jnp.asarray(xi, F32), jnp.asarray(wi, jnp.int8), jnp.ones((1, 40)), act_scale=1.0, interpret=INTERPRET)
    return "w8a8 integer path exact (9x77x40)", *compare(y, (xi @ wi).astype(np.float32), 0.0), None


HOPPER_W8A8 = [  # (M, K, N, layer of a stack of 3 or None, bias, static act scale, dtype): pallas_kernels.w8a8_hopper
    (2048, 4096, 11008, None, False, False, BF16),  # the sweep's weight at prompt rows: the reference's bits
    (1000, 4096, 12288, 2, False, False, BF16),  # rows padded to the tile; a fused q/k/v of a stack, read in place
    (300, 11008, 4096, None, True, True, F16),  # bias (a fused multiply-add may round once less), static scale
]

for _shape in HOPPER_W8A8:

    @case
    def _w8a8_hopper(shape=_shape):
        from pallas_kernels.w8a8 import w8a8_reference
        from pallas_kernels.w8a8_hopper import w8a8_hopper

        m, k, n, layer, bias, static, dtype = shape
        rng = np.random.default_rng(m)
        stack = jnp.asarray(rng.integers(-127, 128, (3, n, k)), jnp.int8)
        scales = jnp.asarray(rng.uniform(0.001, 0.01, (3, 1, n)), jnp.float32)
        x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
        b = jnp.linspace(-1, 1, n).astype(dtype) if bias else None
        act = 0.03 if static else None
        one = 0 if layer is None else layer
        if layer is None:
            y = jax.jit(lambda x, w, s: w8a8_hopper(x, w, s, bias=b, act_scale=act))(x, stack[0], scales[0])
        else:
            y = jax.jit(lambda x, w, s, i: w8a8_hopper(x, w, s, layer=i, act_scale=act))(x, stack, scales,
                                                                                           jnp.int32(layer))
        # jitted as the kernel's quantization of x is (XLA may compile x / scale_x to a multiply by its reciprocal)
        r = jax.jit(lambda x, w, s: w8a8_reference(x, w, s, bias=b, act_scale=act))(x, stack[one].T, scales[one])
        err, tol = compare(y, r, 0.0 if b is None else float(jnp.finfo(dtype).eps))
        label = f"w8a8 hopper M={m} K={k} N={n} layer={layer} bias={bias} static={static} {jnp.dtype(dtype).name}"
        return label, err, tol, None


HOPPER_FP8 = [  # (M, K, N, layer of a stack of 3 or None, dtype): pallas_kernels.w8a8_hopper with fp8=True
    (2048, 11008, 4096, None, BF16),  # the longest K: Hopper's FP8 accumulation without promotion would show here
    (1000, 4096, 12288, 2, F16),  # rows padded to the tile; a fused q/k/v of a stack, read in place
]

for _shape in HOPPER_FP8:

    @case
    def _fp8_hopper(shape=_shape):
        from llmeq_jax.core import fp8grid
        from pallas_kernels.w8a8 import w8a8_reference
        from pallas_kernels.w8a8_hopper import w8a8_hopper

        m, k, n, layer, dtype = shape
        ks = jax.random.split(jax.random.key(m), 2)
        stack = fp8grid.encode(jax.random.normal(ks[0], (3, n, k)) * 100)
        scales = jax.random.uniform(ks[1], (3, 1, n), minval=1e-3, maxval=1e-2)
        x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
        one = 0 if layer is None else layer
        if layer is None:
            y = jax.jit(lambda x, w, s: w8a8_hopper(x, w, s, fp8=True))(x, stack[0], scales[0])
        else:
            y = jax.jit(lambda x, w, s, i: w8a8_hopper(x, w, s, layer=i, fp8=True))(x, stack, scales, jnp.int32(layer))
        r = w8a8_reference(x, stack[one].T, scales[one], fp8=True)
        # exact float32 sums in the reference; the kernel's promoted ones within ~1e-4: one rounding of the dtype
        err, tol = compare(y, r, float(jnp.finfo(dtype).eps))
        return f"fp8 hopper M={m} K={k} N={n} layer={layer} {jnp.dtype(dtype).name}", err, tol, None


DECODE_W8A8 = [  # (M, K, N, fp8, layer of a stack of 3 or None, dtype): decode_hopper.w8a8_decode_hopper
    (1, 4096, 12288, False, 2, BF16),  # batch-1 decode, a fused q/k/v of a stack read in place: the reference's bits
    (16, 11008, 4096, False, None, F16),  # 43 steps in uneven K splits
    (1, 4096, 22016, True, 1, BF16),  # FP8, a fused gate/up of a stack
    (12, 11008, 4096, True, None, BF16),  # FP8, the longest K (sums promoted every 128 values); x padded to 16
]

for _shape in DECODE_W8A8:

    @case
    def _w8a8_decode_hopper(shape=_shape):
        from llmeq_jax.core import fp8grid
        from pallas_kernels.decode_hopper import w8a8_decode_hopper
        from pallas_kernels.w8a8 import w8a8_reference

        m, k, n, fp8, layer, dtype = shape
        ks = jax.random.split(jax.random.key(m + k), 3)
        stack = (fp8grid.encode(jax.random.normal(ks[0], (3, n, k)) * 100) if fp8
                 else jax.random.randint(ks[0], (3, n, k), -127, 128).astype(jnp.int8))
        scales = jax.random.uniform(ks[1], (3, 1, n), minval=1e-3, maxval=1e-2)
        x = jax.random.normal(ks[2], (m, k)).astype(dtype)
        one = 0 if layer is None else layer
        if layer is None:
            y = jax.jit(lambda x, w, s: w8a8_decode_hopper(x, w, s, fp8=fp8))(x, stack[0], scales[0])
        else:
            y = jax.jit(lambda x, w, s, i: w8a8_decode_hopper(x, w, s, layer=i, fp8=fp8))(x, stack, scales,
                                                                                            jnp.int32(layer))
        # jitted as the kernel's quantization of x is: XLA may compile x / scale_x to a multiply by its reciprocal,
        # which moves a code at a rounding boundary
        r = jax.jit(lambda x, w, s: w8a8_reference(x, w, s, fp8=fp8))(x, stack[one].T, scales[one])
        # int8: exact int32 sums, the reference's bits; FP8: promoted float32 sums, one rounding of the dtype
        err, tol = compare(y, r, float(jnp.finfo(dtype).eps) if fp8 else 0.0)
        label = f"w8a8 decode hopper M={m} K={k} N={n} fp8={fp8} layer={layer} {jnp.dtype(dtype).name}"
        return label, err, tol, None


def _stacked_scales_and_x(rng, m, k, n, groups, zp, bias, dtype):
    """A stack of 3 layers' scales (and zero points) for a weight-only kernel's case, x and the bias."""
    scales = jnp.asarray(rng.uniform(0.001, 0.01, (3, groups, n)), jnp.float32)
    zeros = jnp.asarray(rng.integers(-4, 5, (3, groups, n)), jnp.int8) if zp else None
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    return scales, zeros, x, (jnp.linspace(-1, 1, n).astype(dtype) if bias else None)


HOPPER_WEIGHT_ONLY = [  # (M, K, N, group, zero points, layer of a stack of 3 or None, bias, dtype, bits):
    # pallas_kernels.weight_only_hopper over int8 (K, N) codes or int4 pairs packed along K
    (2048, 4096, 11008, None, True, None, False, BF16, 8),  # the sweep's weight, per channel with zero points
    (1000, 4096, 4096, 128, True, 1, False, BF16, 8),  # rows padded to the tile; groups; a layer of a stack in place
    (300, 11008, 4096, None, False, None, True, F16, 8),  # symmetric, bias
    (2048, 4096, 11008, 128, False, None, False, BF16, 4),  # rtn-w4-g128's prompt product
    (1000, 4096, 14336, 128, True, 2, True, BF16, 4),  # zero points, a layer of a stack, bias
]

for _shape in HOPPER_WEIGHT_ONLY:

    @case
    def _weight_only_hopper(shape=_shape):
        from pallas_kernels.weight_only_hopper import weight_only_hopper

        m, k, n, group, zp, layer, bias, dtype, bits = shape
        rng = np.random.default_rng(m)
        groups = 1 if group is None else k // group
        if bits == 8:
            stack = jnp.asarray(rng.integers(-127, 128, (3, k, n)), jnp.int8)
        else:  # any byte is two int4 codes
            stack = jnp.asarray(rng.integers(0, 256, (3, k // 2, n)), jnp.uint8)
        scales, zeros, x, b = _stacked_scales_and_x(rng, m, k, n, groups, zp, bias, dtype)
        one = 0 if layer is None else layer
        z_one = None if zeros is None else zeros[one]
        if layer is None:
            y = jax.jit(lambda x, w, s, z: weight_only_hopper(x, w, s, zero_point=z, group=group, bias=b, bits=bits))(
                x, stack[0], scales[0], z_one)
        else:
            y = jax.jit(lambda x, w, s, z, i: weight_only_hopper(x, w, s, zero_point=z, group=group, bias=b, layer=i,
                                                                 bits=bits))(x, stack, scales, zeros, jnp.int32(layer))
        r = reference(weight_only_reference, x, stack[one], scales[one], bits=bits, w_zero_point=z_one, bias=b,
                      group=group)
        label = f"weight-only hopper int{bits} M={m} K={k} N={n} group={group} zp={zp} layer={layer} bias={bias} " \
                f"{jnp.dtype(dtype).name}"
        return label, *compare(y, r, REL[dtype]), None


HOPPER_DECODE = [  # (M, K, N, group, zero points, layer of a stack of 3 or None, bias, dtype, bits):
    # pallas_kernels.decode_hopper over (N, K) int4 or int8 rows, its Mosaic GPU register layouts (interpret mode
    # simulates none)
    (1, 4096, 4096, 128, True, None, False, BF16, 4),  # issue #15's batch-1 row, rtn-w4-g128's zero points
    (16, 4096, 11008, 128, False, 1, False, BF16, 4),  # 16 rows, a layer of a stack in place
    (12, 11008, 4096, 128, True, 2, True, F16, 4),  # 43 steps of 256 in 4 uneven splits, bias; x padded to 16
    (3, 4096, 12288, None, True, None, False, BF16, 4),  # per channel (one group over K)
    (1, 4096, 22016, None, False, 1, False, BF16, 8),  # rtn-w8's gate/up: per channel, symmetric, a stacked layer
    (16, 11008, 4096, 128, True, None, True, F16, 8),  # groups, zero points (|q - z| up to 255), bias
]

for _shape in HOPPER_DECODE:

    @case
    def _decode_hopper(shape=_shape):
        from llmeq_jax.core.qarray import pack
        from pallas_kernels.decode_hopper import decode_hopper, transpose_codes

        m, k, n, group, zp, layer, bias, dtype, bits = shape
        rng = np.random.default_rng(m + k)
        groups = 1 if group is None else k // group
        codes = jnp.asarray(rng.integers(-8, 8, (3, k, n)) if bits == 4 else rng.integers(-127, 128, (3, k, n)),
                            jnp.int8)
        scales, zeros, x, b = _stacked_scales_and_x(rng, m, k, n, groups, zp, bias, dtype)
        one = 0 if layer is None else layer
        z_one = None if zeros is None else zeros[one]
        rows = transpose_codes(codes) if bits == 4 else jnp.swapaxes(codes, -1, -2)
        if layer is None:
            y = jax.jit(lambda x, w, s, z: decode_hopper(x, w, s, zero_point=z, group=group, bias=b))(
                x, rows[0], scales[0], z_one)
        else:
            y = jax.jit(lambda x, w, s, z, i: decode_hopper(x, w, s, zero_point=z, group=group, bias=b,
                                                            layer=i))(x, rows, scales, zeros, jnp.int32(layer))
        stored = pack(codes[one], 4, axis=0) if bits == 4 else codes[one]
        r = reference(weight_only_reference, x, stored, scales[one], bits=bits, w_zero_point=z_one, bias=b,
                      group=group)
        label = f"decode hopper int{bits} M={m} K={k} N={n} group={group} zp={zp} layer={layer} bias={bias} " \
                f"{jnp.dtype(dtype).name}"
        return label, *compare(y, r, REL[dtype]), None


FP8_SHAPES = [  # (M, K, N, group, static act scale, dtype): FP8 (E4M3) W8A8, sm_89+
    (1, 96, 80, None, False, F32),
    (37, 130, 90, 32, True, F32),
    (1, 4096, 11008, None, False, BF16),  # decode row
    (2048, 4096, 4096, None, False, BF16),  # prefill (K-major weight tiles)
    (1030, 1000, 700, 128, False, BF16),  # ragged, groups, K-major
]

for _shape in FP8_SHAPES:

    @case
    def _fp8(shape=_shape):
        from llmeq_jax.core import fp8grid

        m, k, n, group, static, dtype = shape
        ks = jax.random.split(jax.random.key(7), 3)
        x = (jax.random.normal(ks[0], (m, k)) * 2).astype(dtype)
        wq = fp8grid.encode(jax.random.normal(ks[1], (k, n)) * 100)
        s = jax.random.uniform(ks[2], (1 if group is None else -(-k // group), n), minval=1e-3, maxval=1e-2)
        kw = dict(act_scale=jnp.float32(0.02) if static else None, group=group)
        y = jax.jit(lambda x, wq, s: w8a8_matmul(x, wq, s, fp8=True, interpret=INTERPRET, **kw))(x, wq, s)
        r = w8a8_reference(x, wq, s, fp8=True, **kw)
        return (f"fp8 w8a8 M={m} K={k} N={n} group={group}{' static' if static else ''} {jnp.dtype(dtype).name}",
                *compare(y, r, 1e-5 if dtype == F32 else REL[dtype]), None)


# --------------------------------------------------------------------------- weight-only

WO_SHAPES = [  # (M, K, N, bits, group, symmetric, dtype)
    (1, 100, 70, 8, None, True, F32),  # the CPU tests' cases
    (37, 130, 90, 4, 32, False, F32),
    (5, 127, 33, 4, 64, True, BF16),  # odd K
    (3, 300, 40, 4, 128, False, F16),
    (20, 64, 33, 8, 32, False, F32),
    (1, 4096, 11008, 4, 128, False, BF16),  # decode
    (16, 11008, 4096, 4, None, True, BF16),
    (16, 4096, 4096, 8, None, True, BF16),
    (2048, 4096, 4096, 8, 64, False, BF16),  # prefill
    (512, 4096, 4096, 4, 128, True, BF16),
    (64, 4096, 4096, 8, None, True, F32),
]

def _weight_only_case(shape, gemv: bool):
    m, k, n, bits, group, symmetric, dtype = shape
    spec = Spec(bits=bits, granularity="group" if group else "channel", group_size=group, symmetric=symmetric)
    q = quantize(jax.random.normal(jax.random.key(3), (k, n)), spec)
    x = jax.random.normal(jax.random.key(4), (m, k)).astype(dtype)
    kw = dict(bits=bits, w_zero_point=q.zero_point, group=group)
    y = jax.jit(lambda x, w, s: weight_only_matmul(x, w, s, gemv=gemv, interpret=INTERPRET, **kw))(x, q.qvalue, q.scale)
    r = reference(weight_only_reference, x, q.qvalue, q.scale, **kw)
    sym = "sym" if symmetric else "asym"
    return (f"weight-only{' gemv' if gemv else ''} int{bits} M={m} K={k} N={n} group={group} {sym} "
            f"{jnp.dtype(dtype).name}", *compare(y, r, 1e-5 if dtype == F32 else 8e-3), None)


for _shape in WO_SHAPES:

    @case
    def _weight_only(shape=_shape):
        return _weight_only_case(shape, gemv=False)


WO_GEMV = [  # the multiply-and-sum formulation (gemv=True), M <= 4
    (1, 4096, 11008, 4, 128, False, BF16),
    (4, 11008, 4096, 4, 128, True, F16),
    (1, 4096, 4096, 8, None, True, BF16),
    (3, 300, 90, 4, 32, False, F32),  # ragged
]

for _shape in WO_GEMV:

    @case
    def _weight_only_gemv(shape=_shape):
        return _weight_only_case(shape, gemv=True)


INT8_F16 = [  # (M, K, N, symmetric, dtype, blocks): int8 K-major with float16 operands (pallas_kernels/int8_f16.py)
    (1, 4096, 11008, True, BF16, None),  # inline PTX codes, bf16 x scaled into float16
    (16, 11008, 4096, False, BF16, (16, 512, 128, 4, 3)),  # zero points, the sweep's widest tiles
    (4, 4096, 4096, True, F16, (16, 256, 256, 4, 3)),
    (3, 300, 90, False, BF16, (16, 64, 64, 4, 3)),  # ragged
]

for _shape in INT8_F16:

    @case
    def _int8_f16(shape=_shape):
        m, k, n, symmetric, dtype, blocks = shape
        q = quantize(jax.random.normal(jax.random.key(9), (k, n)), Spec(bits=8, granularity="channel",
                                                                        symmetric=symmetric))
        x = jax.random.normal(jax.random.key(10), (m, k)).astype(dtype)
        kw = dict(bits=8, w_zero_point=q.zero_point)
        y = jax.jit(lambda x, w, s: weight_only_matmul(x, w, s, w_layout="nk", dequant="f16", interpret=INTERPRET,
                                                       blocks=blocks and Blocks(*blocks), **kw))(x, q.qvalue.T, q.scale)
        r = reference(weight_only_reference, x, q.qvalue, q.scale, **kw)
        sym = "sym" if symmetric else "asym"
        return (f"weight-only int8 K-major f16 operands M={m} K={k} N={n} {sym} {jnp.dtype(dtype).name} "
                f"blocks={blocks}", *compare(y, r, 8e-3), None)


WO_DEQUANT = [  # (M, K, N, group, symmetric, dtype, dequant, strided x, blocks): int4's decode options
    (1, 4096, 11008, 128, False, BF16, "magic", False, None),
    (1, 4096, 11008, 128, False, BF16, "fold", True, None),
    (1, 4096, 11008, 128, False, BF16, "asm", False, None),  # inline PTX (emulated on CPU only)
    (16, 11008, 4096, 128, True, F16, "asm", False, (16, 256, 128, 4, 3)),
    (2048, 4096, 11008, 128, False, BF16, "scaled", False, None),  # 256-row prefill tiles
    (16, 11008, 4096, 128, True, BF16, "fold", False, (16, 128, 256, 4, 4)),
    (3, 300, 90, 32, False, F16, "fold", True, (16, 64, 64, 4, 3)),  # ragged
    (512, 4096, 4096, 128, False, BF16, "magic", True, None),
]

for _shape in WO_DEQUANT:

    @case
    def _weight_only_dequant(shape=_shape):
        m, k, n, group, symmetric, dtype, dequant, strided, blocks = shape
        q = quantize(jax.random.normal(jax.random.key(5), (k, n)),
                     Spec(bits=4, granularity="group", group_size=group, symmetric=symmetric))
        x = jax.random.normal(jax.random.key(6), (m, k)).astype(dtype)
        kw = dict(bits=4, w_zero_point=q.zero_point, group=group)
        opts = dict(dequant=dequant, strided_x=strided, blocks=blocks and Blocks(*blocks))
        y = jax.jit(lambda x, w, s: weight_only_matmul(x, w, s, interpret=INTERPRET, **opts, **kw))(x, q.qvalue, q.scale)
        r = reference(weight_only_reference, x, q.qvalue, q.scale, **kw)
        sym = "sym" if symmetric else "asym"
        return (f"weight-only int4 {dequant}{' strided-x' if strided else ''} M={m} K={k} N={n} group={group} {sym} "
                f"{jnp.dtype(dtype).name} blocks={blocks}", *compare(y, r, 8e-3), None)


WO_WORDS = [  # (M, K, N, group, symmetric, dtype, blocks[, epilogue]): int4 as words (pallas_kernels.int4_words)
    (1, 4096, 11008, 128, False, BF16, None),  # inline PTX nibbles
    (16, 11008, 4096, 128, True, F16, (16, 256, 128, 4, 3)),
    (4, 4096, 14336, 64, False, BF16, None),  # groups shorter than a word block
    (3, 300, 90, None, False, F32, None),  # ragged, per channel, float32 (no PTX)
    (1, 4096, 11008, 128, False, BF16, (16, 128, 256, 4, 3)),  # two word blocks an iteration (the words sweep's)
    (2, 4000, 4096, 128, False, BF16, (16, 128, 512, 4, 3)),  # four, the last K step past the words (masked)
    (1, 4096, 11008, 128, False, BF16, None, "mma"),  # scale / zero-point rows through dots
    (16, 11008, 4096, 64, False, F16, (16, 128, 256, 4, 3), "mma"),
]


def _words_case(m, k, n, group, symmetric, dtype):
    """(x, the int4 words, their scales, the kernels' keyword arguments, the reference product, a label) of one
    word-kernel case: random weights quantized to int4 with ``group``, packed as words."""
    from pallas_kernels.int4_words import int4_words_reference, pack_words

    spec = Spec(bits=4, granularity="group" if group else "channel", group_size=group, symmetric=symmetric)
    q = quantize(jax.random.normal(jax.random.key(7), (k, n)), spec)
    words = pack_words(q.values(), group)
    x = jax.random.normal(jax.random.key(8), (m, k)).astype(dtype)
    kw = dict(w_zero_point=q.zero_point, group=group)
    r = reference(int4_words_reference, x, words, q.scale, **kw)
    label = f"M={m} K={k} N={n} group={group} {'sym' if symmetric else 'asym'} {jnp.dtype(dtype).name}"
    return x, words, q.scale, kw, r, label


for _shape in WO_WORDS:

    @case
    def _int4_words(shape=_shape):
        from pallas_kernels.int4_words import int4_words_matmul

        *problem, blocks, epilogue = shape if len(shape) == 8 else (*shape, "rows")
        x, words, scale, kw, r, label = _words_case(*problem)
        y = jax.jit(lambda x, w, s: int4_words_matmul(x, w, s, blocks=blocks and Blocks(*blocks), interpret=INTERPRET,
                                                      epilogue=epilogue, **kw))(x, words, scale)
        return f"int4 words {label} blocks={blocks} epilogue={epilogue}", *compare(y, r, 8e-3), None


PREFILL_WORDS = [  # (M, K, N, group, symmetric, dtype, blocks or None): the prompt kernel over the words
    (2048, 4096, 11008, 128, False, BF16, None),  # 256-row tiles
    (512, 11008, 4096, 128, True, BF16, None),
    (300, 576, 200, 64, False, F16, None),  # ragged M, K, N; groups shorter than a word block
    (1000, 4096, 4096, None, False, BF16, (128, 64, 128, 4, 3)),  # per channel, one warpgroup
]

for _shape in PREFILL_WORDS:

    @case
    def _int4_words_prefill(shape=_shape):
        from pallas_kernels.int4_words_prefill import int4_words_prefill

        *problem, blocks = shape
        x, words, scale, kw, r, label = _words_case(*problem)
        y = jax.jit(lambda x, w, s: int4_words_prefill(x, w, s, blocks=blocks and Blocks(*blocks), interpret=INTERPRET,
                                                       **kw))(x, words, scale)
        return f"int4 prefill words {label} blocks={blocks}", *compare(y, r, 8e-3), None


FLOAT_STACK = [  # (M, K, N, dtype): pallas_kernels.float_matmul reading layer 2 of a stack of 3
    (1, 4096, 11008, BF16),
    (16, 11008, 4096, F16),
    (3, 300, 90, F32),  # ragged, TF32x3
]

for _shape in FLOAT_STACK:

    @case
    def _float_stack(shape=_shape):
        from pallas_kernels.float_matmul import float_matmul

        m, k, n, dtype = shape
        stack = (jax.random.normal(jax.random.key(11), (3, k, n)) * 0.02).astype(dtype)
        x = jax.random.normal(jax.random.key(12), (m, k)).astype(dtype)
        y = jax.jit(lambda x, w, i: float_matmul(x, w, layer=i, interpret=INTERPRET))(x, stack, jnp.int32(2))
        r = reference(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), x, stack[2])
        return f"float matmul layer 2 of 3 M={m} K={k} N={n} {jnp.dtype(dtype).name}", *compare(y, r, REL[dtype]), None


RMS_NORM = [  # (M, K, stacked scale, dtype): pallas_kernels.rms_norm, on by default in a GPU's decode steps
    (1, 4096, True, BF16),  # Llama-2-7B's batch-1 norm, its scale layer 2 of a stack of 3
    (16, 576, False, BF16),  # SmolLM2's width (not a power of two: masked), 16 rows
    (5, 11008, True, F32),
]

for _shape in RMS_NORM:

    @case
    def _rms_norm(shape=_shape):
        from pallas_kernels.rms_norm import rms_norm, rms_norm_reference

        m, k, stacked, dtype = shape
        scales = jax.random.uniform(jax.random.key(13), (3, k), minval=0.5, maxval=1.5)
        x = (jax.random.normal(jax.random.key(14), (m, k)) * 3).astype(dtype)
        if stacked:
            y = jax.jit(lambda x, s, i: rms_norm(x, s, 1e-5, layer=i, interpret=INTERPRET))(x, scales, jnp.int32(2))
        else:
            y = jax.jit(lambda x, s: rms_norm(x, s, 1e-5, interpret=INTERPRET))(x, scales[2])
        r = rms_norm_reference(x, scales[2], 1e-5)
        label = f"rms_norm M={m} K={k}{' layer 2 of 3' if stacked else ''} {jnp.dtype(dtype).name}"
        return label, *compare(y, r, REL[dtype]), None


NORM_FOLD = [  # (kernel, M, K, N, scale dtype, K splits): pallas_kernels.norm_fold, layer 1 of a stack of 3
    ("words", 1, 4096, 12288, BF16, None),  # Llama-2-7B's fused q/k/v, the squares in the first column's programs
    ("words", 16, 4096, 22016, F32, None),  # gate/up, a batch of 16, the scale multiplied in float32
    ("words", 1, 4096, 4096, BF16, 1),  # no K split: every program scales its rows itself
    ("float", 1, 4096, 4096, BF16, None),
    ("float", 4, 5120, 13824, F32, 1),
    ("int8_f16", 1, 4096, 12288, BF16, None),  # rtn-w8's q/k/v: K-major int8 codes, float16 operands
    ("int8_f16", 16, 4096, 22016, F32, 1),
]

for _shape in NORM_FOLD:

    @case
    def _norm_fold(shape=_shape):
        from pallas_kernels.float_matmul import float_matmul
        from pallas_kernels.int4_words import int4_words_matmul, int4_words_reference, pack_words
        from pallas_kernels.norm_fold import NormFold
        from pallas_kernels.rms_norm import rms_norm_reference

        kernel, m, k, n, scale_dtype, splits = shape
        scales = jax.random.uniform(jax.random.key(15), (3, k), minval=0.5, maxval=1.5).astype(scale_dtype)
        x = (jax.random.normal(jax.random.key(16), (m, k)) * 3).astype(BF16)
        normed = rms_norm_reference(x, scales[1], 1e-5)
        if kernel == "words":
            spec = Spec(bits=4, granularity="group", group_size=128, symmetric=False)
            q = quantize(jax.random.normal(jax.random.key(17), (k, n)), spec)
            words = jnp.stack([pack_words(q.values(), 128)] * 3)
            stack = lambda a: jnp.stack([a] * 3)  # noqa: E731
            y = jax.jit(lambda x, w, s, z, g, i: int4_words_matmul(
                x, w, s, group=128, w_zero_point=z, layer=i, norm=NormFold(g, 1e-5), k_splits=splits,
                interpret=INTERPRET))(x, words, stack(q.scale), stack(q.zero_point), scales, jnp.int32(1))
            r = reference(int4_words_reference, normed, words[1], q.scale, w_zero_point=q.zero_point, group=128)
        elif kernel == "int8_f16":
            from pallas_kernels.int8_f16 import int8_f16_matmul

            q = jax.random.randint(jax.random.key(19), (3, n, k), -127, 128).astype(jnp.int8)  # K-major
            s = jax.random.uniform(jax.random.key(20), (3, 1, n), minval=1e-3, maxval=3e-3)
            y = jax.jit(lambda x, q, s, g, i: int8_f16_matmul(x, q, s, layer=i, norm=NormFold(g, 1e-5),
                                                              k_splits=splits, interpret=INTERPRET))(
                x, q, s, scales, jnp.int32(1))
            r = reference(lambda x, w: jnp.dot(x.astype(jnp.float32), w), normed, (q[1].astype(F32) * s[1].T).T)
        else:
            w = (jax.random.normal(jax.random.key(18), (3, k, n)) * 0.02).astype(BF16)
            y = jax.jit(lambda x, w, g, i: float_matmul(x, w, layer=i, norm=NormFold(g, 1e-5), k_splits=splits,
                                                        interpret=INTERPRET))(x, w, scales, jnp.int32(1))
            r = reference(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), normed, w[1])
        label = (f"norm folded into {kernel} M={m} K={k} N={n} scale {jnp.dtype(scale_dtype).name} "
                 f"splits={splits or 'auto'}")
        return label, *compare(y, r, 2e-2), None


SPLIT_FIXUP = [  # (kernel, M, K, N, K splits, norm folded): pallas_kernels.split_fixup, layer 1 of a stack of 3
    ("words", 1, 4096, 4096, None, False),  # Llama-2-7B's o projection, its residual added by the last program
    ("words", 16, 11008, 4096, None, False),  # down, a batch of 16
    ("words", 1, 4096, 12288, None, True),  # q/k/v with the norm folded: the last program sums x's squares
    ("words", 3, 4096, 4096, 1, False),  # no K split: every program finishes its tile
    ("float", 1, 4096, 4096, None, False),
    ("float", 1, 4096, 11008, 13, True),  # 13 asked for: 11 splits of 3 K blocks or fewer, the norm folded
]

for _shape in SPLIT_FIXUP:

    @case
    def _split_fixup(shape=_shape):
        from pallas_kernels import split_fixup
        from pallas_kernels.float_matmul import float_matmul
        from pallas_kernels.int4_words import int4_words_matmul, int4_words_reference, pack_words
        from pallas_kernels.norm_fold import NormFold
        from pallas_kernels.rms_norm import rms_norm_reference

        kernel, m, k, n, splits, folded = shape
        scales = jax.random.uniform(jax.random.key(25), (3, k), minval=0.5, maxval=1.5).astype(BF16)
        x = (jax.random.normal(jax.random.key(26), (m, k)) * 3).astype(BF16)
        residual = (jax.random.normal(jax.random.key(27), (m, n)) * 4).astype(BF16)
        norm = NormFold(scales, 1e-5) if folded else None
        x_in = rms_norm_reference(x, scales[1], 1e-5) if folded else x

        def finished(product, *operands):  # twice, the counters handed from the first call to the second
            with split_fixup.scope(split_fixup.zeros()) as held:
                first = product(*operands)
                second = product(*operands)
                return first, second, held.value

        if kernel == "words":
            spec = Spec(bits=4, granularity="group", group_size=128, symmetric=False)
            q = quantize(jax.random.normal(jax.random.key(28), (k, n)), spec)
            words = jnp.stack([pack_words(q.values(), 128)] * 3)
            stack = lambda a: jnp.stack([a] * 3)  # noqa: E731
            product = lambda x, w, s, z, r: int4_words_matmul(  # noqa: E731
                x, w, s, group=128, w_zero_point=z, layer=jnp.int32(1), norm=norm, residual=r, k_splits=splits,
                interpret=INTERPRET)
            y, y2, counters = jax.jit(lambda *a: finished(product, *a))(x, words, stack(q.scale),
                                                                         stack(q.zero_point), residual)
            r = reference(int4_words_reference, x_in, words[1], q.scale, w_zero_point=q.zero_point, group=128)
        else:
            w = (jax.random.normal(jax.random.key(29), (3, k, n)) * 0.02).astype(BF16)
            product = lambda x, w, r: float_matmul(x, w, layer=jnp.int32(1), norm=norm, residual=r,  # noqa: E731
                                                   k_splits=splits, interpret=INTERPRET)
            y, y2, counters = jax.jit(lambda *a: finished(product, *a))(x, w, residual)
            r = reference(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), x_in, w[1])
        r = r.astype(jnp.float32) + residual.astype(jnp.float32)
        label = (f"split sums finished by {kernel} M={m} K={k} N={n} splits={splits or 'auto'}"
                 f"{' norm folded' if folded else ''}")
        err, tol = compare(y, r, 2e-2)
        # the same sum in the same order whichever program came last; the counters left zero for the next kernel
        return label, err, tol, int(jnp.sum(y != y2)) + int(jnp.count_nonzero(counters))


SPLIT_FIXUP_SWIGLU = [  # (M, K, I, norm folded): Llama-2-7B's gate/up words paired, gated by the last programs
    (1, 4096, 11008, True), (16, 4096, 11008, False),
]

for _shape in SPLIT_FIXUP_SWIGLU:

    @case
    def _split_fixup_swiglu(shape=_shape):
        from llmeq_jax.decode_layout import int4_word_kernel, pair_swiglu
        from pallas_kernels import split_fixup
        from pallas_kernels.int4_words import int4_words_matmul, int4_words_reference
        from pallas_kernels.norm_fold import NormFold
        from pallas_kernels.rms_norm import rms_norm_reference

        m, k, i, folded = shape
        spec = Spec(bits=4, granularity="group", group_size=128, symmetric=False)
        q = quantize(jax.random.normal(jax.random.key(30), (k, 2 * i)), spec)
        joined = int4_word_kernel(q)
        w = pair_swiglu({"gate_up_proj": {"kernel": joined}})["gate_up_proj"]["kernel"].w
        scales = jax.random.uniform(jax.random.key(31), (k,), minval=0.5, maxval=1.5).astype(BF16)
        x = (jax.random.normal(jax.random.key(32), (m, k)) * 3).astype(BF16)
        norm = NormFold(scales, 1e-5) if folded else None

        def finished(x, words, scale, zp):
            with split_fixup.scope(split_fixup.zeros()) as held:
                y = int4_words_matmul(x, words, scale, group=128, w_zero_point=zp, norm=norm, act="swiglu",
                                      interpret=INTERPRET)
                return y, held.value

        y, counters = jax.jit(finished)(x, w.qvalue, w.scale, w.zero_point)
        x_in = rms_norm_reference(x, scales, 1e-5) if folded else x
        r = reference(int4_words_reference, x_in, joined.w.qvalue, q.scale, w_zero_point=q.zero_point, group=128)
        r = jax.nn.silu(r[:, :i].astype(jnp.float32)) * r[:, i:].astype(jnp.float32)
        label = f"split sums gated (SwiGLU pairs) by words M={m} K={k} I={i}{' norm folded' if folded else ''}"
        return label, *compare(y, r, 2e-2), int(jnp.count_nonzero(counters))


SPLIT_FIXUP_INT8_SWIGLU = [  # (kernel, M, K, I, norm folded): rtn-w8's gate/up rows paired, gated by the kernel
    ("int8_f16", 1, 4096, 11008, True), ("int8_f16", 16, 4096, 11008, False), ("weight_only", 1, 4096, 11008, False),
]

for _shape in SPLIT_FIXUP_INT8_SWIGLU:

    @case
    def _split_fixup_int8_swiglu(shape=_shape):
        from llmeq_jax.decode_layout import RowMajorKernel, pair_swiglu, transpose_kernel
        from pallas_kernels import split_fixup
        from pallas_kernels.norm_fold import NormFold
        from pallas_kernels.rms_norm import rms_norm_reference

        kernel, m, k, i, folded = shape
        q = quantize(jax.random.normal(jax.random.key(37), (k, 2 * i)), Spec(bits=8))
        w = pair_swiglu({"gate_up_proj": {"kernel": RowMajorKernel(transpose_kernel(q))}})["gate_up_proj"]["kernel"].w
        scales = jax.random.uniform(jax.random.key(38), (k,), minval=0.5, maxval=1.5).astype(BF16)
        x = (jax.random.normal(jax.random.key(39), (m, k)) * 3).astype(BF16)
        norm = NormFold(scales, 1e-5) if folded else None

        def finished(x, wq, scale):
            with split_fixup.scope(split_fixup.zeros()) as held:
                y = weight_only_matmul(x, wq, scale, bits=8, w_layout="nk", norm=norm, act="swiglu",
                                       dequant="f16" if kernel == "int8_f16" else None, interpret=INTERPRET)
                return y, held.value

        y, counters = jax.jit(finished)(x, w.qvalue, w.scale.T)
        x_in = rms_norm_reference(x, scales, 1e-5) if folded else x
        r = reference(weight_only_reference, x_in, q.qvalue, q.scale, bits=8)
        r = jax.nn.silu(r[:, :i].astype(jnp.float32)) * r[:, i:].astype(jnp.float32)
        label = f"split sums gated (SwiGLU pairs) by {kernel} M={m} K={k} I={i}{' norm folded' if folded else ''}"
        return label, *compare(y, r, 2e-2), int(jnp.count_nonzero(counters))


SPLIT_FIXUP_W8A8_SWIGLU = [  # (M, K, I, E4M3): rtn-w8a8's / fp8-w8a8's gate/up rows paired, gated by the W8A8 kernel
    (1, 4096, 11008, False), (16, 4096, 11008, True),
]

for _shape in SPLIT_FIXUP_W8A8_SWIGLU:

    @case
    def _split_fixup_w8a8_swiglu(shape=_shape):
        from llmeq_jax.decode_layout import RowMajorKernel, pair_swiglu, transpose_kernel
        from pallas_kernels import split_fixup

        m, k, i, fp8 = shape
        spec = Spec(bits=8, grid="fp8") if fp8 else Spec(bits=8)
        q = quantize(jax.random.normal(jax.random.key(42), (k, 2 * i)), spec)
        w = pair_swiglu({"gate_up_proj": {"kernel": RowMajorKernel(transpose_kernel(q))}})["gate_up_proj"]["kernel"].w
        x = (jax.random.normal(jax.random.key(43), (m, k)) * 3).astype(BF16)

        def finished(x, wq, scale):
            with split_fixup.scope(split_fixup.zeros()) as held:
                y = w8a8_matmul(x, wq, scale, w_layout="nk", fp8=fp8, act="swiglu", interpret=INTERPRET)
                return y, held.value

        y, counters = jax.jit(finished)(x, w.qvalue, w.scale.T)
        r = reference(w8a8_reference, x, q.qvalue, q.scale, fp8=fp8)
        r = jax.nn.silu(r[:, :i].astype(jnp.float32)) * r[:, i:].astype(jnp.float32)
        label = f"split sums gated (SwiGLU pairs) by w8a8 M={m} K={k} I={i}{' E4M3' if fp8 else ''}"
        return label, *compare(y, r, 2e-2), int(jnp.count_nonzero(counters))


TOKEN_CODES = [  # (M, K, norm folded, E4M3): rtn-w8a8's decode activations, Llama-2-7B's q/k/v (norm) and down
    # inputs; fp8-w8a8's q/k/v
    (1, 4096, True, False), (16, 11008, False, False), (2, 4096, True, True),
]

for _shape in TOKEN_CODES:

    @case
    def _token_codes(shape=_shape):
        from pallas_kernels.norm_fold import NormFold
        from pallas_kernels.token_codes import token_codes, token_codes_reference

        m, k, folded, fp8 = shape
        x = (jax.random.normal(jax.random.key(40), (m, k)) * 3).astype(BF16)
        scales = jax.random.uniform(jax.random.key(41), (3, k), minval=0.5, maxval=1.5).astype(BF16)
        # XLA's way jitted, as a model runs it (its simplifier multiplies by 1 / 127 where eager ops divide)
        reference = jax.jit(token_codes_reference, static_argnames="fp8")
        if folded:
            codes, sx = jax.jit(lambda x, s: token_codes(x, norm=NormFold(s, 1e-5), layer=jnp.int32(1), fp8=fp8,
                                                          interpret=INTERPRET))(x, scales)
            want_codes, want_sx = reference(x, NormFold(scales[1], 1e-5), fp8=fp8)
        else:
            codes, sx = jax.jit(lambda x: token_codes(x, fp8=fp8, interpret=INTERPRET))(x)
            want_codes, want_sx = reference(x, fp8=fp8)
        off = np.abs(np.asarray(codes, np.int32) - np.asarray(want_codes, np.int32))
        err, tol = compare(sx, want_sx, 1e-2 if folded else 1e-6)
        # without the norm the same arithmetic as XLA's: every code equal; with it, a code one step off where the
        # norm's sum in another order crosses a rounding boundary, one in a thousand at most (E4M3: bit patterns
        # one apart)
        too_many = int(off.max() > (1 if folded else 0) or off.mean() > (1e-3 if folded else 0))
        label = f"token_codes M={m} K={k}{' norm folded' if folded else ''}{' E4M3' if fp8 else ''}"
        return label, err, tol, too_many


SPLIT_FIXUP_INT8 = [  # (kernel, M, K, N): the K-major int8 kernels of rtn-w8 / rtn-w8a8, the residual added
    ("int8_f16", 1, 4096, 4096), ("weight_only", 1, 11008, 4096), ("w8a8", 16, 11008, 4096),
]

for _shape in SPLIT_FIXUP_INT8:

    @case
    def _split_fixup_int8(shape=_shape):
        from pallas_kernels import split_fixup

        kernel, m, k, n = shape
        wq = jax.random.randint(jax.random.key(33), (3, n, k), -127, 128).astype(jnp.int8)
        scale = jax.random.uniform(jax.random.key(34), (3, 1, n), minval=0.001, maxval=0.002)
        x = jax.random.normal(jax.random.key(35), (m, k)).astype(BF16)
        residual = (jax.random.normal(jax.random.key(36), (m, n)) * 4).astype(BF16)

        def product(x, r):
            if kernel == "w8a8":
                return w8a8_matmul(x, wq, scale, layer=jnp.int32(1), w_layout="nk", residual=r, interpret=INTERPRET)
            return weight_only_matmul(x, wq, scale, bits=8, layer=jnp.int32(1), w_layout="nk", residual=r,
                                      dequant="f16" if kernel == "int8_f16" else None, interpret=INTERPRET)

        def finished(x, r):
            with split_fixup.scope(split_fixup.zeros()) as held:
                return product(x, r), held.value

        y, counters = jax.jit(finished)(x, residual)
        r = jax.jit(product)(x, None).astype(jnp.float32) + residual.astype(jnp.float32)  # XLA's sum, then the add
        label = f"split sums finished by {kernel} M={m} K={k} N={n}, the residual added"
        return label, *compare(y, r, 2e-2), int(jnp.count_nonzero(counters))


SPLIT_FIXUP_ATTENTION = [  # (batch, heads, kv heads, slots): the float cache's attention, its splits merged in-kernel
    (1, 32, 32, 4096), (4, 32, 8, 8192),
]

for _shape in SPLIT_FIXUP_ATTENTION:

    @case
    def _split_fixup_attention(shape=_shape):
        from pallas_kernels import split_fixup
        from pallas_kernels.decode_attention import append_decode_attention, append_decode_attention_reference

        b, heads, kv, t = shape
        keys = jax.random.split(jax.random.key(37), 5)
        q = jax.random.normal(keys[0], (b, heads, 128)).astype(BF16)
        k_new, v_new = (jax.random.normal(key, (b, kv, 128)).astype(BF16) for key in keys[1:3])
        k_cache, v_cache = (jax.random.normal(key, (2, b, kv, t, 128)).astype(BF16) for key in keys[3:5])
        slot = jnp.int32(t - 100)
        allowed = jnp.broadcast_to(jnp.arange(t) <= t - 100, (b, t))

        def finished(q, kc, vc):
            with split_fixup.scope(split_fixup.zeros()) as held:
                out = append_decode_attention(q, k_new, v_new, kc, vc, slot, allowed, layer=jnp.int32(1),
                                              interpret=INTERPRET)
                return out[0], held.value

        y, counters = jax.jit(finished)(q, k_cache, v_cache)
        r = reference(append_decode_attention_reference, q, k_new, v_new, k_cache, v_cache, slot, allowed,
                      layer=jnp.int32(1))[0]
        label = f"float cache attention, splits merged in the kernel, batch {b}, {heads} heads over {kv}, {t} slots"
        return label, *compare(y, r, 2e-2), int(jnp.count_nonzero(counters))


@case
def _stacked_layer():
    """One layer of stacked weights read in place (the scan over stacked blocks): int4 weight-only and
    W8A8, against the same kernels on that layer's own arrays."""
    layers, k, n = 4, 4096, 11008
    qs = [quantize(jax.random.normal(jax.random.key(20 + i), (k, n)),
                   Spec(bits=4, granularity="group", group_size=128, symmetric=False)) for i in range(layers)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *qs)
    x = jax.random.normal(jax.random.key(8), (2, k)).astype(BF16)
    kw = dict(bits=4, group=128, interpret=INTERPRET)
    y = jax.jit(lambda x, s, l: weight_only_matmul(x, s.qvalue, s.scale, w_zero_point=s.zero_point, layer=l, **kw))(
        x, stack, jnp.int32(2))
    r = jax.jit(lambda x, q: weight_only_matmul(x, q.qvalue, q.scale, w_zero_point=q.zero_point, **kw))(x, qs[2])
    w8 = jax.random.randint(jax.random.key(9), (layers, k, n), -127, 128).astype(jnp.int8)
    s8 = jax.random.uniform(jax.random.key(10), (layers, 1, n), minval=1e-3, maxval=1e-2)
    y8 = jax.jit(lambda x, w, s, l: w8a8_matmul(x, w, s, layer=l, interpret=INTERPRET))(x, w8, s8, jnp.int32(3))
    r8 = jax.jit(lambda x, w, s: w8a8_matmul(x, w, s, interpret=INTERPRET))(x, w8[3], s8[3])
    err4, tol4 = compare(y, r, 1e-6)
    err8, tol8 = compare(y8, r8, 1e-6)
    # error over tolerance, the worse of the two (NaN never passes)
    return ("stacked layer 2 of 4 (int4 g128 asym) and layer 3 of 4 (W8A8), bf16 M=2, error / tolerance",
            float(np.max([err4 / tol4, err8 / tol8])), 1.0, None)


@case
def _stack_past_2gib(shape=(32, 22016, 4096)):
    """The last layer of an int8 K-major stack of 2.9 GB, Llama-2-7B's fused gate/up ([32, 22016, 4096]):
    its bytes lie past 2**31, where 32-bit offsets wrap (pallas_kernels.offsets; an illegal address on an
    H200 before). Both int8 decode kernels and W8A8, against XLA on that layer's own array."""
    layers, n, k = shape
    w = jax.random.randint(jax.random.key(30), (layers, n, k), -127, 128, dtype=jnp.int8)
    s = jax.random.uniform(jax.random.key(31), (layers, 1, n), minval=1e-3, maxval=1e-2)
    x = jax.random.normal(jax.random.key(32), (1, k)).astype(BF16)
    last = jnp.int32(layers - 1)
    r = reference(lambda x, w, s: jnp.dot(x.astype(F32), w.astype(F32).T) * s, x, w[-1], s[-1])
    worst = 0.0
    for dequant in (None, "f16"):
        y = jax.jit(lambda x, w, s, l, d=dequant: weight_only_matmul(
            x, w, s, bits=8, layer=l, w_layout="nk", dequant=d, interpret=INTERPRET))(x, w, s, last)
        worst = max(worst, np.divide(*compare(y, r, REL[BF16])))
    y8 = jax.jit(lambda x, w, s, l: w8a8_matmul(x, w, s, layer=l, w_layout="nk", interpret=INTERPRET))(x, w, s, last)
    r8 = jax.jit(lambda x, w, s: w8a8_matmul(x, w, s, w_layout="nk", interpret=INTERPRET))(x, w[-1], s[-1])
    worst = max(worst, np.divide(*compare(y8, r8, 1e-6)))
    del w
    name = f"the last layer of an int8 {list(shape)} stack (w8 K-major, int8_f16, W8A8), error / tolerance"
    return name, worst, 1.0, None


# --------------------------------------------------------------------------- KV cache

STORE_CASES = [  # (B, H_kv, G, T, D, bits, pre-RoPE keys, dtype) of kv.cache.QuantKVCache's store
    (2, 2, 3, 70, 64, 8, False, F32),  # the CPU tests' shapes
    (2, 2, 3, 70, 64, 4, True, F32),
    (1, 3, 3, 2048, 64, 4, True, F32),  # SmolLM2-135M's heads
    (2, 8, 4, 4096, 128, 8, True, BF16),
    (1, 8, 4, 32768, 128, 4, True, BF16),
    (4, 8, 4, 2048, 128, 4, False, F16),
    (1, 8, 4, 32768, 128, 8, False, BF16),  # the word path (bf16/f16 queries, post-RoPE) at bench_kernels' shape
    (1, 8, 4, 32768, 128, 4, False, BF16),
]


def _store_case(b, h, g, t, d, bits, rope, dtype):
    """A store written by the cache's own quantizers (llmeq_jax.kv.grid), a query, an allowed mask and RoPE positions."""
    from llmeq_jax.kv import grid as kvgrid

    ks = jax.random.split(jax.random.key(1), 4)
    k = jax.random.normal(ks[0], (b, h, t, d)) * jnp.linspace(0.5, 3, d) + jnp.linspace(-1, 1, d)
    v = jax.random.normal(ks[1], (b, h, t, d))
    hi = jnp.max(k, axis=(0, 2))[None, :, None]
    scale, lo = kvgrid.grid_from_range(jnp.min(k, axis=(0, 2))[None, :, None], hi, bits)
    kq, vq = kvgrid.quantize_per_channel(k, scale, lo, hi, bits, 0), kvgrid.quantize_per_token(v, bits, 0)
    extra = dict(allowed=jax.random.bernoulli(ks[2], 0.9, (b, t)).at[:, 0].set(True))  # no row left empty
    if rope:
        extra.update(slot_pos=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                     inv_freq=1.0 / 10000.0 ** (jnp.arange(0, d, 2) / d))
    q = jax.random.normal(ks[3], (b, h * g, d)).astype(dtype)
    return q, (kq.q, vq.q, scale, lo, vq.scale, vq.lo), extra


def _store_check(shape, attend, what):
    """(name, err, tol, None) of ``attend(q, *store, length, bits=, **extra)`` -> (out, lse) on a store case against
    the dequantizing reference; a log-sum-exp out of tolerance fails the case too."""
    b, h, g, t, d, bits, rope, dtype = shape
    q, store, extra = _store_case(*shape)
    length = jnp.array([t, t // 2 + 3, 1, t - 7][:b], jnp.int32)
    out, lse = jax.jit(lambda q, n, *a: attend(q, *a, n, bits=bits, **extra))(q, length, *store)
    ref, ref_lse = reference(store_decode_attention_reference, q, *store, length, bits=bits, **extra)
    rel = 1e-5 if dtype == F32 else REL[dtype]
    err, tol = compare(out, ref, rel)
    lse_err, lse_tol = compare(lse, ref_lse, rel)
    name = (f"{what} int{bits} {'pre' if rope else 'post'}-RoPE B={b} H_kv={h} G={g} T={t} D={d} "
            f"{jnp.dtype(dtype).name} (lse err {lse_err:.3g}, tol {lse_tol:.3g})")
    return name, err if lse_err <= lse_tol else float("nan"), tol, None


for _shape in STORE_CASES:

    @case
    def _store_decode(shape=_shape):
        return _store_check(shape, functools.partial(store_decode_attention, interpret=INTERPRET),
                            "store_decode_attention")


for _shape in [c for c in STORE_CASES if not c[6]]:  # post-RoPE keys

    @case
    def _store_xla(shape=_shape):
        """XLA's own dots over the codes (llmeq_jax.kv.store_attention), compiled by XLA for this GPU (a deviceless
        compile aborted in XLA's Triton tiling before the int4 bitcast got its barrier)."""
        from llmeq_jax.kv.store_attention import store_attention

        return _store_check(shape, store_attention, "store_attention (XLA)")


# half queries over stores with head_dim 128 and T a multiple of 128, keys stored after or before RoPE: the Mosaic GPU
# kernel's (approximate exp2, reciprocal, cos and sin on the device, interpret mode exact)
for _shape in [c for c in STORE_CASES if c[7] != F32 and c[4] == 128 and c[3] % 128 == 0] + \
        [(2, 32, 1, 4096, 128, 8, False, F16)]:  # Llama-2-7B's heads, one query head each

    @case
    def _kv_attention_hopper(shape=_shape):
        from pallas_kernels.kv_attention_hopper import kv_attention_hopper

        return _store_check(shape, kv_attention_hopper, "kv_attention_hopper (Mosaic GPU)")


for _bits in (8, 4):

    @case
    def _kv_attention_hopper_cache_step(bits=_bits):
        """The Mosaic GPU kernel with what a cache's decode step passes (pre-RoPE keys, the default spec): layer 1 of a
        stack read in place, every layer's per-row key grid, the step's byte mask and no length, 4 float sinks (row 1
        sees none) merged with the splits by merge_splits in bf16."""
        from pallas_kernels.kv_attention_hopper import kv_attention_hopper

        b, h, g, t, d = 2, 8, 4, 4096, 128
        q, (kc, vc, scale, lo, vs, vl), extra = _store_case(b, h, g, t, d, bits, True, BF16)
        stack = lambda a: jnp.stack([jnp.zeros_like(a), a])  # noqa: E731 -- layer 1 holds the store
        store = (*(stack(a) for a in (kc, vc)), *(stack(jnp.broadcast_to(a, (b, h, 1, d))) for a in (scale, lo)),
                 *(stack(a) for a in (vs, vl)))
        sink_kv = [jax.random.normal(jax.random.key(i), (2, b, h, 4, d)).astype(BF16) for i in (5, 6)]
        sinks = (*sink_kv, jnp.array([[True, True, False, True], [False] * 4]))
        allowed, rope = extra["allowed"].astype(jnp.int8), dict(slot_pos=extra["slot_pos"], inv_freq=extra["inv_freq"])
        out, lse = jax.jit(lambda q, *a: kv_attention_hopper(q, *a, None, bits=bits, allowed=allowed, layer=1,
                                                             sinks=sinks, out_dtype=BF16, **rope))(q, *store)
        ref, ref_lse = reference(store_decode_attention_reference, q, *store, t, bits=bits, allowed=allowed, layer=1,
                                 sinks=sinks, **rope)
        err, tol = compare(out, ref, REL[BF16])
        lse_err, lse_tol = compare(lse, ref_lse, REL[BF16])
        name = (f"kv_attention_hopper (Mosaic GPU) + merge_splits, a cache step's arguments: int{bits} pre-RoPE, "
                f"layer 1 of 2, sinks, B={b} H_kv={h} G={g} T={t} (lse err {lse_err:.3g}, tol {lse_tol:.3g})")
        return name, err if lse_err <= lse_tol else float("nan"), tol, None


@case
def _quantized_cache_decode():
    """Decode steps of a random Llama over a quantized cache: kernel (auto on a GPU) vs XLA (kernels off)."""
    from llmeq_jax import calibrate
    from llmeq_jax.kv import spec as kvspec
    from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params

    cfg = ModelConfig("llama", 512, 512, 2, 8, 4, 128, 1024, 1e-5, 4096, False)
    params = jax.tree.map(lambda a: a * 4, init_params(cfg, jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 1004), 0, cfg.vocab_size)
    kv = calibrate.make_kv_quantizer(kvspec.KVSpec(bits=4, window=32), cfg, params, np.asarray(tokens[:, :256]))

    def run():
        step = lambda p, t, m, c: forward_step(cfg, p, t, m, c)  # traced afresh under the caller's context
        cache = init_cache(cfg, 2, 1004, kv=kv)
        _, cache = jax.jit(step)(params, tokens[:, :1000], jnp.ones((2, 1000), jnp.int32), cache)
        outs, decode = [], jax.jit(step)
        for i in range(1000, 1004):
            logits, cache = decode(params, tokens[:, i : i + 1], jnp.ones((2, 1), jnp.int32), cache)
            outs.append(logits)
        return jnp.concatenate(outs, axis=1)

    with config.interpret(INTERPRET), jax.default_matmul_precision("highest"):
        got = run()
        with config.disabled():
            want = run()
    return "QuantKVCache int4 pre-RoPE w32 decode: kernel vs XLA, Llama 2x(8q/4kv x 128)", *compare(got, want, 1e-4), None


# (B, H, KV, S, D, dtype, splits, rope): Llama-2-7B's and Llama-3-8B's heads, one and several splits, a float32
# cache; RoPE in the kernel (the step's q and k before it) for the 7B models' steps
FLOAT_DECODE = [(1, 32, 32, 160, 128, BF16, None, False), (2, 32, 8, 2048, 128, BF16, None, False),
                (3, 8, 2, 700, 64, F32, 4, False), (16, 32, 8, 300, 128, BF16, 1, False),
                (1, 32, 32, 2048, 128, BF16, None, True), (16, 32, 8, 300, 128, BF16, None, True)]
for _shape in FLOAT_DECODE:

    @case
    def _float_decode_attention(shape=_shape):
        """A float cache's decode step (pallas_kernels.decode_attention: write the token, attend; with ``rope``, q
        and k rotated first by the step's tables) vs the reference, layer 1 of a stacked cache, the query at a slot in
        the middle, row 0 left-padded. The caches: the token written, nothing else (with RoPE, the key's features
        that differ from XLA's rotation by more than one bf16 rounding count too)."""
        from pallas_kernels.decode_attention import append_decode_attention, append_decode_attention_reference

        b, h, kv, s, d, dtype, splits, rope = shape
        keys = jax.random.split(jax.random.key(s), 6)
        k_cache, v_cache = (jax.random.normal(k, (2, b, kv, s, d)).astype(dtype) for k in keys[:2])
        q = jax.random.normal(keys[2], (b, h, d)).astype(dtype)
        k_new, v_new = (jax.random.normal(k, (b, kv, d)).astype(dtype) for k in keys[3:5])
        angles = jax.random.uniform(keys[5], (b, d // 2), minval=-2000.0, maxval=2000.0)
        tables = (jnp.cos(angles), jnp.sin(angles)) if rope else None
        slot = s * 2 // 3
        allowed = jnp.ones((b, s), bool).at[0, : slot // 4].set(False)
        out, kc, vc = jax.jit(lambda *a: append_decode_attention(*a, layer=jnp.int32(1), num_splits=splits,
                                                                 rope=tables, interpret=INTERPRET))(
            q, k_new, v_new, k_cache, v_cache, jnp.int32(slot), allowed)
        ref, ref_k, ref_v = reference(append_decode_attention_reference, q, k_new, v_new, k_cache, v_cache, slot,
                                      allowed, layer=1, rope=tables)
        ulp = 2.0 ** -7 * jnp.abs(ref_k.astype(jnp.float32)) if rope else 0.0  # an FMA contracted apart: one rounding
        same = int(jnp.sum(jnp.abs(kc.astype(jnp.float32) - ref_k.astype(jnp.float32)) > ulp) + jnp.sum(vc != ref_v))
        return (f"append_decode_attention B={b} H={h} KV={kv} S={s} D={d} {jnp.dtype(dtype).name} splits={splits}"
                f"{' rope' if rope else ''}", *compare(out, ref, REL[dtype]), same)


KV_APPEND = [(8, BF16), (4, BF16), (8, F32), (4, F16)]
for _append in KV_APPEND:

    @case
    def _kv_store_append(setting=_append):
        """A quantized cache's one-token write (pallas_kernels.kv_store_append) on the hardware: the codes and value
        grids bit for bit XLA's (div.rn.f32 by inline PTX, the float16 grid's rounding on the bit pattern), layer 1 of
        a stacked store of Llama-2-7B's heads, values from 1e-3 to 300."""
        from pallas_kernels.kv_store_append import store_append, store_append_reference

        bits, dtype = setting
        b, kv, s, d = 2, 32, 512, 128
        row = d if bits == 8 else d // 2
        rng = np.random.default_rng(bits)
        codes = jnp.asarray(rng.integers(0, 100, (2, b, kv, s, row)), jnp.int8 if bits == 8 else jnp.uint8)
        grid = jnp.asarray(rng.normal(size=(2, b, kv, s, 1)), jnp.float16)
        k = jnp.asarray(rng.normal(size=(b, kv, d)) * 3, dtype)
        v = jnp.asarray(rng.normal(size=(b, kv, d)) * np.geomspace(1e-3, 300, kv)[None, :, None], dtype)
        k_scale = jnp.asarray(np.abs(rng.normal(size=(1, kv, d))) * 0.05 + 1e-3, jnp.float32)
        k_lo = jnp.asarray(rng.normal(size=(1, kv, d)) - 3, jnp.float32)
        store = (codes, codes + 1, grid, grid * 2)
        got = jax.jit(lambda *a: store_append(*a, bits=bits, layer=jnp.int32(1), interpret=INTERPRET))(
            *store, k, v, k_scale, k_lo, jnp.int32(300))
        want = store_append_reference(*store, k, v, k_scale, k_lo, 300, bits=bits, layer=1)
        differ = sum(int(jnp.sum(jax.lax.bitcast_convert_type(g, jnp.uint16) != jax.lax.bitcast_convert_type(w, jnp.uint16)))
                     if g.dtype == jnp.float16 else int(jnp.sum(g != w)) for g, w in zip(got, want))
        return f"kv_store_append int{bits} {jnp.dtype(dtype).name} B={b} KV={kv} S={s} D={d}", 0.0, 0.0, differ


for _bits in (8, 4):

    @case
    def _kv_store_sinks(bits=_bits):
        """The quantized store's decode attention with 4 float sinks in its softmax (sinks=), pre-RoPE int8 / int4
        keys, bf16 query, layer 1 of a stacked store, 8 splits, vs the reference with the sinks beside the store."""
        from llmeq_jax.kv import grid as kvgrid
        from pallas_kernels.kv_cache import store_decode_attention, store_decode_attention_reference

        b, h, g, t, d, n = 1, 8, 4, 4096, 128, 4
        keys = jax.random.split(jax.random.key(bits), 5)
        k = jax.random.normal(keys[0], (b, h, t, d)) * jnp.linspace(0.5, 3, d)
        v = jax.random.normal(keys[1], (b, h, t, d))
        hi = jnp.max(k, axis=(0, 2))[None, :, None]
        scale, lo = kvgrid.grid_from_range(jnp.min(k, axis=(0, 2))[None, :, None], hi, bits)
        kq, vq = kvgrid.quantize_per_channel(k, scale, lo, hi, bits, 0), kvgrid.quantize_per_token(v, bits, 0)
        stacks = [jnp.stack([a, a]) for a in (kq.q, vq.q, vq.scale, vq.lo)]
        sinks = tuple(jax.random.normal(key, (2, b, h, n, d)).astype(BF16) * 3 for key in keys[2:4]) + (
            jnp.array([[True, True, False, True]]),)
        q = jax.random.normal(keys[4], (b, h * g, d)).astype(BF16)
        rope = dict(slot_pos=jnp.arange(t)[None] + n, inv_freq=1.0 / 10000 ** (jnp.arange(0, d, 2) / d))
        allowed = jnp.ones((b, t), bool).at[:, :n].set(False)
        length = jnp.array([t - 100])
        out, _ = jax.jit(lambda *a: store_decode_attention(*a, bits=bits, allowed=allowed, sinks=sinks,
                                                            layer=jnp.int32(1), num_splits=8, interpret=INTERPRET,
                                                            **rope))(q, stacks[0], stacks[1], scale, lo, stacks[2],
                                                                     stacks[3], length)
        ref, _ = reference(store_decode_attention_reference, q.astype(F32), stacks[0], stacks[1], scale, lo,
                           stacks[2], stacks[3], length, bits=bits, allowed=allowed, sinks=sinks, layer=1, **rope)
        return (f"store_decode_attention int{bits} pre-RoPE with 4 float sinks T={t}", *compare(out, ref, REL[BF16]),
                None)


# --------------------------------------------------------------------------- a prompt's attention (cuDNN)


for _kv in (32, 8):

    @case
    def _prompt_attention(kv=_kv):
        """A prompt's attention as cuDNN's flash attention (kv.attention.attention_flash: keys given as [B, S, KV, D],
        the mask as a bias) against XLA's in float32: Llama heads, two rows, causal with the second row left-padded;
        the compiled program holds cuDNN's fused attention."""
        from llmeq_jax.kv import attention

        b, t, h, d = 2, 512, 32, 128
        keys = jax.random.split(jax.random.key(kv), 3)
        q = jax.random.normal(keys[0], (b, t, h, d)).astype(BF16)
        k, v = (jax.random.normal(key, (b, kv, t, d)).astype(BF16) for key in keys[1:])
        pos = jnp.arange(t)
        mask = (pos[None, :, None] >= pos[None, None, :]) & (jnp.array([0, 37])[:, None, None] <= pos[None, None, :])
        flash = jax.jit(attention.attention_flash)
        assert attention.attention_flash(q, k, v, mask) is not None, "cuDNN refused the call on this GPU"
        assert "cudnn" in flash.lower(q, k, v, mask).compile().as_text().lower()
        ref = reference(attention.attention_xla, *(a.astype(F32) for a in (q, k, v)), mask)
        return (f"prompt attention cuDNN flash B={b} T={t} H={h} H_kv={kv} D={d} bf16", *compare(flash(q, k, v, mask),
                                                                                              ref, REL[BF16]), None)


# --------------------------------------------------------------------------- ops.linear


def _mlp(params, x, backend):
    h = jax.nn.gelu(ops.linear(x, params["up"], params["up_bias"], backend=backend))
    return ops.linear(h, params["down"], backend=backend)


MLP_RECIPES = {
    "w8a8": (Spec(bits=8, granularity="channel"), Spec(bits=8, granularity="token")),
    "w4g128": (Spec(bits=4, granularity="group", group_size=128), None),
    "w8": (Spec(bits=8, granularity="channel"), None),
    "fp8": (Spec(bits=8, granularity="channel", grid="fp8"), Spec(bits=8, granularity="token", grid="fp8")),
}

for _name in MLP_RECIPES:
    for _dtype in (F32, BF16):

        @case
        def _ops_linear(name=_name, dtype=_dtype):
            spec, act = MLP_RECIPES[name]
            d, f = 1024, 2816  # a small model's hidden / MLP width
            up = quantize(jax.random.normal(jax.random.key(2), (d, f)) * 0.03, spec, act_spec=act)
            down = quantize(jax.random.normal(jax.random.key(3), (f, d)) * 0.02, spec, act_spec=act)
            params = {"up": up, "down": down, "up_bias": jax.random.normal(jax.random.key(5), (f,)) * 0.1}
            x = jax.random.normal(jax.random.key(4), (2, 37, d)).astype(dtype)
            with config.interpret(INTERPRET):
                y = jax.jit(lambda p, x: _mlp(p, x, "pallas"))(params, x)
            with jax.default_matmul_precision("highest"):
                r = jax.jit(lambda p, x: _mlp(p, x, "xla"))(params, x)
            rel = 1e-4 if dtype == F32 else 3e-2  # as tests/test_kernel_dispatch.py (f32)
            return f"ops.linear MLP {name} {d}->{f}->{d} x(2,37) {jnp.dtype(dtype).name} pallas vs xla", *compare(
                y, r, rel
            ), None


# --------------------------------------------------------------------------- llmeq_jax.subchannel

# (M, K, N, group, symmetric, dtype, layer of a stack of 3 or None): a prompt's int4 products in XLA's sub-channel
# fusion, compiled with its flag as a model's prompt is
XLA_SUBCHANNEL_SHAPES = [
    (512, 4096, 4096, 128, True, BF16, None),
    (2048, 4096, 11008, 128, False, BF16, None),  # rtn-w4-g128's gate/up: zero points as two more rows a group
    (300, 11008, 4096, 128, False, F16, None),  # ragged M, the down projection
    (100, 1024, 640, 64, False, BF16, 1),  # a stacked layer's slice, fused into the codes' fusion
    (65, 768, 96, 32, True, BF16, None),
]

for _shape in XLA_SUBCHANNEL_SHAPES:

    @case
    def _xla_subchannel(shape=_shape):
        from llmeq_jax import subchannel
        from llmeq_jax.layer_slice import LayerSlice

        m, k, n, group, symmetric, dtype, layer = shape
        spec = Spec(bits=4, granularity="group", group_size=group, symmetric=symmetric)
        q = quantize(jax.random.normal(jax.random.key(1), (k, n)) * 0.02 + (0 if symmetric else 0.01), spec)
        x = (jax.random.normal(jax.random.key(2), (m, k)) + 0.3).astype(dtype)
        fused = jax.jit(subchannel.matmul, compiler_options={subchannel.FLAG: True})
        if layer is None:
            y = fused(x, q)
        else:
            stack = jax.tree.map(lambda a: jnp.stack([a * 0, a, a * 0]), q)  # only the layer asked for is right
            y = jax.jit(lambda x, s, i: subchannel.matmul(x, LayerSlice(s, i).value()),
                        compiler_options={subchannel.FLAG: True})(x, stack, jnp.int32(layer))
        # the scales rounded to x's dtype, as the fused GEMM multiplies them (one rounding a group)
        weight = dataclasses.replace(q, scale=q.scale.astype(dtype)).dequantize(F32)
        r = reference(lambda: x.astype(F32) @ weight)
        return (f"xla_subchannel M={m} {k}x{n} g{group} {'sym' if symmetric else 'zp'} {jnp.dtype(dtype).name}"
                f"{'' if layer is None else ' stacked'}", *compare(y, r, REL[dtype]), None)


def _label(fn):
    return f"{fn.__name__.strip('_')}{(fn.__defaults__ or ('',))[0]}"


@pytest.mark.parametrize("case_fn", CASES, ids=[_label(fn) for fn in CASES])
def test_kernel_matches_reference(case_fn):
    name, err, tol, diff = case_fn()
    assert err <= tol, f"{name}: max abs err {err:.3g} > tol {tol:.3g}"  # NaN fails too
    assert diff is None or diff == 0, f"{name}: {diff} integer outputs differ"
