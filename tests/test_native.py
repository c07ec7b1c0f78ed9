"""Native CPU kernels (llmeq_jax/native.py, native/cpu_kernels.cc) against the XLA reference.

Float outputs may differ from the reference only by float32 summation order: the
tolerance is a worst-case rounding bound computed from the magnitudes of the terms
(K * eps * sum |x| |w|), far below what a wrong index, nibble or scale moves.
The W8A8 integer part must be exactly the int32 ``lax.dot_general``.
"""

import dataclasses
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import native, ops
from llmeq_jax.core.qarray import expand_to
from llmeq_jax.decode_layout import widen_to_int4
from llmeq_jax.core.quantize import Spec, quantize
from tests.cpu_flags import cpu_flags

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are CPU kernels")

EPS = np.finfo(np.float32).eps
ROWS = (1, 3, 8, 64, 130)
# K = 100 is not a multiple of 8 (the SIMD width) nor of the group size 48; N = 37 is odd.
K, N = 100, 37
# name -> weight spec (for an (in, out) kernel; the nk tests transpose the axes)
WEIGHTS = {
    "int8-channel": Spec(bits=8),
    "int8-channel-asym": Spec(bits=8, symmetric=False),
    "int8-tensor": Spec(bits=8, granularity="tensor"),
    "int8-g48-asym": Spec(bits=8, granularity="group", group_size=48, symmetric=False),
    "int4-channel": Spec(bits=4),
    "int4-g32": Spec(bits=4, granularity="group", group_size=32),
    "int4-g48-asym": Spec(bits=4, granularity="group", group_size=48, symmetric=False),
    "int3-g32": Spec(bits=3, granularity="group", group_size=32),
}

needs_native = pytest.mark.skipif(not native.available(), reason=f"native library: {native.unavailable_reason()}")


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _nk_spec(spec: Spec) -> Spec:
    """The same quantization for the (out, in) matrix: per row, or groups along in (axis 1)."""
    if spec.granularity == "group":
        return dataclasses.replace(spec, axis=1)
    if spec.granularity == "channel":
        return dataclasses.replace(spec, axis=0)
    return spec


def _bound(x, wd, k):
    """Worst-case float32 rounding of sum_k x w (recursive summation) plus the scale/zp terms."""
    mag = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(wd, np.float64))
    return 4 * (k + 8) * EPS * mag + 1e-30


def _assert_close(y, ref, bound):
    err = np.abs(np.asarray(y, np.float64) - np.asarray(ref, np.float64))
    assert np.all(err <= bound), f"max err {err.max():.3g}, bound there {bound.flat[np.argmax(err)]:.3g}"


def _abs_weight(w):
    """(|q| + |zp|) |scale| per element: the magnitudes the kernel sums (zero point folded separately)."""
    q = np.abs(np.asarray(w.values(), np.float64))
    if w.zero_point is not None:
        q = q + np.abs(np.asarray(expand_to(w.zero_point.astype(jnp.float32), w.shape, w.tile), np.float64))
    return q * np.abs(np.asarray(expand_to(w.scale.astype(jnp.float32), w.shape, w.tile), np.float64))


def test_library_was_built_and_loads():
    """The package build must produce the library here; a machine without a compiler says so."""
    if os.environ.get("LLMEQ_NATIVE_OPTIONAL") == "1":
        pytest.skip("LLMEQ_NATIVE_OPTIONAL=1: this machine may lack a C++ compiler")
    assert native.available(), native.unavailable_reason()
    assert native.library_path() is not None


# --------------------------------------------------------------------------- weight-only


# One compiled quantize per spec instead of hundreds of eager ops (keeps the file fast).
_quantize = jax.jit(quantize, static_argnums=1, static_argnames=("pack_axis",))


