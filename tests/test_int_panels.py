"""Weight-only products of many rows on integer panels (native/cpu_kernels.cc, AVX-512 VNNI).

Past ``ops.NATIVE_PANEL_MIN_ROWS`` rows a weight-only product (``(in, out)`` or ``(out, in)``) traced inside
``native.integer_panels()`` on a VNNI CPU quantizes x to int16 per flush group as the decode kernels do and
sums int16 x code pairs exactly in int32 (``vpdpwssd``); with ``activation_bits=8`` int8 x (stored + 128) and
code quads (``vpdpbusd``); outside, it runs the float panels (dequantized codes, float32 FMAs). ``generate``
traces its prefill and decode loop inside.
The bound is the activations' rounding plus float32 summation (tests/a16_bound.py); with activations that
the codes represent exactly, only the float summation is left.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import native
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.decode_layout import widen_to_int4
from tests.a16_bound import EPS, a16_bound

pytestmark = pytest.mark.skipif(not (jax.default_backend() == "cpu" and native.available() and native.vnni()),
                                reason="the integer panels run on CPUs with AVX-512 VNNI")

WEIGHTS = {
    "int8-channel": Spec(bits=8),
    "int8-channel-asym": Spec(bits=8, symmetric=False),
    "int8-tensor": Spec(bits=8, granularity="tensor"),
    "int8-g48-asym": Spec(bits=8, granularity="group", group_size=48, symmetric=False),
    "int6-g16": Spec(bits=6, granularity="group", group_size=16),
    "int4-channel": Spec(bits=4),
    "int4-g32": Spec(bits=4, granularity="group", group_size=32),
    "int4-g32-asym": Spec(bits=4, granularity="group", group_size=32, symmetric=False),
    "int3-g16": Spec(bits=3, granularity="group", group_size=16),
}
# (K, N): K not a multiple of 16 and odd (one flush group a row, an int4 byte's spare nibble), several
# per-channel flush groups of 128 with a short last one, N past whole 32-column slices.
SHAPES = [(96, 37), (67, 40), (600, 70)]
LEVELS = {16: 32767, 8: 127}  # the activation codes' absmax


_quantize = jax.jit(quantize, static_argnums=1, static_argnames=("pack_axis",))


def _kernel(name: str, k: int, n: int, layout: str = "kn"):
    """(QArray in ``layout``, K after rounding up to whole groups, float64 (in, out) reference matrix)."""
    spec = WEIGHTS[name]
    if spec.granularity == "group" and k % spec.group_size:
        k = k // spec.group_size * spec.group_size + spec.group_size  # whole groups (K odd: per-channel only)
    wf = jnp.asarray(np.random.default_rng(0).standard_normal((k, n)), jnp.float32)
    if layout == "kn":
        w = widen_to_int4(_quantize(wf, spec))
        return w, k, np.asarray(w.dequantize(), np.float64)
    # (out, in): per row, or groups along in; int4 packed along in
    spec = dataclasses.replace(spec, axis={"group": 1, "channel": 0}.get(spec.granularity, spec.axis))
    w = widen_to_int4(_quantize(wf.T, spec, pack_axis=1))
    return w, k, np.asarray(w.dequantize(), np.float64).T


def _product(x: np.ndarray, w, layout: str, integer: bool = True, bits: int = 16) -> np.ndarray:
    f = native.weight_only_kn if layout == "kn" else native.weight_only_nk
    with native.integer_panels(integer, bits):
        return np.asarray(f(jnp.asarray(x), w))


def _x(rows: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)


def _check(y, ref, bound):
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= bound), f"max err {err.max():.3g}, bound there {bound.flat[np.argmax(err)]:.3g}"


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_integer_panels_match_the_reference(name, k, n, layout, bits):
    """kn: the kernel's rows widened a pair at a time; nk (the tied head's table): its rows widened and
    transposed 16 x 16 into the panel; int8 activations: the pairs joined into quads."""
    rows = {96: 9, 67: 14, 600: 51}[k]  # remainders 1, 2 and 3 past 4-row tiles
    w, k, wd = _kernel(name, k, n, layout)
    x = _x(rows, k, rows)
    y = _product(x, w, layout, bits=bits)
    ref = x.astype(np.float64) @ wd
    bound = a16_bound(x, w, nk=layout == "nk", levels=LEVELS[bits])
    _check(y, ref, bound)
    # the bound is a small fraction of the outputs
    assert bound.max() < {16: 1e-2, 8: 0.3}[bits] * np.abs(ref).max()
    assert not np.array_equal(y, _product(x, w, layout, integer=False))  # the switch picks the other path
    if bits == 8:
        assert not np.array_equal(y, _product(x, w, layout))


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("name", ["int8-g48-asym", "int4-g32-asym", "int8-channel"])
def test_activations_the_codes_represent_are_summed_exactly(name, layout, bits):
    """x = integers times 2^-8 with each flush group's absmax the codes' (32767 or 127) times 2^-8: the
    activation codes hold them exactly, so the outputs are the float64 products to within float32 summation
    alone (int8: also the offset of 128 each group's sums start from)."""
    w, k, wd = _kernel(name, 336, 70, layout)
    flush = WEIGHTS[name].group_size if WEIGHTS[name].granularity == "group" else 128
    rng = np.random.default_rng(3)
    top = LEVELS[bits]
    ints = rng.integers(-top, top + 1, (20, k))
    for k0 in range(0, k, flush):
        ints[:, k0] = rng.choice([-top, top], 20)
    x = (ints * 2.0 ** -8).astype(np.float32)
    y = _product(x, w, layout, bits=bits)
    mag = np.abs(x.astype(np.float64)) @ np.abs(wd)
    if w.zero_point is not None:
        mag = mag + np.abs(x.astype(np.float64)).sum(axis=1, keepdims=True) * np.abs(wd).max()
    _check(y, x.astype(np.float64) @ wd, 4 * (k + 8) * EPS * mag + 1e-30)


@pytest.mark.parametrize("bits", [16, 8])
def test_swiglu_in_the_integer_tile(bits):
    """A joined gate/up kernel: silu(gate) * up from the integer sums, 16 output columns a slice (the last
    partial), equal to the activation applied to the plain product's two halves to float rounding."""
    w, k, _ = _kernel("int4-g32-asym", 128, 2 * 37)
    x = _x(30, k, 5)
    joined = _product(x, w, "kn", bits=bits).astype(np.float64)
    gate, up = joined[:, :37], joined[:, 37:]
    want = gate / (1 + np.exp(-gate)) * up
    with native.integer_panels(activation_bits=bits):
        got = np.asarray(native.weight_only_swiglu(jnp.asarray(x), w), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bits", [16, 8])
def test_nan_and_zero_rows(bits):
    """A row holding a NaN gives NaN outputs and leaves the other rows alone; a zero row gives zeros."""
    w, k, wd = _kernel("int4-g32-asym", 96, 40)
    x = _x(12, k, 9)
    x[4, 17] = np.nan
    x[7] = 0.0
    y = _product(x, w, "kn", bits=bits)
    assert np.isnan(y[4]).all() and np.isfinite(np.delete(y, 4, axis=0)).all()
    np.testing.assert_array_equal(y[7], 0.0)
    rest = [r for r in range(12) if r not in (4, 7)]
    _check(y[rest], x[rest].astype(np.float64) @ wd, a16_bound(x[rest], w, levels=LEVELS[bits]))


@pytest.mark.parametrize("name,k,spec,bits", [
    ("odd groups", 100, Spec(bits=8, granularity="group", group_size=25), 16),   # pairs would cross groups
    ("odd groups", 100, Spec(bits=8, granularity="group", group_size=25), 8),
    ("groups of 6", 96, Spec(bits=8, granularity="group", group_size=6), 8),  # quads would cross groups
    ("long int8 groups", 1024, Spec(bits=8, granularity="group", group_size=512), 16),  # int32 headroom
    ("longer groups", 16384, Spec(bits=8, granularity="group", group_size=8192), 8),
])
def test_float_panels_where_the_integer_ones_cannot(name, k, spec, bits):
    w = quantize(jnp.asarray(_x(k, 40, 1)), spec)
    x = _x(16, k, 2)
    np.testing.assert_array_equal(_product(x, w, "kn", bits=bits), _product(x, w, "kn", integer=False))


def test_activation_bits_are_8_or_16():
    with pytest.raises(ValueError, match="activation_bits must be 8 or 16"):
        with native.integer_panels(activation_bits=4):
            pass


def test_int8_activations_take_groups_of_four():
    """Groups of 4 values are whole quads: the int8 panels take them (groups of 6 above they do not)."""
    w = quantize(jnp.asarray(_x(96, 40, 1)), Spec(bits=8, granularity="group", group_size=4))
    x = _x(16, 96, 2)
    y = _product(x, w, "kn", bits=8)
    _check(y, x.astype(np.float64) @ np.asarray(w.dequantize(), np.float64), a16_bound(x, w, levels=127))
    assert not np.array_equal(y, _product(x, w, "kn", integer=False))


def test_generate_takes_the_integer_panels_and_a_full_forward_the_float_ones():
    """The weight-only products of a prompt's prefill and of the decode loop are traced with the integer
    panels; a full forward (perplexity, the exports' comparisons) with the float ones."""
    import re

    from llmeq_jax import generate as gen
    from llmeq_jax.models import ModelConfig, forward, init_params

    config = ModelConfig("llama", 64, 32, 2, 4, 2, 8, 48, 1e-5, 64, False)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: quantize(a, Spec(bits=8)) if "kernel" in jax.tree_util.keystr(path) else a,
        init_params(config, jax.random.key(0)))
    tokens = jnp.zeros((1, 12), jnp.int32)  # 12 rows: past the row kernels' 8

    def flags(text):
        return set(re.findall(r"int_panels = (\d+)", text))

    def prefill_flags(**kw):
        cache = gen.init_cache(config, 1, 16)
        return flags(gen.prefill.lower(config, params, tokens, jnp.ones((1, 12), jnp.int32), cache, **kw).as_text())

    assert prefill_flags() == {"16"} and prefill_flags(activation_bits=8) == {"8"}
    assert gen.generate(config, params, tokens, 3, prompt_activation_bits=8).shape == (1, 3)
    with pytest.raises(ValueError, match="prompt_activation_bits must be one of"):
        gen.generate(config, params, tokens, 3, prompt_activation_bits=4)
    assert flags(jax.jit(lambda p, t: forward(config, p, t)).lower(params, tokens).as_text()) == {"0"}
