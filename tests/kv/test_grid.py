"""KV quantization math: error bounds of the per-channel/per-token grids, outliers, packing, specs, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmeq_jax.core.rope import apply_rope
from llmeq_jax.kv import grid as kvgrid
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.kv.spec import KVSpec, KVSpecError


def _rand(seed, shape, spread=3.0):
    rng = np.random.default_rng(seed)
    # Channels with very different offsets and magnitudes, like real keys.
    chan_scale = np.exp(rng.normal(0, 1, shape[-1])) * spread
    chan_offset = rng.normal(0, 2, shape[-1])
    return jnp.asarray(rng.normal(0, 1, shape) * chan_scale + chan_offset, jnp.float32)


@settings(max_examples=8, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16), d=st.sampled_from([6, 8, 16]))
def test_per_token_roundtrip_within_half_step(bits, seed, d):
    x = _rand(seed, (2, 3, 5, d))
    stored = kvgrid.quantize_per_token(x, bits, 0)
    y = kvgrid.dequantize(stored, bits, d)
    step = np.asarray(stored.scale, np.float32)
    err = np.abs(np.asarray(y) - np.asarray(x))
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-6)
    # The grid is not wasted: the extremes of each token are (nearly) hit.
    assert np.all(np.abs(np.asarray(y).max(-1) - np.asarray(x).max(-1)) <= step[..., 0] / 2 * (1 + 1e-5) + 1e-6)


@settings(max_examples=8, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16))
def test_per_channel_roundtrip_within_half_step(bits, seed):
    x = _rand(seed, (2, 3, 7, 8))
    lo, hi = jnp.min(x, axis=(0, 2)), jnp.max(x, axis=(0, 2))  # per (head, dim) over rows and tokens
    lo, hi = lo[None, :, None, :], hi[None, :, None, :]
    y = kvgrid.quantize_dequantize_keys_per_channel(x, lo, hi, bits)
    scale, _ = kvgrid.grid_from_range(lo, hi, bits)
    err = np.abs(np.asarray(y - x))
    assert np.all(err <= np.asarray(jnp.broadcast_to(scale, x.shape)) / 2 * (1 + 1e-5) + 1e-6)


def test_outliers_restored_and_tighten_the_grid():
    x = np.array(_rand(1, (4, 16), spread=1.0))
    x[:, 3] = 50.0  # one huge entry per token
    x = jnp.asarray(x)
    dense = kvgrid.quantize_per_token(x, 4, 0)
    sparse = kvgrid.quantize_per_token(x, 4, 1)
    y = kvgrid.dequantize(sparse, 4, 16)
    np.testing.assert_allclose(np.asarray(y)[:, 3], 50.0)  # kept in float16, exactly representable
    np.testing.assert_array_equal(np.asarray(sparse.out_idx)[:, 0], 3)
    assert np.all(np.asarray(sparse.scale) < np.asarray(dense.scale) / 3)  # grid no longer stretched by 50
    err_sparse = float(jnp.mean((y - x) ** 2))
    err_dense = float(jnp.mean((kvgrid.dequantize(dense, 4, 16) - x) ** 2))
    assert err_sparse < err_dense / 10


def test_per_channel_outliers_pick_entries_outside_the_range():
    x = jnp.asarray([[0.0, 0.5, 9.0, -0.5], [0.1, -7.0, 0.2, 0.3]])
    lo, hi = -jnp.ones(4), jnp.ones(4)
    scale, lo_s = kvgrid.grid_from_range(lo, hi, 2)
    stored = kvgrid.quantize_per_channel(x, scale, lo_s, hi, 2, 1)
    np.testing.assert_array_equal(np.asarray(stored.out_idx)[:, 0], [2, 1])
    y = kvgrid.dequantize(stored, 2, 4, scale, lo_s)
    np.testing.assert_allclose(np.asarray(y)[[0, 1], [2, 1]], [9.0, -7.0])


@pytest.mark.parametrize("bits,per_byte", [(8, 1), (4, 2), (2, 4)])
def test_codes_are_packed(bits, per_byte):
    x = _rand(2, (3, 16))
    stored = kvgrid.quantize_per_token(x, bits, 0)
    assert stored.q.shape == (3, 16 // per_byte)
    assert stored.q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)


def test_rope_rotate_back_is_inverse():
    x = _rand(3, (1, 2, 5, 8))
    inv = jnp.asarray(1.0 / (10000 ** (np.arange(0, 8, 2) / 8)), jnp.float32)
    pos = jnp.arange(5)[None] + 7
    np.testing.assert_allclose(apply_rope(apply_rope(x, pos, inv, heads_axis=1), -pos, inv, heads_axis=1), x, atol=1e-5)


# --------------------------------------------------------------------------- specs


def test_shorthands_and_mapping():
    assert kvspec.spec_from("int4") == KVSpec(bits=4)
    assert kvspec.spec_from("kv2").bits == 2
    assert kvspec.spec_from("fp") is None and kvspec.spec_from(None) is None
    s = kvspec.spec_from({"bits": 4, "key_granularity": "token", "window": 32, "outlier_frac": 0.01})
    assert (s.bits, s.key_granularity, s.window, s.outlier_frac) == (4, "token", 32, 0.01)


def test_quantizer_dict_roundtrip():
    ranges = kvspec.KeyRanges(-jnp.ones((2, 3, 4)), jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4))
    kv = kvspec.KVQuantizer(ranges, KVSpec(bits=2, window=4))
    back = kvspec.quantizer_from_dict(kv.to_dict())
    assert back.spec == kv.spec
    np.testing.assert_array_equal(back.key_ranges.hi, ranges.hi)


@pytest.mark.parametrize("bits", [3, 16, 0, True])
def test_bad_bits(bits):
    with pytest.raises(KVSpecError, match=r"bits=.* not supported; expected one of \[2, 4, 8\]"):
        KVSpec(bits=bits)


@pytest.mark.parametrize(
    "value,match",
    [
        ("int3", r"bits=3 is not supported"),
        ("int4x", "not understood"),
        ({"window": 4}, "needs 'bits'"),
        ({"bits": 4, "windw": 4}, r"unknown key\(s\) \['windw'\]"),
        ({"bits": 4, "key_granularity": "group"}, "key_granularity='group'"),
        ({"bits": 4, "window": -1}, "window=-1"),
        ({"bits": 4, "sink_tokens": -2}, "sink_tokens=-2 must be an integer >= 0"),
        ({"bits": 4, "outlier_frac": 0.7}, "outlier_frac"),
        ({"bits": 4, "key_range": "dynamic"}, r"key_range='dynamic' is not one of \['static', 'online'\]"),
        ({"bits": 4, "key_range": "online", "key_granularity": "token"}, "is for per-channel keys"),
        ({"bits": 4, "key_range": "online", "ema": 1.0}, r"ema=1.0 must be a number in \[0, 1\)"),
        ({"bits": 4, "key_range": "online", "prompt_tokens": 0}, "prompt_tokens=0 must be an integer >= 1"),
    ],
)
def test_bad_specs(value, match):
    with pytest.raises(KVSpecError, match=match):
        kvspec.spec_from(value)


def test_per_channel_keys_need_ranges():
    with pytest.raises(KVSpecError, match="per-channel keys need calibrated key ranges"):
        kvspec.KVQuantizer(None, KVSpec(bits=4))
    assert kvspec.KVQuantizer(None, KVSpec(bits=4, key_range="online")).key_ranges is None  # online: none needed


def test_observed_ranges_ignore_padding_and_take_the_outlier_band():
    k = jnp.arange(2 * 1 * 5 * 3, dtype=jnp.float32).reshape(2, 1, 5, 3)
    valid = jnp.asarray([[False, True, True, True, False], [True] * 5])
    lo, hi = kvgrid.observed_key_ranges(k, valid)
    np.testing.assert_array_equal(lo[0, 0], k[0, 0, 1])
    np.testing.assert_array_equal(hi[0, 0], k[0, 0, 3])
    np.testing.assert_array_equal(lo[1, 0], k[1, 0, 0])
    np.testing.assert_array_equal(hi[1, 0], k[1, 0, 4])
    band_lo, band_hi = kvgrid.observed_key_ranges(k, valid, 0.5)
    assert bool(jnp.all(band_lo > lo)) and bool(jnp.all(band_hi < hi))


def test_key_ranges_must_match_model_heads():
    kv = kvspec.KVQuantizer(kvspec.KeyRanges(jnp.zeros((5, 2, 8)), jnp.ones((5, 2, 8))), KVSpec(bits=4))
    with pytest.raises(KVSpecError, match=r"shape \(5, 2, 8\); the model needs \[layers, kv_heads, head_dim\] = \[5, 4, 8\]"):
        kv.check(5, 4, 8)
    with pytest.raises(KVSpecError, match="'lo' and 'hi'"):
        kvspec.key_ranges_from_dict({"lo": [[[0.0]]]})


def test_calibrated_ranges_with_outliers_are_a_quantile_band():
    keys = _rand(4, (2, 3, 1, 200, 4))  # [layers, N, KV, S, D]
    full = kvgrid.key_ranges_from_keys(keys)
    band = kvgrid.key_ranges_from_keys(keys, 0.02)
    np.testing.assert_allclose(full.hi, jnp.max(keys, axis=(1, 3)))
    assert np.all(np.asarray(band.hi) < np.asarray(full.hi)) and np.all(np.asarray(band.lo) > np.asarray(full.lo))
    inside = np.mean((np.asarray(keys) <= np.asarray(band.hi)[:, None, :, None]) &
                     (np.asarray(keys) >= np.asarray(band.lo)[:, None, :, None]))
    assert 0.95 < inside < 1.0


def test_calibrated_ranges_leave_out_the_sink_tokens():
    keys = _rand(5, (2, 3, 1, 40, 4)).at[:, :, :, 1].set(50.0)  # token 1 of every window far outside
    np.testing.assert_allclose(kvgrid.key_ranges_from_keys(keys).hi, 50.0)
    ranges = kvgrid.key_ranges_from_keys(keys, sink_tokens=2)
    np.testing.assert_allclose(ranges.hi, jnp.max(keys[:, :, :, 2:], axis=(1, 3)))
    with pytest.raises(KVSpecError, match="sink_tokens=40 leaves no calibration token of the 40"):
        kvgrid.key_ranges_from_keys(keys, sink_tokens=40)


def test_jit_compatible():
    x = _rand(5, (2, 8))
    f = jax.jit(lambda a: kvgrid.quantize_dequantize_values(a, 4, 1))
    np.testing.assert_allclose(f(x), kvgrid.quantize_dequantize_values(x, 4, 1))