@functools.lru_cache(maxsize=None)
def _weight(name, layout, k=K, n=N):
    """(QArray, float64 dequantized (in, out) view, float64 magnitudes) quantized once per test session."""
    wf = _rand((k, n), 0)
    spec = WEIGHTS[name]
    if spec.granularity == "group" and spec.group_size > k:
        spec = Spec(bits=spec.bits, symmetric=spec.symmetric)
    # 3-bit values (eight per three bytes) reach the kernels in int4 slots (decode_layout.widen_to_int4,
    # as for_decode / for_prefill give them); the reference is the 3-bit QArray itself.
    if layout == "kn":
        w = _quantize(jnp.asarray(wf), spec)
        return widen_to_int4(w), np.asarray(w.dequantize(), np.float64), _abs_weight(w)
    w = _quantize(jnp.asarray(wf.T), _nk_spec(spec), pack_axis=1)
    return widen_to_int4(w), np.asarray(w.dequantize(), np.float64).T, _abs_weight(w).T


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_packed_int3_is_refused_and_its_widened_form_taken(layout):
    w, wd, _ = _weight("int3-g32", layout)
    spec = WEIGHTS["int3-g32"]
    raw = (_quantize(jnp.asarray(_rand((K, N), 0)), spec) if layout == "kn"
           else _quantize(jnp.asarray(_rand((K, N), 0).T), _nk_spec(spec), pack_axis=1))
    supports = native.supports_kn if layout == "kn" else native.supports_nk
    assert "3-bit" in supports(raw)
    assert supports(w) is None and w.bits == 4
    np.testing.assert_array_equal(np.asarray(w.dequantize(), np.float64), np.asarray(raw.dequantize(), np.float64))
    assert (w.qvalue.nbytes, raw.qvalue.nbytes) == (math.ceil(K / 2) * N, math.ceil(K / 8) * 3 * N)


# Each weight meets a spread of row counts (all of ROWS over the parametrization), not every pair:
# the kernels' row tiling (4/2/1) and tails do not depend on the weight format.
CASES = [(name, ROWS[i % len(ROWS)]) for i, name in enumerate(sorted(WEIGHTS))] + [
    (name, rows) for name in ("int8-g48-asym", "int4-g48-asym") for rows in ROWS
]


@needs_native
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("name,rows", CASES)
def test_weight_only_matches_reference(name, rows, layout):
    w, wd, absw = _weight(name, layout)
    x = np.asarray(_rand((rows, K), rows))
    y = native.weight_only_kn(jnp.asarray(x), w) if layout == "kn" else native.weight_only_nk(jnp.asarray(x), w)
    _assert_close(y, x.astype(np.float64) @ wd, _bound(x, absw, K))


@needs_native
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_many_row_weight_only_matches_reference(name, layout):
    """Products of more than 8 rows (batched decode, prefill, the tied head): on AVX-512 they run the
    float panel GEMM on slices dequantized in cache (groups across the K tail, partial last panel, int4
    nibbles; nk rows transposed 16 x 16 into the panel; one row block below 12 rows, several above)."""
    rows = {0: 9, 1: 20, 2: 65, 3: 100, 4: 300}[(sorted(WEIGHTS).index(name) + (layout == "nk")) % 5]
    w, wd, absw = _weight(name, layout)
    x = np.asarray(_rand((rows, K), rows))
    f = native.weight_only_kn if layout == "kn" else native.weight_only_nk
    _assert_close(f(jnp.asarray(x), w), x.astype(np.float64) @ wd, _bound(x, absw, K))


@needs_native
@pytest.mark.parametrize("k,n", [(576, 100), (67, 40)])
@pytest.mark.parametrize("name", ["int8-channel-asym", "int4-g32", "int4-channel"])
def test_many_row_nk_panels_at_head_like_shapes(k, n, name):
    """The tied head's layout at prefill rows: K a multiple of 16 and not (the transpose's tail),
    N past a whole number of panels, an odd single-group int4 K."""
    w, wd, absw = _weight(name, "nk", k, n)
    x = np.asarray(_rand((40, k), 7))
    _assert_close(native.weight_only_nk(jnp.asarray(x), w), x.astype(np.float64) @ wd, _bound(x, absw, k))


@needs_native
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_many_row_weight_only_goes_native_only_with_avx512(layout):
    w = _weight("int4-g32", layout)[0]
    assert ops.NATIVE_MAX_ROWS["int4"] == ops.NATIVE_PANEL_MIN_ROWS  # no row count left to XLA on AVX-512
    f = ops.linear if layout == "kn" else ops.linear_nk
    for rows, native_ok in ((100, native.avx512()), (ops.NATIVE_PANEL_MIN_ROWS + 1, native.avx512())):
        hlo = jax.jit(lambda a: f(a, w)).lower(jnp.asarray(_rand((rows, K), 6))).as_text()
        assert ("llmeq_wo_matmul" in hlo) == native_ok


