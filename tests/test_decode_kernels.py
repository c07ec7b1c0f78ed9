"""Decode-time native kernels: row-major integer GEMV (native.row_major_matmul), the
decode layout that feeds it (decode_layout), and decode attention (native.decode_attention).

Weight-only row-major products quantize x to int16 per group; the bound below is that
rounding (half a step of each group's scale, times the weights it meets) plus float32
summation, computed from the actual magnitudes: a wrong nibble, offset, scale or group
index moves the result by orders more. W8A8 integer sums must be exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import decode_layout, native, ops
from llmeq_jax import generate as gen
from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.kv import attention
from llmeq_jax.models import ModelConfig, init_params
from pallas_kernels import settings
from tests.a16_bound import a16_bound as _a16_bound
from tests.cpu_flags import cpu_flags

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="native kernels are CPU kernels"),
    pytest.mark.skipif(not native.available(), reason=f"native library: {native.unavailable_reason()}"),
]

EPS = np.finfo(np.float32).eps
WEIGHTS = {
    "int8-channel": Spec(bits=8),
    "int8-channel-asym": Spec(bits=8, symmetric=False),
    "int8-g32-asym": Spec(bits=8, granularity="group", group_size=32, symmetric=False),
    "int4-channel": Spec(bits=4),
    "int4-g32": Spec(bits=4, granularity="group", group_size=32),
    "int4-g32-asym": Spec(bits=4, granularity="group", group_size=32, symmetric=False),
    "int4-g64-asym": Spec(bits=4, granularity="group", group_size=64, symmetric=False),
    "int3-g32": Spec(bits=3, granularity="group", group_size=32),
    "int6-g16": Spec(bits=6, granularity="group", group_size=16),  # llama.cpp's Q6_K grid
    "int3-g16": Spec(bits=3, granularity="group", group_size=16),  # Q3_K's, in int4 slots: four groups a VNNI step
    "int2-g16-asym": Spec(bits=2, granularity="group", group_size=16, symmetric=False),  # Q2_K's
}
# K = 320: per-channel weights flush int16 activation groups of 128, 128 and a short 64.
K, N = 320, 37


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _kernel(name: str, k: int = K, n: int = N) -> QArray:
    """An (in, out) kernel as the model stores it."""
    return jax.jit(quantize, static_argnums=1)(jnp.asarray(_rand((k, n), 0)), WEIGHTS[name])


def _dequant64(w: QArray) -> np.ndarray:
    return np.asarray(w.dequantize(), np.float64)


def _row_major_checked(x: np.ndarray, w: QArray, rm: QArray) -> tuple[np.ndarray, np.ndarray | None]:
    """(x @ w by the native row-major kernel, checked against the float64 reference within the int16 activations'
    bound; the AVX2 tiles' result of the same call where the VNNI tiles run, else None)."""
    y = np.asarray(jax.jit(native.row_major_matmul)(jnp.asarray(x), rm), np.float64)
    ref = x.astype(np.float64) @ _dequant64(w)
    assert np.all(np.abs(y - ref) <= _a16_bound(x, w)), f"{len(x)} rows: max err {np.abs(y - ref).max():.3g}"
    if not native.vnni():
        return y, None
    with native.without_vnni():
        avx2 = np.asarray(jax.jit(lambda a, b: native.row_major_matmul(a, b) * 1.0)(jnp.asarray(x), rm))
    return y, avx2


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_weight_only_row_major_matches_reference(name, rows):
    w = _kernel(name)
    rm = decode_layout.transpose_kernel(w)
    assert native.supports_row_major(rm) is None
    x = _rand((rows, K), rows)
    y = np.asarray(jax.jit(native.row_major_matmul)(jnp.asarray(x), rm), np.float64)
    ref = x.astype(np.float64) @ _dequant64(w)
    err = np.abs(y - ref)
    bound = _a16_bound(x, w)
    assert np.all(err <= bound), f"max err {err.max():.3g} vs bound {bound.flat[np.argmax(err)]:.3g}"
    # The bound is not vacuous: it is a small fraction of the outputs.
    assert bound.max() < 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("name", ["int8-channel-asym", "int4-g64-asym", "int3-g32", "int2-g16-asym"])
def test_portable_scalar_path_gives_the_same_sums(name):
    rm = decode_layout.transpose_kernel(_kernel(name))
    x = jnp.asarray(_rand((3, K), 7))
    f = jax.jit(lambda a, b: native.row_major_matmul(a, b))
    simd = np.asarray(f(x, rm))
    with native.force_scalar():
        scalar = np.asarray(jax.jit(lambda a, b: native.row_major_matmul(a, b) * 1.0)(x, rm))
    np.testing.assert_allclose(scalar, simd, rtol=1e-5, atol=1e-5 * np.abs(simd).max())


@pytest.mark.skipif(not native.vnni(), reason="the AVX-512 VNNI tiles run on a CPU with AVX-512 VNNI only")
@pytest.mark.parametrize("name", sorted(WEIGHTS) + ["w8a8"])
def test_vnni_tiles_give_the_avx2_tiles_sums(name):
    """The AVX-512 VNNI row-major tiles (vpdpwssd / vpdpbusd, 4 activation rows a tile, then 3, 2 or
    1; a group's last 32 values as a masked half step) form the AVX2 tiles' integer sums: only the
    float reduction of the lanes differs. Rows 1..9 cover every tile shape; N = 37 the weight-row tail."""
    act = Spec(bits=8, granularity="token") if name == "w8a8" else None
    spec = Spec(bits=8, granularity="group", group_size=64, symmetric=False) if act else WEIGHTS[name]
    w = dataclasses.replace(quantize(jnp.asarray(_rand((K, N), 5)), spec), act_spec=act)
    rm = decode_layout.transpose_kernel(w)
    f = jax.jit(lambda a, b: native.row_major_matmul(a, b, act))
    for rows in range(1, 10):
        x = jnp.asarray(_rand((rows, K), 30 + rows))
        vnni = np.asarray(f(x, rm))
        with native.without_vnni():
            avx2 = np.asarray(jax.jit(lambda a, b: native.row_major_matmul(a, b, act) * 1.0)(x, rm))
        tol = 1e-5 * np.abs(avx2) + 1e-6 * np.abs(avx2).max() + _offset_rounding(x, w)
        err = np.abs(vnni - avx2)
        assert np.all(err <= tol), f"{rows} rows: err {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"


def _offset_rounding(x, w: QArray) -> np.ndarray:
    """Rounding the row-major tiles' float epilogues may differ by where they take the codes' offsets off
    (sum_g ws_g (base + zp_g) sum_{k in g} x_k, one float32 term a group, subtracted from the scaled integer
    sums): two float32 ulps of that term's size, which far exceeds the output where the two cancel (int2 /
    int3 in int4 slots: unsigned nibbles, base 8, against codes of -2..1)."""
    x = np.asarray(x, np.float64)
    k, n = w.shape
    groups = w.scale.shape[0]
    g = -(-k // groups)
    sums = np.abs(np.add.reduceat(x, np.arange(0, k, g), axis=1))  # (rows, groups)
    base = 128.0 if w.act_spec is not None else 8.0 if w.bits <= 4 else 0.0  # vpdpbusd's bytes, nibbles, int8
    zp = 0.0 if w.zero_point is None else np.asarray(w.zero_point, np.float64)
    off = np.broadcast_to(np.abs(np.asarray(w.scale, np.float64) * (base + zp)), (groups, n))
    return 2 * np.finfo(np.float32).eps * (sums @ off)


@pytest.mark.parametrize("k", [288, 320])
@pytest.mark.parametrize("name", ["int4-g32", "int4-g32-asym", "int3-g32", "int8-g32-asym", "int6-g16", "int3-g16",
                                  "int2-g16-asym"])
def test_groups_of_32_pair_up(name, k):
    """Weights in groups of 32 (llama.cpp's Q4_0 / Q4_1 / Q8_0 grids): for int4 / int3 the VNNI tile takes two
    groups a step (int32 lanes 0-7 one group, 8-15 the next, each scaled by its own weight and activation scales)
    and an odd last group (K = 288: 9 groups) alone; int8 goes group by group, into two sums a row in turn. int6 in
    groups of 16 (Q6_K) pairs up the same way in the int8-stored step of 32; int3 / int2 in groups of 16 (Q3_K /
    Q2_K), in int4 slots, take four groups a step (four lanes each; the AVX2 tile two) and a last pair (K = 288: 18
    groups) as a half step. The reference's values, and the AVX2 tiles' sums where VNNI runs."""
    w = _kernel(name, k)
    rm = decode_layout.transpose_kernel(w)
    g = w.tile[0]
    for rows in (1, 2, 5):
        x = _rand((rows, k), 60 + rows)
        x[:, g:2 * g] *= 50  # activation scales that differ a lot between neighbouring groups
        y, avx2 = _row_major_checked(x, w, rm)
        if avx2 is not None:
            np.testing.assert_allclose(y, avx2, rtol=1e-5, atol=1e-6 * np.abs(avx2).max(), err_msg=f"{rows} rows")


@pytest.mark.parametrize("spec", [Spec(bits=4, granularity="group", group_size=128),
                                  Spec(bits=8, granularity="group", group_size=64, symmetric=False)],
                         ids=["int4-g128", "int8-g64-asym"])
def test_groups_of_whole_steps(spec):
    """Groups that are whole VNNI steps with K a multiple of the group (int4 in groups of 128: two 64-value steps a
    group; int8 in groups of 64: two 32-value steps) take the tile's loop for whole groups, one integer sum a group:
    the reference's values, and the AVX2 tiles' sums where VNNI runs. Rows 1, 2 and 5: tiles of 1-4 rows."""
    k = 512
    w = quantize(jnp.asarray(_rand((k, N), 11)), spec)
    rm = decode_layout.transpose_kernel(w)
    for rows in (1, 2, 5):
        x = _rand((rows, k), 80 + rows)
        x[:, 128:256] *= 50  # activation scales that differ a lot between groups
        y, avx2 = _row_major_checked(x, w, rm)
        if avx2 is not None:
            tol = 1e-5 * np.abs(avx2) + 1e-6 * np.abs(avx2).max() + _offset_rounding(x, w)
            assert np.all(np.abs(y - avx2) <= tol), f"{rows} rows"


_THREADED_ROWS = """
import sys, numpy as np, jax, jax.numpy as jnp
from llmeq_jax import decode_layout, native
from llmeq_jax.core.quantize import Spec, quantize
rng = np.random.default_rng(3)
w = quantize(jnp.asarray(rng.standard_normal((320, 1030)), jnp.float32), Spec(bits=4, granularity="group", group_size=32))
x = jnp.asarray(rng.standard_normal((2, 320)), jnp.float32)
np.save(sys.argv[1], np.asarray(jax.jit(native.row_major_matmul)(x, decode_layout.transpose_kernel(w))))
"""


@pytest.mark.parametrize("threads", ["1", "5"])
def test_threads_share_the_rows_out_exactly_once(threads, tmp_path):
    """Each thread walks its own contiguous share of the weight rows, then takes chunks from the far ends of
    the others' (native SpinPool.run_ranges): with 5 threads on this machine's cores (20 chunks of 1030 rows)
    a thread is preempted and its share taken over. Every row is computed once, by the same code: the
    outputs equal the default pool's bit for bit (a chunk skipped or written twice by a wrong claim breaks it)."""
    out = tmp_path / "y.npy"
    env = {**os.environ, "LLMEQ_NATIVE_THREADS": threads, "LLMEQ_NATIVE_PARALLEL_KB": "0"}
    proc = subprocess.run([sys.executable, "-c", _THREADED_ROWS, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rng = np.random.default_rng(3)
    w = quantize(jnp.asarray(rng.standard_normal((320, 1030)), jnp.float32),
                 Spec(bits=4, granularity="group", group_size=32))
    x = rng.standard_normal((2, 320)).astype(np.float32)
    here = np.asarray(jax.jit(native.row_major_matmul)(jnp.asarray(x), decode_layout.transpose_kernel(w)))
    np.testing.assert_array_equal(np.load(out), here)
    ref = x.astype(np.float64) @ _dequant64(w)
    assert np.all(np.abs(here - ref) <= _a16_bound(x, w))


def test_a_nan_or_inf_activation_makes_its_row_nan_only():
    """A non-finite activation in one row: that row's outputs are NaN (as a float matmul's would be,
    at least where inf meets weights of both signs), the other rows' are unchanged."""
    rm = decode_layout.transpose_kernel(_kernel("int4-g32"))
    f = jax.jit(lambda a, b: native.row_major_matmul(a, b))
    x = _rand((3, K), 12)
    clean = np.asarray(f(jnp.asarray(x), rm))
    for bad in (np.nan, np.inf):
        xb = x.copy()
        xb[1, 200] = bad
        y = np.asarray(f(jnp.asarray(xb), rm))
        assert np.isnan(y[1]).all(), bad
        np.testing.assert_array_equal(y[[0, 2]], clean[[0, 2]])


def _w8a8_case(seed, k=K, n=N, weights=None, xint=None):
    """Integer weights (unit scale, every code incl. -128) and integer-valued x (|x| max 127: scale 1)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, (k, n)).astype(np.int8) if weights is None else weights
    q[0, 0] = -128
    w = QArray(qvalue=jnp.asarray(q), scale=jnp.ones((1, n), jnp.float32), zero_point=None, bits=8, shape=(k, n),
               tile=(k, 1), dtype=jnp.float32, pack_axis=0, act_spec=Spec(bits=8, granularity="token"))
    x = rng.integers(-127, 128, (3, k)).astype(np.float32) if xint is None else xint
    x[:, 0] = -127  # pairs with the -128 weight: the sign trick's worst case
    x[:, 1] = 127
    return w, x, q


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_w8a8_row_major_integer_sums_are_exact(rows):
    w, x, q = _w8a8_case(0, xint=np.random.default_rng(rows).integers(-127, 128, (rows, K)).astype(np.float32))
    y = jax.jit(lambda a, b: ops.linear(a, b))(jnp.asarray(x), decode_layout.RowMajorKernel(decode_layout.transpose_kernel(w)))
    exact = x.astype(np.int64) @ q.astype(np.int64)  # |sum| < 2^24: exact in float32 too
    np.testing.assert_array_equal(np.asarray(y, np.float64), exact.astype(np.float64))


@pytest.mark.parametrize("spec", [Spec(bits=8), Spec(bits=8, symmetric=False),
                                  Spec(bits=8, granularity="group", group_size=64, symmetric=False)])
def test_w8a8_row_major_matches_the_xla_path(spec):
    w = dataclasses.replace(quantize(jnp.asarray(_rand((K, N), 3)), spec), act_spec=Spec(bits=8, granularity="token"))
    x = jnp.asarray(_rand((5, K), 4))
    ref = np.asarray(ops.linear(x, w, backend="xla"))
    y = np.asarray(jax.jit(lambda a, b: ops.linear(a, b))(x, decode_layout.RowMajorKernel(decode_layout.transpose_kernel(w))))
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("name,act", [("int4-g64-asym", None), ("int8-channel-asym", None), ("int3-g32", None),
                                      ("int8-g32-asym", Spec(bits=8, granularity="token"))])
def test_a_layer_of_a_stack_is_read_in_place(name, act):
    """layer=l on a stack of row-major kernels (the scan over stacked blocks) gives exactly what the
    kernel gives on layer l's own arrays, for a traced index; an index outside the stack is an error."""
    layers = [decode_layout.transpose_kernel(
        jax.jit(quantize, static_argnums=1)(jnp.asarray(_rand((K, N), 20 + i)), WEIGHTS[name])) for i in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = jnp.asarray(_rand((2, K), 9))
    at = jax.jit(lambda a, b, l: native.row_major_matmul(a, b, act, layer=l))
    for i, one in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(at(x, stack, jnp.int32(i))),
                                      np.asarray(native.row_major_matmul(x, one, act)))
    with pytest.raises(Exception, match="layer index outside the stack"):
        np.asarray(at(x, stack, jnp.int32(3)))
    with pytest.raises(ValueError, match="must be a stack"):
        native.row_major_matmul(x, layers[0], act, layer=0)


def _ffi_calls(jaxpr) -> list:
    """The ffi_call equations of a jaxpr, those of its sub-jaxprs (jit, scan bodies) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ffi_call":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _ffi_calls(sub)
    return found


@pytest.mark.parametrize("name,act", [("int4-g32-asym", None), ("int2-g16-asym", None), ("int8-channel-asym", None),
                                      ("int8-g32-asym", Spec(bits=8, granularity="token"))])
def test_integer_zero_points_go_to_the_kernel_as_stored(name, act):
    """Our quantizers' int8 zero points reach the row-major kernels as int8 (no float32 copy made on every
    decode step) and give the float32 zero points' result
    bit for bit, on the VNNI and the AVX2 tiles; other integer types are converted."""
    w = decode_layout.transpose_kernel(jax.jit(quantize, static_argnums=1)(jnp.asarray(_rand((K, N), 11)),
                                                                           WEIGHTS[name]))
    assert w.zero_point.dtype == jnp.int8
    x = jnp.asarray(_rand((3, K), 12))
    f = jax.jit(lambda a, b: native.row_major_matmul(a, b, act))
    (call,) = _ffi_calls(jax.make_jaxpr(f)(x, w).jaxpr)
    assert call.invars[3].aval.dtype == jnp.int8  # x, codes, scales, zero points, ...
    as_float = dataclasses.replace(w, zero_point=w.zero_point.astype(jnp.float32))
    as_int16 = dataclasses.replace(w, zero_point=w.zero_point.astype(jnp.int16))
    switches = [contextlib.nullcontext, native.without_vnni] if native.vnni() else [contextlib.nullcontext]
    for switch in switches:
        with switch():
            g = jax.jit(lambda a, b: native.row_major_matmul(a, b, act) * 1.0)
            want = np.asarray(g(x, as_float))
            np.testing.assert_array_equal(np.asarray(g(x, w)), want)
            np.testing.assert_array_equal(np.asarray(g(x, as_int16)), want)


def test_transpose_kernel_and_kernel_view_keep_every_value():
    for name in ("int8-g32-asym", "int4-g64-asym", "int3-g32"):
        w = _kernel(name, k=96, n=37)
        t = jax.jit(decode_layout.transpose_kernel)(w)
        assert t.shape == (37, 96) and t.pack_axis == 1
        dq = jax.jit(lambda a: a.dequantize())
        np.testing.assert_array_equal(np.asarray(dq(t)), np.asarray(dq(w)).T)
        np.testing.assert_array_equal(np.asarray(dq(decode_layout.kernel_view(t))), np.asarray(dq(w)))


def test_unsupported_weights_say_why_and_ops_linear_falls_back():
    odd_k = decode_layout.transpose_kernel(_kernel("int8-channel", k=100, n=8))
    assert "multiple of 32" in native.supports_row_major(odd_k)
    g48 = decode_layout.transpose_kernel(
        quantize(jnp.asarray(_rand((96, 8), 1)), Spec(bits=4, granularity="group", group_size=48)))
    assert "multiples of 32" in native.supports_row_major(g48)
    w8a8_g16 = decode_layout.transpose_kernel(
        quantize(jnp.asarray(_rand((96, 8), 1)), Spec(bits=8, granularity="group", group_size=16)))
    assert "or 16 for weight-only" in native.supports_row_major(w8a8_g16, Spec(bits=8, granularity="token"))
    int4 = decode_layout.transpose_kernel(_kernel("int4-g32"))
    assert "W8A8" in native.supports_row_major(int4, Spec(bits=8, granularity="token"))
    with pytest.raises(ValueError, match="multiple of 32"):
        native.row_major_matmul(jnp.ones((1, 100)), odd_k)
    # ops.linear on a row-major kernel the native code cannot take: the XLA path, same numbers.
    x = jnp.asarray(_rand((2, 100), 2))
    y = ops.linear(x, decode_layout.RowMajorKernel(odd_k))
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ odd_k.dequantize().T), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- decode layout in generate

CONFIG = ModelConfig("llama", 64, 64, 2, 4, 2, 16, 96, 1e-5, 64, False)  # K = 64 and 96: multiples of 32


@pytest.fixture(scope="module")
def qparams():
    params = jax.tree.map(lambda a: a * 10, init_params(CONFIG, jax.random.key(1)))

    spec = Spec(bits=4, granularity="group", group_size=32, symmetric=False)

    def q(path, leaf):
        return quantize(leaf, spec) if jax.tree_util.keystr(path).endswith("['kernel']") else leaf

    return jax.jit(lambda p: jax.tree_util.tree_map_with_path(q, p))(params)  # one compile, not eager ops


def test_for_decode_wraps_the_kernels_it_can_run(qparams):
    wrapped = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=1), qparams)
    kinds = [type(a).__name__ for a in jax.tree.leaves(wrapped, is_leaf=lambda a: isinstance(a, (QArray, decode_layout.RowMajorKernel)))
             if isinstance(a, (QArray, decode_layout.RowMajorKernel))]
    assert kinds and set(kinds) == {"RowMajorKernel"}
    too_many_rows = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=ops.row_major_max_rows(False) + 1),
                                   qparams)
    assert jax.tree.structure(too_many_rows) == jax.tree.structure(qparams)
    with native.disabled():
        off = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=1), qparams)
    assert jax.tree.structure(off) == jax.tree.structure(qparams)


def _leaf_kinds(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, (QArray, decode_layout.RowMajorKernel)))
    return {type(a).__name__ for a in leaves if isinstance(a, (QArray, decode_layout.RowMajorKernel))}


def test_row_major_row_limits_per_kind(qparams):
    """Weight-only kernels go row-major up to NATIVE_MAX_ROWS["row_major_vnni"] rows on an AVX-512 VNNI
    CPU ("row_major" elsewhere); W8A8 kernels up to "row_major" only (past it, the VNNI GEMM), so a
    W8A8 model's kernels keep their (in, out) layout at a batch between the two."""
    between = ops.NATIVE_MAX_ROWS["row_major"] + 1
    assert ops.row_major_max_rows(w8a8=True) == ops.NATIVE_MAX_ROWS["row_major"]
    assert ops.row_major_max_rows(w8a8=False) == (ops.NATIVE_MAX_ROWS["row_major_vnni"] if native.vnni()
                                                  else ops.NATIVE_MAX_ROWS["row_major"])
    assert ops.NATIVE_MAX_ROWS["row_major_vnni"] >= between
    wide = ops.row_major_max_rows(w8a8=False)
    assert _leaf_kinds(jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=wide), qparams)) == {"RowMajorKernel"}
    act = Spec(bits=8, granularity="token")
    w8a8 = jax.tree.map(lambda a: quantize(a.dequantize(), Spec(bits=8), act_spec=act) if isinstance(a, QArray) else a,
                        qparams, is_leaf=lambda a: isinstance(a, QArray))
    assert _leaf_kinds(jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=between - 1), w8a8)) == {"RowMajorKernel"}
    assert _leaf_kinds(jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=between), w8a8)) == {"QArray"}
    # ops.linear on a row-major weight-only kernel at a row count between the limits: native on VNNI.
    rm = decode_layout.RowMajorKernel(decode_layout.transpose_kernel(_kernel("int4-g32")))
    hlo = jax.jit(lambda a: ops.linear(a, rm)).lower(jnp.ones((between, K), jnp.float32)).as_text()
    assert ("llmeq_rm_a16" in hlo) == native.vnni()


