"""Rotary position embeddings (RoPE): the inverse frequencies and the rotation.

One implementation for the models (queries/keys as they are projected) and the KV
cache (pre-RoPE keys rotated after dequantization, and the kernels' references).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Inverse frequencies (head_dim/2,), with Llama-3 style scaling when configured."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    s = dict(scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *, heads_axis: int = 2) -> jax.Array:
    """Rotate ``x`` by ``positions`` [B, T] (rotate-half layout, as in HF Llama).

    ``x`` is [B, T, H, D] (``heads_axis=2``, the models' layout) or [B, H, T, D]
    (``heads_axis=1``, the KV cache's layout).
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    angles = jnp.expand_dims(jnp.concatenate([angles, angles], axis=-1), heads_axis)  # [B, T, 1, D] / [B, 1, T, D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
