"""AMX-INT8 tiles (native/amx.inc): int8 products 16 rows at a time on CPUs that have them.

Where the CPU reports AMX-TILE and AMX-INT8 (and Linux grants the tile state), the W8A8 GEMM and the integer
panels with int8 activations run their 16-row blocks on ``tdpbsud`` / ``tdpbusd``; their groups' int32 sums then
go through the same float epilogue as the VNNI tiles', so both give the same bits. ``native.without_amx()``
switches the tiles off, which is what these tests compare against. Groups shorter than 64 values and blocks of
fewer than 16 rows stay on the VNNI tiles.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import native
from llmeq_jax.core.quantize import Spec, quantize
from tests.cpu_flags import cpu_flags

needs_amx = pytest.mark.skipif(not native.amx(), reason="the AMX tiles run on CPUs with AMX-INT8 (Sapphire Rapids on)")


def _x(rows: int, k: int, seed: int) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * np.exp(rng.standard_normal((1, k)))  # some columns much larger
    return jnp.asarray(x, jnp.float32)


def _with_and_without_amx(f, x, blocks: int):
    """f(x) on the AMX tiles (which must take ``blocks`` 16-row blocks) and on the VNNI tiles alone."""
    before = native.amx_blocks()
    y = np.asarray(f(x))
    assert native.amx_blocks() - before == blocks
    with native.without_amx():
        assert not native.amx()
        y_vnni = np.asarray(f(x))
    assert native.amx_blocks() - before == blocks
    return y, y_vnni


@pytest.mark.skipif(not (native.available() and os.path.exists("/proc/cpuinfo")),
                    reason="reads the CPU flags from /proc/cpuinfo (Linux), with the native library")
def test_amx_is_on_exactly_where_the_cpu_has_it():
    expect = native.vnni() and {"amx_tile", "amx_int8"} <= cpu_flags()
    assert native.amx() == expect
    with native.without_amx():
        assert not native.amx()
    assert native.amx() == expect


# (spec, K, N, rows): per-channel groups of 128 with a short last one (600 = 4 x 128 + 88: chunks of 64 and a
# padded 24), one group of K % 4 != 0 values (67), groups of 64 and 96 (a chunk and a half) and of 192 / 256
# (three and four chunks: a chunk's quad rows are at most 16, which the first build copied past), rows past whole
# 16-row blocks; N past whole 32-column slices (even: SwiGLU halves it).
PANEL_CASES = [
    (Spec(bits=8), 600, 70, 51),
    (Spec(bits=8, symmetric=False), 67, 40, 20),
    (Spec(bits=4), 600, 38, 33),
    (Spec(bits=4, granularity="group", group_size=64, symmetric=False), 512, 96, 48),
    (Spec(bits=8, granularity="group", group_size=96), 288, 34, 16),
    (Spec(bits=4, granularity="group", group_size=128, symmetric=False), 2048, 200, 37),
    (Spec(bits=8, granularity="group", group_size=256), 512, 70, 24),  # four chunks a group, two groups
    (Spec(bits=8, granularity="group", group_size=192, symmetric=False), 768, 32, 16),
]


@needs_amx
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("spec,k,n,rows", PANEL_CASES)
def test_integer_panels_on_amx_give_the_vnni_tiles_bits(spec, k, n, rows, swiglu):
    w = quantize(jnp.asarray(np.random.default_rng(k + n).standard_normal((k, n)), jnp.float32), spec)
    product = native.weight_only_swiglu if swiglu else native.weight_only_kn
    with native.integer_panels(activation_bits=8):
        f = jax.jit(lambda x: product(x, w))
        panels = -(-(n // 2 if swiglu else n) // (16 if swiglu else 32))  # one task a 32-column slice
        y, y_vnni = _with_and_without_amx(f, _x(rows, k, rows), panels * (rows // 16))
    np.testing.assert_array_equal(y, y_vnni)
    y_float = np.asarray(jax.jit(lambda x: product(x, w) + 0)(_x(rows, k, rows)))  # float panels
    assert not np.array_equal(y, y_float)
    assert np.abs(y - y_float).max() < 0.05 * np.abs(y_float).max()  # int8 activations: close, not equal
    assert not np.array_equal(y, np.zeros_like(y))


def native_w8a8_chunk(n: int) -> int:
    """Columns a task of the VNNI GEMM takes (w8v_chunk in native/w8a8.inc)."""
    return 48 * min(max(n // (48 * 8), 1), 4)


@needs_amx
@pytest.mark.parametrize("wspec,k,n,rows", [
    (Spec(bits=8), 100, 200, 64),            # one group of 100 values: a chunk of 64 and a padded 36
    (Spec(bits=8, symmetric=False), 257, 96, 130),  # K % 4 != 0, zero points, rows past 16-row blocks
    (Spec(bits=8, granularity="group", group_size=128), 512, 48, 32),
    (Spec(bits=8), 576, 1536, 40),          # SmolLM2's gate/up
])
def test_w8a8_on_amx_gives_the_vnni_gemms_bits(wspec, k, n, rows):
    act = Spec(bits=8, granularity="token")
    w = quantize(jnp.asarray(np.random.default_rng(k).standard_normal((k, n)), jnp.float32), wspec)
    w = dataclasses.replace(w, act_spec=act, qvalue=w.qvalue.at[0, 0].set(-128).at[1, 1].set(127))
    chunks = len(range(0, n, native_w8a8_chunk(n)))  # column chunks, each runs the rows' 16-row blocks
    f = jax.jit(lambda x: native.w8a8_kn(x, w, act))
    y, y_vnni = _with_and_without_amx(f, _x(rows, k, rows), chunks * (rows // 16))
    np.testing.assert_array_equal(y, y_vnni)
    assert np.abs(y).max() > 0