def test_generate_uses_the_native_decode_kernels_and_agrees_with_xla(qparams):
    prompt = jnp.array([[1, 5, 7, 9], [3, 4, 5, 6]])
    cache = gen.init_cache(CONFIG, 2, 4 + 8)
    logits, cache = gen.prefill(CONFIG, qparams, prompt, jnp.ones_like(prompt), cache, kernels=gen.kernel_state())
    hlo = gen._decode_loop.lower(CONFIG, qparams, logits, cache, jax.random.key(0), 8, max_new_tokens=8, greedy=True,
                                 temperature=1.0, top_k=0, top_p=1.0, kernels=gen.kernel_state()).as_text()
    assert "llmeq_rm_a16" in hlo and "llmeq_decode_attention" in hlo
    native_out = gen.generate(CONFIG, qparams, prompt, 8)
    with native.disabled():
        assert "llmeq_" not in gen._decode_loop.lower(
            CONFIG, qparams, logits, cache, jax.random.key(0), 8, max_new_tokens=8, greedy=True, temperature=1.0, top_k=0,
            top_p=1.0, kernels=gen.kernel_state()).as_text()
        xla_out = gen.generate(CONFIG, qparams, prompt, 8)
    np.testing.assert_array_equal(np.asarray(native_out), np.asarray(xla_out))


