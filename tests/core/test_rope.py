"""RoPE: the rotation against a float64 reference, in both layouts, and its tables computed once."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.rope import apply_rope, reduced_angle, rope_inv_freq, rope_tables


def _reference(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE in float64 for x [B, T, H, D]."""
    angles = positions[..., None].astype(np.float64) * inv_freq.astype(np.float64)  # [B, T, D/2]
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("heads_axis", [2, 1])
def test_apply_rope_matches_a_float64_reference(heads_axis):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 40, 3, 16)).astype(np.float32)
    positions = np.stack([np.arange(40), np.arange(7, 47)])  # a left-padded row starts later
    inv = rope_inv_freq(16, 10000.0, None)
    xin = x if heads_axis == 2 else x.transpose(0, 2, 1, 3)
    y = np.asarray(jax.jit(lambda a, p: apply_rope(a, p, inv, heads_axis=heads_axis))(xin, positions))
    y = y if heads_axis == 2 else y.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(y, _reference(x, positions, inv), rtol=0, atol=2e-5)


def test_rope_tables_are_computed_once_per_call_not_per_head():
    """On CPU the tables sit behind a conditional, so XLA cannot fuse cos / sin into the
    rotation and evaluate them for every head (what made RoPE 8x slower than a copy)."""
    inv = rope_inv_freq(64, 10000.0, None)
    x = jnp.ones((1, 32, 9, 64), jnp.float32)
    hlo = jax.jit(lambda a, p: apply_rope(a, p, inv)).lower(x, jnp.arange(32)[None]).compile().as_text()
    cos, sin = jax.jit(lambda p: rope_tables(p, inv))(jnp.arange(32)[None])
    assert cos.shape == sin.shape == (1, 32, 32)
    np.testing.assert_allclose(np.asarray(cos), np.cos(np.arange(32)[:, None] * inv)[None], atol=2e-6)
    if jax.default_backend() == "cpu":
        assert "conditional(" in hlo
        fusions = hlo.split("\n\n")
        rotation = [f for f in fusions if "f32[1,32,9,64]" in f and "ROOT" in f and "fused_computation" in f]
        assert rotation and not any("cosine(" in f or "sine(" in f for f in rotation)


LLAMA31 = (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
           ("original_max_position_embeddings", 8192.0))


def _converter_factors(head_dim, theta, factor, low, high, old_len):
    """llama.cpp's convert_hf_to_gguf.py rope_freqs for llama3 scaling, as that script computes them."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_freq_factors_are_llama_cpps_rope_freqs_and_give_back_the_llama3_frequencies():
    from llmeq_jax.core.rope import FREQ_FACTORS, freq_factors, freq_factors_scaling

    factors = freq_factors(128, 500000.0, LLAMA31)
    want = _converter_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192.0)
    np.testing.assert_allclose(factors, want, rtol=2e-7)
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()  # all three bands
    scaled = rope_inv_freq(128, 500000.0, LLAMA31)
    scaling = freq_factors_scaling(factors)
    assert scaling[0][0] == FREQ_FACTORS and hash(scaling)  # a ModelConfig field: hashable
    np.testing.assert_allclose(rope_inv_freq(128, 500000.0, scaling), scaled, rtol=3e-7)
    np.testing.assert_array_equal(freq_factors(128, 500000.0, scaling), factors)  # divisors stay as they are
    with pytest.raises(ValueError, match="3 factors for head_dim 128"):
        rope_inv_freq(128, 500000.0, freq_factors_scaling(factors[:3]))


def test_rope_angles_are_reduced_to_one_turn_exactly_enough():
    """The pre-RoPE kernels reduce pos * freq to [-pi, pi] before the GPU's approximate cos / sin: up to the
    angles of a 128K context the reduced angle has the float32 angle's cosine and sine (float64 reference)."""
    angle = jnp.asarray(np.concatenate([np.linspace(-7, 7, 101), np.geomspace(1, 131072, 400)]), jnp.float32)
    exact = np.asarray(angle, np.float64)  # the float32 angle, taken as exact
    # the default turns (floor), and those of Mosaic GPU's kernel (round to nearest even)
    for turns in (None, jnp.round(angle * (1 / (2 * np.pi)))):
        r = np.asarray(reduced_angle(angle, turns), np.float64)
        assert np.all(np.abs(r) <= np.pi + 1e-6)
        np.testing.assert_allclose(np.cos(r), np.cos(exact), atol=2e-6)
        np.testing.assert_allclose(np.sin(r), np.sin(exact), atol=2e-6)