@needs_native
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_weight_only_agrees_with_the_xla_path(layout):
    w, _, absw = _weight("int4-g48-asym", layout)
    x = jnp.asarray(_rand((3, K), 3))
    if layout == "kn":
        y, ref = native.weight_only_kn(x, w), ops.linear(x, w, backend="xla")
    else:
        y, ref = native.weight_only_nk(x, w), ops.linear_nk(x, w, backend="xla")
    _assert_close(y, ref, 2 * _bound(x, absw, K))


@needs_native
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 70), (9, 5)])
@pytest.mark.parametrize("name", ["int8-channel", "int4-g32"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_weight_only_model_like_shapes(k, n, name, layout):
    w, wd, absw = _weight(name, layout, k, n)
    x = np.asarray(_rand((2, k), 5))
    f = native.weight_only_kn if layout == "kn" else native.weight_only_nk
    _assert_close(f(jnp.asarray(x), w), x.astype(np.float64) @ wd, _bound(x, absw, k))


@needs_native
@pytest.mark.parametrize("name", ["int8-g48-asym", "int4-g48-asym", "int4-channel"])
def test_portable_scalar_path(name):
    """The loops used on CPUs without AVX2+FMA, forced here."""
    x = np.asarray(_rand((3, K), 3))
    for layout, f in (("kn", native.weight_only_kn), ("nk", native.weight_only_nk)):
        w, wd, absw = _weight(name, layout)
        with native.force_scalar():
            y = jax.block_until_ready(f(jnp.asarray(x), w))
        _assert_close(y, x.astype(np.float64) @ wd, _bound(x, absw, K))


# --------------------------------------------------------------------------- W8A8

ACTS = {
    "token": (Spec(bits=8, granularity="token"), False),
    "tensor-dynamic": (Spec(bits=8, granularity="tensor"), False),
    "tensor-static": (Spec(bits=8, granularity="tensor"), True),
}


@needs_native
@pytest.mark.parametrize("rows,k", [(1, 100), (3, 257), (8, 100), (64, 257), (130, 100), (512, 257)])
def test_w8a8_integer_part_is_exact_int32(rows, k):
    rng = np.random.default_rng(rows + k)
    xq = jnp.asarray(rng.integers(-127, 128, (rows, k)), jnp.int8)  # what quantize_activations produces
    q = jnp.asarray(rng.integers(-128, 128, (k, 37)), jnp.int8)  # any int8, -128 included
    acc = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    assert int(jnp.max(jnp.abs(acc))) < 2**24  # so the float32 carrier is exact
    np.testing.assert_array_equal(np.asarray(native._w8_int32_for_tests(xq, q, k)), np.asarray(acc, np.float32))


W8_CASES = [
    ("int8-channel", "token", 1),
    ("int8-channel-asym", "tensor-dynamic", 8),
    ("int8-g48-asym", "token", 130),
    ("int8-g48-asym", "tensor-static", 3),
    ("int8-tensor", "tensor-static", 64),
    ("int8-channel", "token", 512),
]


@needs_native
@pytest.mark.parametrize("wname,aname,rows", W8_CASES)
def test_w8a8_matches_xla(wname, aname, rows):
    act, static = ACTS[aname]
    x = jnp.asarray(_rand((rows, K), rows))
    act_scale = jnp.asarray(np.abs(_rand((16, K), 9)).max() / 127, jnp.float32) if static else None
    base, _, absw = _weight(wname, "kn")
    w = dataclasses.replace(base, act_spec=act, act_scale=act_scale)
    y = native.w8a8_kn(x, w, act)
    ref = ops.linear(x, w, backend="xla")
    # Same int32 sums; only the per-group float epilogue (fma vs mul + add) may round differently.
    xq, sx = ops.quantize_activations(x, act, act_scale)
    mag = (np.abs(np.asarray(xq, np.float64)) @ absw) * np.asarray(sx, np.float64)
    _assert_close(y, ref, 8 * EPS * mag + 1e-30)


@needs_native
@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU flags from /proc/cpuinfo (Linux)")
def test_vnni_gemm_is_on_exactly_where_the_cpu_has_it():
    flags = cpu_flags()
    expect = native.simd() and {"avx512f", "avx512bw", "avx512_vnni"} <= flags
    assert native.vnni() == expect
    with native.without_vnni():
        assert not native.vnni()
    assert native.vnni() == expect


@needs_native
@pytest.mark.parametrize("wname", ["int8-channel", "int8-channel-asym", "int8-g48-asym", "int8-tensor"])
@pytest.mark.parametrize("rows,k,n", [(9, 100, 37), (130, 257, 96), (64, 100, 200)])
def test_w8a8_vnni_and_avx2_gemms_agree_bit_for_bit(wname, rows, k, n):
    """Many-row W8A8: the AVX-512 VNNI GEMM (where the CPU has it) and the AVX2 GEMM compute the
    same int32 sums and the same float epilogue. Shapes: K neither a multiple of 4 nor of the group,
    N with 16-column panels, a 48-column tile and a scalar tail; codes -128 and 127 present."""
    act = Spec(bits=8, granularity="token")
    w = dataclasses.replace(_weight(wname, "kn", k, n)[0], act_spec=act)
    w = dataclasses.replace(w, qvalue=w.qvalue.at[0, 0].set(-128).at[1, 1].set(127))
    x = jnp.asarray(_rand((rows, k), rows + n))
    y = np.asarray(native.w8a8_kn(x, w, act))
    with native.without_vnni():
        y_avx2 = np.asarray(native.w8a8_kn(x, w, act))
    np.testing.assert_array_equal(y, y_avx2)
    xq, sx = ops.quantize_activations(x, act, None)
    mag = (np.abs(np.asarray(xq, np.float64)) @ _abs_weight(w)) * np.asarray(sx, np.float64)
    _assert_close(y, ops.w8a8_xla(x, w, act), 8 * EPS * mag + 1e-30)


@needs_native
def test_many_row_w8a8_goes_native_only_with_vnni():
    """Prefill-sized W8A8 products take the native GEMM where it beats XLA (VNNI), else XLA's int8 dot."""
    act = Spec(bits=8, granularity="token")
    w = dataclasses.replace(_weight("int8-channel", "kn")[0], act_spec=act)
    x = jnp.asarray(_rand((64, K), 5))
    assert 64 > ops.NATIVE_MAX_ROWS["w8a8"]
    hlo = jax.jit(lambda a: ops.linear(a, w)).lower(x).as_text()
    assert ("llmeq_w8a8_matmul" in hlo) == native.vnni()


# --------------------------------------------------------------------------- under transformations


@needs_native
def test_under_jit_scan_and_vmap():
    w = _weight("int4-g32", "kn")[0]
    xs = jnp.asarray(_rand((5, 2, K), 1))
    ref = jnp.einsum("tmk,kn->tmn", xs, w.dequantize())
    bound = _bound(xs.reshape(-1, K), _abs_weight(w), K).reshape(5, 2, N)

    def body(c, xt):
        return c + 1, native.weight_only_kn(xt, w)

    _, ys = jax.jit(lambda a: jax.lax.scan(body, 0, a))(xs)
    _assert_close(ys, ref, 2 * bound)
    _assert_close(jax.jit(jax.vmap(lambda a: native.weight_only_kn(a, w)))(xs), ref, 2 * bound)

    def loop(i, acc):
        return acc + native.weight_only_kn(xs[i], w)

    tot = jax.jit(lambda: jax.lax.fori_loop(0, 5, loop, jnp.zeros((2, N))))()
    _assert_close(tot, ref.sum(0), 10 * bound.sum(0))


@needs_native
def test_grad_wrt_x_is_the_xla_gradient():
    w = _weight("int4-g48-asym", "kn")[0]
    x = jnp.asarray(_rand((3, K), 1))
    c = jnp.asarray(_rand((3, N), 2))
    g = jax.jit(jax.grad(lambda a: jnp.sum(native.weight_only_kn(a, w) * c)))(x)
    gx = jax.jit(jax.grad(lambda a: jnp.sum(ops.linear(a, w, backend="xla") * c)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gx), rtol=1e-6, atol=1e-6)
    act = Spec(bits=8, granularity="token")
    w8 = dataclasses.replace(_weight("int8-channel", "kn")[0], act_spec=act)
    g8 = jax.jit(jax.grad(lambda a: jnp.sum(native.w8a8_kn(a, w8, act) * c)))(x)
    g8x = jax.jit(jax.grad(lambda a: jnp.sum(ops.linear(a, w8, backend="xla") * c)))(x)
    np.testing.assert_allclose(np.asarray(g8), np.asarray(g8x), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- errors and fallback


@needs_native
def test_unsupported_layouts_are_clear_errors():
    w2 = quantize(jnp.asarray(_rand((K, N), 0)), Spec(bits=2))
    with pytest.raises(ValueError, match="2-bit"):
        native.weight_only_kn(jnp.ones((1, K)), w2)
    w4_rows = quantize(jnp.asarray(_rand((N, K), 0)), Spec(bits=4, axis=0))  # packed along rows
    assert native.supports_nk(w4_rows) is not None
    with pytest.raises(ValueError, match="packed along the contraction"):
        native.weight_only_nk(jnp.ones((1, K)), w4_rows)
    w8 = quantize(jnp.asarray(_rand((K, N), 0)), Spec(bits=8))
    with pytest.raises(ValueError, match="features"):
        native.weight_only_kn(jnp.ones((1, K + 1)), w8)
    with pytest.raises(TypeError, match="floating"):
        native.weight_only_kn(jnp.ones((1, K), jnp.int32), w8)


@pytest.fixture
def missing_library(monkeypatch):
    """The library as if it had not been built: a fresh load state pointing nowhere."""
    monkeypatch.setenv("LLMEQ_NATIVE_LIB", "/nonexistent/_native_cpu.so")
    monkeypatch.setattr(native, "_state", native._State())
    yield


def test_missing_library_falls_back_with_one_warning(missing_library):
    w = _weight("int8-channel", "kn")[0]
    x = jnp.asarray(_rand((1, K), 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1 = ops.linear(x, w)
        y2 = jax.jit(lambda a: ops.linear(a, w))(x)
        ops.linear_nk(x, quantize(jnp.asarray(_rand((N, K), 0)), Spec(bits=8, axis=0)))
    ours = [c for c in caught if "native CPU kernels are off" in str(c.message)]
    assert len(ours) == 1, [str(c.message) for c in caught]
    assert not native.available() and "not built" in native.unavailable_reason()
    ref = ops.linear(x, w, backend="xla")
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(ref))
    np.testing.assert_allclose(np.asarray(y2), np.asarray(ref), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="not built"):
        native.weight_only_kn(x, w)


def test_rows_per_chunk_bound_of_the_xla_nk_fallback():
    """linear_nk_xla at few rows scans row chunks (the head never exists as a float table)."""
    n = 3 * ops.NK_CHUNK_ROWS + 5
    w = quantize(jnp.asarray(_rand((n, K), 0)), Spec(bits=4, granularity="group", group_size=32, axis=1), pack_axis=1)
    x = jnp.asarray(_rand((2, K), 1))
    jaxpr = str(jax.make_jaxpr(ops.linear_nk_xla)(x, w))
    assert "scan" in jaxpr and f"{n},{K}" not in jaxpr.replace(" ", "")
    y = ops.linear_nk_xla(x, w)
    _assert_close(y, np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64).T, _bound(x, _abs_weight(w).T, K))
    assert math.prod(y.shape) == 2 * n


# --------------------------------------------------------------------------- float GEMV

FLOAT_SHAPES = [(37, 21), (130, 200), (576, 1536)]  # K % 4, N % 8 tails; a SmolLM2 shape


def _float_case(dtype, k, n, layers, rows, seed=0):
    w = jnp.asarray(_rand((layers, k, n), seed)).astype(dtype)
    x = jnp.asarray(_rand((rows, k), seed + 1)).astype(dtype)
    return x, w


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", FLOAT_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_float_matmul_reads_each_layer_of_a_stack(dtype, k, n, rows):
    """Every layer of a stack, and a kernel of its own, against float64 products of the same (rounded)
    operands; 9 and 17 rows cross the kernel's 8-row blocks. bf16 results are rounded to bf16 once."""
    x, w = _float_case(dtype, k, n, 3, rows)
    xf, wf = np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
    f = jax.jit(lambda a, s, l: native.float_matmul(a, s, layer=l))
    rel = 2.0 ** -8 if dtype == jnp.bfloat16 else 0.0
    for layer in range(3):
        ref = xf.astype(np.float64) @ wf[layer]
        y = f(x, w, jnp.int32(layer))
        assert y.dtype == dtype and y.shape == (rows, n)
        bound = _bound(xf, np.abs(wf[layer]), k) + rel * np.abs(ref)
        _assert_close(y.astype(jnp.float32), ref, bound)
    y = jax.jit(native.float_matmul)(x, w[1])
    _assert_close(y.astype(jnp.float32), xf.astype(np.float64) @ wf[1], _bound(xf, np.abs(wf[1]), k) + rel * np.abs(xf @ wf[1]))


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float_matmul_portable_scalar_path(dtype):
    x, w = _float_case(dtype, 130, 37, 2, 3, seed=5)
    want = jax.jit(lambda a, s: native.float_matmul(a, s, layer=jnp.int32(1)))(x, w)
    with native.force_scalar():
        got = jax.jit(lambda a, s: native.float_matmul(a, s, layer=jnp.int32(1)) + 0)(x, w)
    xf, wf = np.asarray(x.astype(jnp.float32)), np.asarray(w[1].astype(jnp.float32))
    bound = _bound(xf, np.abs(wf), 130) + (2.0 ** -8 if dtype == jnp.bfloat16 else 0) * np.abs(xf @ wf)
    _assert_close(got.astype(jnp.float32), np.asarray(want.astype(jnp.float32)), 2 * bound)


@needs_native
def test_float_matmul_grad_and_errors():
    x, w = _float_case(jnp.float32, 37, 21, 2, 3)
    c = jnp.asarray(_rand((3, 21), 9))
    g = jax.jit(jax.grad(lambda a, s: jnp.sum(native.float_matmul(a, s, layer=jnp.int32(1)) * c), (0, 1)))(x, w)
    gx = jax.grad(lambda a, s: jnp.sum(a @ s[1] * c), (0, 1))(x, w)
    for a, b in zip(g, gx):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"stack \[L, in, out\]"):
        native.float_matmul(x, w[0], layer=0)
    with pytest.raises(ValueError, match=r"\(in, out\) kernel"):
        native.float_matmul(x, w)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        native.float_matmul(x, w[0].astype(jnp.float16))
    with pytest.raises(ValueError, match="features"):
        native.float_matmul(x[:, :36], w[0])
    with pytest.raises(Exception, match="layer index outside the stack"):
        jax.block_until_ready(jax.jit(lambda a, s: native.float_matmul(a, s, layer=jnp.int32(2)))(x, w))


@needs_native
def test_ops_linear_takes_the_float_gemv_for_bf16_decode_only():
    """A bf16 kernel at decode's rows goes native on a CPU (XLA:CPU's bf16 dot converts the whole kernel
    first); a float32 one of its own, many rows, and backend="xla" stay on XLA's dot."""
    x, w = _float_case(jnp.bfloat16, 130, 37, 1, 2)

    def hlo(a, b, **kw):
        return jax.jit(lambda u, v: ops.linear(u, v, **kw)).lower(a, b).as_text()

    assert "llmeq_float_gemv" in hlo(x, w[0])
    assert "llmeq_float_gemv" not in hlo(jnp.ones((64, 130), jnp.bfloat16), w[0])
    assert "llmeq_float_gemv" not in hlo(x, w[0], backend="xla")
    assert "llmeq_float_gemv" not in hlo(x.astype(jnp.float32), w[0].astype(jnp.float32))
    with native.disabled():
        assert "llmeq_float_gemv" not in hlo(x, w[0])
    ref = np.asarray(x.astype(jnp.float32)) @ np.asarray(w[0].astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(ops.linear(x, w[0]).astype(jnp.float32)), ref, rtol=0.02, atol=0.02 * np.abs(ref).max())