def test_for_decode_fuses_qkv_and_gate_up(qparams):
    wrapped = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=1), qparams)
    attn, mlp = wrapped["layers_0"]["attn"], wrapped["layers_0"]["mlp"]
    assert set(attn) == {"qkv_proj", "o_proj"} and set(mlp) == {"gate_up_proj", "down_proj"}
    # (out, in): q 4 x 16 + k 2 x 16 + v 2 x 16 rows; gate + up 2 x 96 rows.
    assert attn["qkv_proj"]["kernel"].w.shape == (128, 64) and mlp["gate_up_proj"]["kernel"].w.shape == (192, 64)


def test_stacked_rows_give_exactly_the_separate_outputs(qparams):
    names = decode_layout.FUSED_LINEARS["qkv_proj"]
    ws = [decode_layout.transpose_kernel(qparams["layers_1"]["attn"][n]["kernel"]) for n in names]
    x = jnp.asarray(_rand((2, 64), 7))
    fused = ops.linear(x, decode_layout.RowMajorKernel(decode_layout.stack_rows(ws)))
    apart = jnp.concatenate([ops.linear(x, decode_layout.RowMajorKernel(w)) for w in ws], axis=-1)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(apart))


def test_generate_lays_the_kernels_out_once_per_params(qparams):
    """generate makes the decode layout outside its loop, once for the most recent params, batch size and
    kernel switches; the loop's own for_decode leaves a laid-out tree as it is (same leaves); the tokens
    are the ones the loop makes from the checkpoint's layout."""
    gen.release_decode_layout()
    laid = gen.decode_params(qparams, 1)
    assert isinstance(laid["layers_0"]["attn"]["qkv_proj"]["kernel"], decode_layout.RowMajorKernel)
    assert gen.decode_params(qparams, 1) is laid  # kept
    again = decode_layout.for_decode(laid, rows=1)
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(laid)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(laid)))

    prompt = jnp.array([[1, 5, 7, 9]])
    tokens = gen.generate(CONFIG, qparams, prompt, 6)
    assert gen.decode_params(qparams, 1) is laid  # generate used (and kept) the same copy
    cache = gen.init_cache(CONFIG, 1, 4 + 6)
    logits, cache = gen.prefill(CONFIG, qparams, prompt, jnp.ones_like(prompt), cache, kernels=gen.kernel_state())
    from_checkpoint, _ = gen._decode_loop(CONFIG, qparams, logits, cache, jax.random.key(0), jnp.int32(6),
                                          max_new_tokens=6, greedy=True, temperature=1.0, top_k=0, top_p=1.0,
                                          kernels=gen.kernel_state())
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(from_checkpoint))

    copy = jax.tree.map(lambda a: a + 0, qparams)  # equal values, other arrays: laid out anew
    assert gen.decode_params(copy, 1) is not laid
    assert gen.decode_params(qparams, 2) is not gen.decode_params(qparams, 1)  # batch size is part of the key
    kept, outside = gen.decode_params(qparams, 1), gen.kernel_state()
    with settings.override("int4_words", bn=64):  # launch settings key the loop's trace, not the layout
        assert gen.kernel_state() != outside
        assert gen.decode_params(qparams, 1) is kept
    with native.disabled():
        assert gen.decode_params(qparams, 1) is qparams  # no native kernels: nothing to lay out
    float_params = init_params(CONFIG, jax.random.key(1))
    assert gen.decode_params(float_params, 1) is float_params
    held = gen.decode_params(qparams, 1)
    gen.release_decode_layout()
    assert gen.decode_params(qparams, 1) is not held
    gen.release_decode_layout()
    # the kept copy goes when the params it was made from go
    gen.decode_params(copy, 1)
    assert gen._decode_layout_memo
    del copy
    import gc

    gc.collect()
    assert not gen._decode_layout_memo


