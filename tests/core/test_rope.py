"""RoPE: the rotation against a float64 reference, in both layouts, and its tables computed once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.rope import apply_rope, rope_inv_freq, rope_tables


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