def test_siblings_with_different_grids_stay_apart(qparams):
    mixed = jax.tree.map(lambda a: a, qparams)
    k_float = init_params(CONFIG, jax.random.key(1))["layers_0"]["attn"]["k_proj"]["kernel"]
    mixed["layers_0"]["attn"]["k_proj"]["kernel"] = quantize(k_float, Spec(bits=8, granularity="channel"))
    wrapped = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=1), mixed)
    assert set(wrapped["layers_0"]["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert "qkv_proj" in wrapped["layers_1"]["attn"]


def test_fused_qkv_with_biases_generates_the_xla_tokens():
    config = dataclasses.replace(CONFIG, qkv_bias=True)
    params = jax.tree.map(lambda a: a * 10, init_params(config, jax.random.key(2)))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.5 if jax.tree_util.keystr(path).endswith("['bias']") else a, params)
    spec = Spec(bits=8, granularity="channel")
    qp = jax.tree_util.tree_map_with_path(
        lambda path, a: quantize(a, spec) if jax.tree_util.keystr(path).endswith("['kernel']") else a, params)
    wrapped = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=1), qp)
    assert wrapped["layers_0"]["attn"]["qkv_proj"]["bias"].shape == (128,)
    prompt = jnp.array([[1, 5, 7, 9]])
    native_out = gen.generate(config, qp, prompt, 6)
    with native.disabled():
        xla_out = gen.generate(config, qp, prompt, 6)
    np.testing.assert_array_equal(np.asarray(native_out), np.asarray(xla_out))


# --------------------------------------------------------------------------- decode attention


# Head dims 64, 128, 32, 96 run in 16-slot AVX-512 blocks where the CPU has them (query heads per KV head 3, 5,
# 7: the value sums' register groups and their remainders; 700 slots: several tasks' chunks merged); 12 and 8
# run the AVX2 loops, as do the last two cases (the AVX-512 switch off).
def _assert_gradients_match_xla(q, k, v, mask):
    """d/d(q, k, v) of sum(attention ** 2) through the native path against XLA's attention, to 1e-4."""
    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, mask) ** 2)

    g = jax.jit(jax.grad(loss(attention.dot_product_attention), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(loss(attention.attention_xla), argnums=(0, 1, 2)))(q, k, v)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("b,t,h,kv,s,d,avx2", [(1, 1, 9, 3, 160, 64, False), (2, 3, 4, 2, 17, 12, False),
                                               (8, 1, 4, 4, 5, 8, False), (64, 1, 9, 3, 40, 64, False),
                                               (1, 2, 10, 2, 700, 128, False), (2, 1, 14, 2, 333, 32, False),
                                               (1, 1, 12, 4, 300, 96, False), (1, 1, 9, 3, 160, 64, True),
                                               (1, 2, 10, 2, 700, 128, True)])
def test_decode_attention_matches_xla_and_its_gradient(b, t, h, kv, s, d, avx2):
    rng = np.random.default_rng(s)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((b, t, h, d), (b, kv, s, d), (b, kv, s, d)))
    mask = jnp.asarray(rng.random((b, t, s)) < 0.6).at[0, 0].set(False)  # one row sees nothing: uniform
    assert attention.native_attention_ok(q, k, v)
    with native.without_vnni() if avx2 else contextlib.nullcontext():
        y = jax.jit(attention.dot_product_attention)(q, k, v, mask)
    ref = jax.jit(attention.attention_xla)(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    _assert_gradients_match_xla(q, k, v, mask)


def _prefill_mask(kind, b, t, s, rng):
    """[B, T, S] masks the model builds: causal over the last T of S slots, left padding (rows
    that see nothing), a sliding window, and a random one (no structure to skip)."""
    qi = np.arange(t)[:, None] + (s - t)
    si = np.arange(s)[None, :]
    m = np.broadcast_to(si <= qi, (b, t, s)).copy()
    if kind == "padded":
        m[0, :, :7] = False  # row 0: 7 padding slots; its first query positions see nothing
        m[0, :7, :] = False
    elif kind == "window":
        m &= si > qi - 20
    elif kind == "random":
        m = rng.random((b, t, s)) < 0.5
    return jnp.asarray(m)


@pytest.mark.parametrize("b,t,h,kv,s,d,kind", [
    (1, 512, 9, 3, 512, 64, "causal"),     # SmolLM2's perplexity window
    (2, 37, 4, 2, 37, 12, "padded"),       # T not a multiple of the 16-position block, D not of 16
    (1, 100, 8, 8, 130, 32, "window"),     # cache longer than T, no grouping, sliding window
    (2, 16, 6, 2, 70, 8, "random"),        # the smallest T of the prefill path, scattered mask
])
def test_prefill_attention_matches_xla_and_its_gradient(b, t, h, kv, s, d, kind):
    """The blocked online-softmax path (T >= PREFILL_ATTENTION_MIN_POSITIONS) equals XLA's
    attention for every mask the models build, including rows that see no key (uniform)."""
    rng = np.random.default_rng(t + s)
    q, k, v = (jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32)
               for shape in ((b, t, h, d), (b, kv, s, d), (b, kv, s, d)))
    mask = _prefill_mask(kind, b, t, s, rng)
    assert t >= native.PREFILL_ATTENTION_MIN_POSITIONS and attention.native_attention_ok(q, k, v)
    y = jax.jit(attention.dot_product_attention)(q, k, v, mask)
    assert "llmeq_decode_attention" in jax.jit(attention.dot_product_attention).lower(q, k, v, mask).as_text()
    ref = jax.jit(attention.attention_xla)(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-5, atol=2e-5)
    _assert_gradients_match_xla(q, k, v, mask)


def test_prefill_attention_avx512_tiles_equal_the_avx2_tiles():
    """Where the CPU has AVX-512 the prefill attention's score and P.V tiles are 16 wide; every
    output is the same sequence of FMAs over the head dim / keys, so the result is bit-identical."""
    rng = np.random.default_rng(7)
    b, t, h, kv, s, d = 1, 130, 6, 2, 130, 80  # D = 80: a 64-wide tile and a 16-wide one
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, t, h, d), (b, kv, s, d), (b, kv, s, d)))
    mask = _prefill_mask("causal", b, t, s, rng)
    f = jax.jit(attention.dot_product_attention)
    y = np.asarray(f(q, k, v, mask))
    with native.without_vnni():
        y_avx2 = np.asarray(f(q, k, v, mask))
    np.testing.assert_array_equal(y, y_avx2)
    np.testing.assert_allclose(y, np.asarray(attention.attention_xla(q, k, v, mask)), rtol=2e-5, atol=2e-5)


def test_attention_between_decode_and_prefill_sizes_stays_in_xla():
    q = jnp.ones((8, 12, 4, 8))  # 96 query rows, 12 positions each
    k = jnp.ones((8, 2, 12, 8))
    assert 96 > ops.NATIVE_MAX_ROWS["attention"] and 12 < native.PREFILL_ATTENTION_MIN_POSITIONS
    assert not attention.native_attention_ok(q, k, k)
    # batch-64 decode (one position per row) takes the kernel
    assert ops.NATIVE_MAX_ROWS["attention"] >= 64
    assert attention.native_attention_ok(jnp.ones((64, 1, 4, 8)), jnp.ones((64, 2, 12, 8)), jnp.ones((64, 2, 12, 8)))


def test_prefill_attention_stays_in_xla_without_simd():
    """The scalar fallback of the kernel is for decode sizes only: a prefill without AVX2 runs XLA."""
    q = jnp.ones((1, 80, 4, 8))  # past the decode limit in rows
    k = jnp.ones((1, 2, 80, 8))
    assert 80 > ops.NATIVE_MAX_ROWS["attention"]
    assert attention.native_attention_ok(q, k, k)
    with native.force_scalar():
        assert not attention.native_attention_ok(q, k, k)
        assert attention.native_attention_ok(q[:, :1], k, k)  # decode still native (scalar loop)


@pytest.mark.parametrize("t,s", [(1, 40), (20, 48)])  # a decode step; a prefill into a longer cache
def test_layer_attention_reads_one_layer_of_the_stack_in_place(t, s):
    """The cache's attention reads layer ``i`` of the stacked [L, B, KV, S, D] cache by index (static in
    unrolled blocks, traced in a scan) and equals XLA's attention over the sliced layer, gradient too;
    the compiled program hands the whole stack to the kernel instead of slicing it."""
    rng = np.random.default_rng(t)
    L, b, h, kv, d = 4, 2, 6, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    ks, vs = (jnp.asarray(rng.standard_normal((L, b, kv, s, d)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((b, t, s)) < 0.7)
    for layer in (0, 2, L - 1):
        ref = attention.attention_xla(q, ks[layer], vs[layer], mask)
        y = jax.jit(attention.layer_attention, static_argnums=3)(q, ks, vs, layer, mask)
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-5, atol=2e-5)
        traced = jax.jit(attention.layer_attention)(q, ks, vs, jnp.int32(layer), mask)
        np.testing.assert_allclose(np.asarray(traced), np.asarray(ref), rtol=2e-5, atol=2e-5)
    hlo = jax.jit(attention.layer_attention, static_argnums=3).lower(q, ks, vs, 1, mask).compile().as_text()
    assert "llmeq_decode_attention" in hlo and f"f32[{L},{b},{kv},{s},{d}]" in hlo.split("llmeq_decode_attention")[0]
    assert " slice(" not in hlo and "dynamic-slice(" not in hlo

    def loss(f):
        return lambda q, ks, vs: jnp.sum(f(q, ks, vs) ** 2)

    g = jax.jit(jax.grad(loss(lambda q, ks, vs: attention.layer_attention(q, ks, vs, jnp.int32(2), mask)),
                         argnums=(0, 1, 2)))(q, ks, vs)
    g_ref = jax.jit(jax.grad(loss(lambda q, ks, vs: attention.attention_xla(q, ks[2], vs[2], mask)),
                             argnums=(0, 1, 2)))(q, ks, vs)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-4)


def test_layer_attention_rejects_a_layer_outside_the_stack():
    q, ks = jnp.ones((1, 1, 4, 8)), jnp.ones((3, 1, 2, 5, 8))
    with pytest.raises(ValueError, match="layer 3 is outside the stack of 3"):
        native.decode_attention(q, ks, ks, jnp.ones((1, 1, 5), bool), masked=-1e30,
                                reference=attention.attention_xla, layer=3)
    with pytest.raises(ValueError, match="5-D float32"):
        native.decode_attention(q, ks[0], ks[0], jnp.ones((1, 1, 5), bool), masked=-1e30,
                                reference=attention.attention_xla, layer=0)


def test_decode_attention_rejects_bad_shapes():
    q = jnp.ones((1, 1, 4, 8))
    k = jnp.ones((1, 2, 5, 8))
    with pytest.raises(ValueError, match="mask must be"):
        native.decode_attention(q, k, k, jnp.ones((1, 1, 4), bool), masked=-1e30, reference=attention.attention_xla)
    with pytest.raises(ValueError, match="float32"):
        native.decode_attention(q.astype(jnp.bfloat16), k, k, jnp.ones((1, 1, 5), bool), masked=-1e30,
                                reference=attention.attention_xla)


# --------------------------------------------------------------------------- prefill layout


def test_prefill_layout_fuses_float_siblings_with_the_same_logits():
    from llmeq_jax.models import forward

    config = dataclasses.replace(CONFIG, qkv_bias=True)
    params = init_params(config, jax.random.key(3))
    fused = decode_layout.for_prefill(params)
    block = fused["layers_0"]
    assert set(block["attn"]) == {"qkv_proj", "o_proj"} and set(block["mlp"]) == {"gate_up_proj", "down_proj"}
    assert block["attn"]["qkv_proj"]["kernel"].shape == (64, 64 + 2 * 32)
    assert block["attn"]["qkv_proj"]["bias"].shape == (128,)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 24)), jnp.int32)
    f = jax.jit(lambda p, t: forward(config, p, t))
    np.testing.assert_allclose(np.asarray(f(fused, toks)), np.asarray(f(params, toks)), rtol=1e-6, atol=1e-6)


def test_prefill_layout_leaves_quantized_and_wide_groups_apart(monkeypatch):
    params = init_params(CONFIG, jax.random.key(4))
    params["layers_0"]["mlp"]["up_proj"]["kernel"] = quantize(params["layers_0"]["mlp"]["up_proj"]["kernel"],
                                                              Spec(bits=8, granularity="channel"))
    fused = decode_layout.for_prefill(params)
    assert {"gate_proj", "up_proj"} <= set(fused["layers_0"]["mlp"])  # one member is quantized
    assert "gate_up_proj" in fused["layers_1"]["mlp"]
    monkeypatch.setattr(decode_layout, "PREFILL_FUSE_MAX_OUT", 150)  # q+k+v = 128, gate+up = 192 outputs
    narrow = decode_layout.for_prefill(params)
    assert "gate_up_proj" not in narrow["layers_1"]["mlp"] and "qkv_proj" in narrow["layers_1"]["attn"]


@pytest.mark.parametrize("spec,act", [
    (Spec(bits=8), Spec(bits=8, granularity="token")),                                  # W8A8
    (Spec(bits=8), None),                                                               # int8 weight-only
    (Spec(bits=4, granularity="group", group_size=32, symmetric=False), None),          # packed int4, zero points
])
def test_prefill_layout_fuses_quantized_siblings_with_the_same_outputs(spec, act, monkeypatch):
    """All-quantized q/k/v and gate/up with one codes layout become one (in, sum out) QArray;
    every output column is the same product (W8A8: the same activation codes), so the logits
    are bit-identical -- with the SwiGLU activation applied after the product as before; a
    weight-only joined gate/up on AVX-512 applies it in the GEMM's registers (its own exp),
    the same to float rounding."""
    from llmeq_jax.models import forward

    params = init_params(CONFIG, jax.random.key(5))

    def q(path, leaf):
        name = jax.tree_util.keystr(path)
        if "kernel" not in name or "layers_" not in name:
            return leaf
        w = quantize(leaf, spec)
        return dataclasses.replace(w, act_spec=act) if act is not None else w

    qparams = jax.tree_util.tree_map_with_path(q, params)
    fused = decode_layout.for_prefill(qparams)
    kernel = fused["layers_0"]["attn"]["qkv_proj"]["kernel"]
    assert isinstance(kernel, QArray) and kernel.shape == (64, 128) and kernel.act_spec == act
    assert "gate_up_proj" in fused["layers_0"]["mlp"]
    toks = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 24)), jnp.int32)
    f = jax.jit(lambda p, t: forward(CONFIG, p, t))
    separate = np.asarray(f(qparams, toks))
    np.testing.assert_allclose(np.asarray(f(fused, toks)), separate, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(ops, "swiglu_fuses", lambda x, w: False)
    f = jax.jit(lambda p, t: forward(CONFIG, p, t))
    np.testing.assert_array_equal(np.asarray(f(fused, toks)), separate)


def test_prefill_layout_keeps_quantized_siblings_of_different_layouts_apart():
    params = init_params(CONFIG, jax.random.key(6))
    mlp = params["layers_0"]["mlp"]
    mlp["gate_proj"]["kernel"] = quantize(mlp["gate_proj"]["kernel"], Spec(bits=8))
    mlp["up_proj"]["kernel"] = quantize(mlp["up_proj"]["kernel"], Spec(bits=8, symmetric=False))  # zero points
    attn = params["layers_0"]["attn"]
    for name in ("q_proj", "k_proj", "v_proj"):  # one scale per tensor: belongs to one linear
        attn[name]["kernel"] = quantize(attn[name]["kernel"], Spec(bits=8, granularity="tensor"))
    fused = decode_layout.for_prefill(params)
    assert {"gate_proj", "up_proj"} <= set(fused["layers_0"]["mlp"])
    assert {"q_proj", "k_proj", "v_proj"} <= set(fused["layers_0"]["attn"])


# --------------------------------------------------------------------------- packed float panels


@pytest.mark.parametrize("shape", [(512, 576, 960), (37, 100, 70), (1, 64, 32), (13, 2500, 33), (25, 7, 100)])
def test_panel_matmul_matches_float64(shape):
    """Partial last panels, row counts off the 12-row tile, K split in blocks past 2048."""
    m, k, n = shape
    x, w = _rand((m, k), 1), _rand((k, n), 2)
    packed = decode_layout.pack_panels(jnp.asarray(w))
    y = np.asarray(jax.jit(lambda a, p: ops.linear(a, p))(jnp.asarray(x), packed))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    bound = 4 * k * EPS * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert y.shape == (m, n) and np.all(np.abs(y - ref) <= bound + 1e-30)


def test_pack_panels_round_trip_pads_with_zeros():
    w = jnp.asarray(_rand((40, 70), 3))
    packed = decode_layout.pack_panels(w)
    assert packed.panels.shape == (3, 40, 32) and packed.shape == (40, 70)
    np.testing.assert_array_equal(np.asarray(decode_layout.unpack_panels(packed.panels, 70)), np.asarray(w))
    assert not np.any(np.asarray(packed.panels)[2, :, 70 - 64:])


def test_panel_linear_keeps_batch_dims_bias_and_the_xla_gradient():
    x, w, b = jnp.asarray(_rand((2, 9, 48), 4)), jnp.asarray(_rand((48, 40), 5)), jnp.asarray(_rand((40,), 6))
    packed = decode_layout.pack_panels(w)
    y = jax.jit(lambda a, p: ops.linear(a, p, b))(x, packed)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w + b), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda a, p: jnp.sum(ops.linear(a, p) ** 2), argnums=(0, 1))(x, packed)
    g_ref = jax.grad(lambda a, ww: jnp.sum((a @ ww) ** 2), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(g_ref[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(decode_layout.unpack_panels(g[1].panels, 40)), np.asarray(g_ref[1]),
                               rtol=1e-4, atol=1e-4)
    with native.disabled():  # the XLA fallback reads the same panels
        np.testing.assert_allclose(np.asarray(ops.linear(x, packed, b)), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_panel_matmul_rejects_panels_of_the_wrong_shape():
    x = jnp.ones((3, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"panels must be \[ceil\(40/32\), K, 32\]"):
        native.panel_matmul(x, jnp.ones((1, 16, 32), jnp.float32), 40)
    with pytest.raises(ValueError, match="x has 16 features, the weight contracts 8"):
        native.panel_matmul(x, jnp.ones((2, 8, 32), jnp.float32), 40)


def test_avx512_detection_matches_the_cpu_flags():
    flags = cpu_flags() if os.path.exists("/proc/cpuinfo") else set()
    if native.avx512():
        assert "avx512f" in flags
    else:
        assert not ({"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma"} <= flags)


def test_prefill_layout_packs_float_kernels_where_the_avx512_gemm_runs():
    from llmeq_jax.models import forward

    params = init_params(CONFIG, jax.random.key(7))
    params["layers_1"]["mlp"]["down_proj"]["kernel"] = quantize(params["layers_1"]["mlp"]["down_proj"]["kernel"],
                                                                Spec(bits=8))
    packed = decode_layout.for_prefill(params)
    with native.disabled():
        plain = decode_layout.for_prefill(params)
    assert isinstance(plain["layers_0"]["attn"]["qkv_proj"]["kernel"], jax.Array)
    kernels = [packed["layers_0"]["attn"]["qkv_proj"]["kernel"], packed["layers_0"]["mlp"]["down_proj"]["kernel"]]
    assert all(isinstance(k, decode_layout.PanelKernel) for k in kernels) == native.avx512()
    assert isinstance(packed["layers_1"]["mlp"]["down_proj"]["kernel"], QArray)  # quantized stays as it was
    assert isinstance(packed["lm_head"]["kernel"], decode_layout.PanelKernel) == native.avx512()
    toks = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 24)), jnp.int32)
    f = jax.jit(lambda p, t: forward(CONFIG, p, t))
    np.testing.assert_allclose(np.asarray(f(packed, toks)), np.asarray(f(plain, toks)), rtol=1e-5, atol=1e-5)


def test_prefill_layout_gives_a_tied_head_a_packed_copy_of_the_table():
    from llmeq_jax.models import forward

    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    params = init_params(config, jax.random.key(8))
    assert "lm_head" not in params
    packed = decode_layout.for_prefill(params)
    assert ("lm_head" in packed) == native.avx512()
    assert packed["embed"]["embedding"] is params["embed"]["embedding"]  # the lookup still reads the table
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 24)), jnp.int32)
    f = jax.jit(lambda p, t: forward(config, p, t))
    np.testing.assert_allclose(np.asarray(f(packed, toks)), np.asarray(f(params, toks)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(512, 576, 1536), (25, 100, 40), (13, 2500, 24), (3, 16, 16)])
def test_swiglu_panels_match_float64(shape):
    """silu(x @ gate) * (x @ up) in one pass: partial last panels, K split in blocks past 2048."""
    m, k, i = shape
    x, w = _rand((m, k), 7) * 0.3, _rand((k, 2 * i), 8) * 0.3
    packed = decode_layout.pack_swiglu_panels(jnp.asarray(w))
    assert packed.swiglu and packed.shape == (k, 2 * i) and packed.panels.shape == (-(-i // 16), k, 32)
    np.testing.assert_array_equal(np.asarray(decode_layout.unpack_panels(packed.panels, i, swiglu=True)), w)
    y = np.asarray(jax.jit(lambda a, p: ops.swiglu(a, p))(jnp.asarray(x), packed))
    z = x.astype(np.float64) @ w.astype(np.float64)
    gate, up = z[:, :i], z[:, i:]
    ref = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    with native.disabled():  # the XLA fallback reads the same panels
        np.testing.assert_allclose(np.asarray(ops.swiglu(jnp.asarray(x), packed)), y, rtol=2e-5,
                                   atol=2e-5 * np.abs(ref).max())


def test_swiglu_kernel_gradient_and_misuse():
    x, w = jnp.asarray(_rand((5, 32), 9)), jnp.asarray(_rand((32, 2 * 20), 10))
    packed = decode_layout.pack_swiglu_panels(w)
    g = jax.grad(lambda a: jnp.sum(ops.swiglu(a, packed) ** 2))(x)
    g_ref = jax.grad(lambda a: jnp.sum((jax.nn.silu(a @ w[:, :20]) * (a @ w[:, 20:])) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="runs through ops.swiglu"):
        ops.linear(x, packed)
    with pytest.raises(ValueError, match="packed by decode_layout.pack_swiglu_panels"):
        ops.swiglu(x, decode_layout.pack_panels(w))
    with pytest.raises(ValueError, match=r"\(in, 2 \* intermediate\)"):
        decode_layout.pack_swiglu_panels(w[:, :39])


def test_prefill_layout_runs_the_mlp_activation_inside_the_gemm():
    from llmeq_jax.models import forward

    params = init_params(CONFIG, jax.random.key(9))
    packed = decode_layout.for_prefill(params)
    kernel = packed["layers_0"]["mlp"]["gate_up_proj"]["kernel"]
    assert (isinstance(kernel, decode_layout.PanelKernel) and kernel.swiglu) == native.avx512()
    with native.disabled():
        plain = decode_layout.for_prefill(params)
    toks = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 24)), jnp.int32)
    f = jax.jit(lambda p, t: forward(CONFIG, p, t))
    np.testing.assert_allclose(np.asarray(f(packed, toks)), np.asarray(f(plain, toks)), rtol=1e-5, atol=1e-5)


WO_SWIGLU_SPECS = {
    "int8-channel": Spec(bits=8),
    "int4-g32-asym": Spec(bits=4, granularity="group", group_size=32, symmetric=False),
    "int8-g48-asym": Spec(bits=8, granularity="group", group_size=48, symmetric=False),
}


@pytest.mark.parametrize("m,k,i,name", [(40, 96, 37, "int8-channel"), (300, 100, 48, "int4-g32-asym"),
                                        (9, 2100, 20, "int8-g48-asym"), (3, 64, 16, "int4-g32-asym")])
def test_weight_only_swiglu_matches_float64(m, k, i, name):
    """A joined weight-only gate/up kernel: silu(x @ gate) * (x @ up) in one pass on dequantized panels
    where they run (a partial last pair of 16-column halves, groups, K split past 2048), the joined
    product and a second pass elsewhere (3 rows)."""
    x, w = _rand((m, k), 11) * 0.3, _rand((k, 2 * i), 12) * 0.3
    q = quantize(jnp.asarray(w), WO_SWIGLU_SPECS[name])
    z = x.astype(np.float64) @ np.asarray(q.dequantize(), np.float64)
    ref = z[:, :i] / (1 + np.exp(-z[:, :i])) * z[:, i:]
    tol = dict(rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    assert ops.swiglu_fuses(jnp.asarray(x), q) == (native.avx512() and m > ops.NATIVE_PANEL_MIN_ROWS)
    y = np.asarray(jax.jit(lambda a, b: ops.swiglu(a, b))(jnp.asarray(x), q))
    np.testing.assert_allclose(y, ref, **tol)
    np.testing.assert_allclose(np.asarray(native.weight_only_swiglu(jnp.asarray(x), q)), ref, **tol)
    np.testing.assert_allclose(np.asarray(ops.swiglu(jnp.asarray(x), q, backend="xla")), ref, **tol)


def test_weight_only_swiglu_gradient_and_misuse():
    x = jnp.asarray(_rand((20, 32), 13))
    q = quantize(jnp.asarray(_rand((32, 40), 14)), Spec(bits=8))
    g = jax.grad(lambda a: jnp.sum(ops.swiglu(a, q) ** 2))(x)
    wd = q.dequantize()
    g_ref = jax.grad(lambda a: jnp.sum((jax.nn.silu(a @ wd[:, :20]) * (a @ wd[:, 20:])) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-4)
    odd = quantize(jnp.asarray(_rand((32, 39), 14)), Spec(bits=8))
    with pytest.raises(ValueError, match="even number of columns"):
        ops.swiglu(x, odd)
    with pytest.raises(ValueError, match="even number of columns"):
        native.weight_only_swiglu(x, odd)
    w8a8 = dataclasses.replace(q, act_spec=Spec(bits=8, granularity="token"))
    assert not ops.swiglu_fuses(x, w8a8) and not ops.swiglu_fuses(x, wd)


@pytest.mark.parametrize("recipe", ["rtn-w8", "rtn-w4-g128"])
def test_quantized_prefill_runs_the_activation_and_the_tied_head_natively(recipe):
    """A weight-only model's prefill on AVX-512: the joined gate/up product applies silu * up in the
    panel GEMM and the quantized tied head runs on dequantized (transposed) panels, with the logits
    of the unfused XLA path."""
    from llmeq_jax.core.rules import quantize_params
    from llmeq_jax.models import forward
    from llmeq_jax.pipeline import read_recipe

    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    qparams = quantize_params(init_params(config, jax.random.key(10)), read_recipe(recipe))
    assert isinstance(qparams["embed"]["embedding"], QArray)
    packed = decode_layout.for_prefill(qparams)
    toks = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 24)), jnp.int32)
    f = jax.jit(lambda p, t: forward(config, p, t))
    hlo = f.lower(packed, toks).as_text()
    assert (hlo.count("swiglu = 1") == config.num_layers) == native.avx512()
    assert ("layout = 1" in hlo) == native.avx512()  # the head: llmeq_wo_matmul on the (vocab, hidden) table
    with native.disabled():
        ref = f(decode_layout.for_prefill(qparams), toks)
    np.testing.assert_allclose(np.asarray(f(packed, toks)), np.asarray(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name,k", [("int4-g32-asym", 2048), ("int6-g16", 2048), ("int4-g64-asym", 4160),
                                    ("int8-channel", 2080)])
def test_long_rows_take_fewer_rows_a_tile(name, k):
    """Rows of 1-2 KB go two a VNNI tile, longer ones one (rm_rows_vnni_by_len), for every activation tile
    (rows 1-9): the reference's values, and the AVX2 tiles' sums (four rows a tile) where VNNI runs."""
    w = _kernel(name, k, 21)
    rm = decode_layout.transpose_kernel(w)
    for rows in range(1, 10):
        y, avx2 = _row_major_checked(_rand((rows, k), 80 + rows), w, rm)
        if avx2 is not None:
            # the same integer sums; the float ones (65 groups, zero points taken off at the end) in another order
            np.testing.assert_allclose(y, avx2, rtol=1e-5, atol=1e-5 * np.abs(avx2).max(), err_msg=f"{rows} rows")
