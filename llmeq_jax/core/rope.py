"""Rotary position embeddings (RoPE): the inverse frequencies and the rotation.

One implementation for the models (queries/keys as they are projected) and the KV
cache (pre-RoPE keys rotated after dequantization, and the kernels' references).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


FREQ_FACTORS = "freq_factors"  # the rope_scaling key of per-frequency divisors (GGUF's rope_freqs.weight)


def freq_factors_scaling(factors) -> tuple:
    """A ``ModelConfig.rope_scaling`` of per-frequency divisors: frequency i is ``inv_freq[i] / factors[i]`` (what
    llama.cpp computes from a GGUF file's ``rope_freqs.weight``; Llama-3.1 files carry their scaling so)."""
    return ((FREQ_FACTORS, tuple(float(f) for f in np.asarray(factors, np.float32).reshape(-1))),)


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Inverse frequencies (head_dim/2,), with Llama-3 style scaling or per-frequency divisors when configured."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    s = dict(scaling)
    if FREQ_FACTORS in s:
        factors = np.asarray(s[FREQ_FACTORS], np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope {FREQ_FACTORS}: {factors.size} factors for head_dim {head_dim} "
                             f"(expected {inv_freq.size})")
        return (inv_freq / factors).astype(np.float32)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def freq_factors(head_dim: int, theta: float, scaling: tuple) -> np.ndarray:
    """The per-frequency divisors (head_dim/2,) float32 of a scaling (Llama-3 parameters or divisors already):
    the unscaled inverse frequencies over the scaled ones, as llama.cpp's converter writes ``rope_freqs.weight``."""
    s = dict(scaling)
    if FREQ_FACTORS in s:
        return np.asarray(s[FREQ_FACTORS], np.float32)
    return (rope_inv_freq(head_dim, theta, None).astype(np.float64)
            / rope_inv_freq(head_dim, theta, scaling).astype(np.float64)).astype(np.float32)


# Cody-Waite reduction of an angle by whole turns in two constants: exact for turns * _TWO_PI_HI while turns < 2^16
# (angles below ~4e5 rad, a 128K context's), so the float32 angle itself is the only error.
_TWO_PI_HI = 6.28125  # 201 / 32: eight significant bits
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI


def reduced_angle(angle, turns=None):
    """``angle`` (float32) minus its nearest whole number of turns: the same cosine and sine, in [-pi, pi] -- for a
    GPU's approximate cos / sin, accurate near zero only. ``turns``: that number, where the caller rounds it itself
    (Mosaic GPU lowers no floor: ``jnp.round(angle / (2 pi))``); default ``floor(angle / (2 pi) + 1/2)``."""
    if turns is None:
        turns = jnp.floor(angle * (1.0 / (2 * math.pi)) + 0.5)
    return (angle - turns * _TWO_PI_HI) - turns * _TWO_PI_LO


# Positions per call from which the tables are computed apart from the rotation (prefill); a decode
# step's few positions keep them fused (a conditional per layer costs more than it saves there).
_TABLES_APART_FROM = 16


class RopeTables(NamedTuple):
    """``cos`` / ``sin`` of each position's angles, [B, T, head_dim / 2] each: computed once per forward and
    passed to every layer in place of the positions (else a scanned decode step evaluated them again in
    each layer: two GPU kernels a layer, 76 µs of a 2.5 ms Llama-2-7B step on an H200)."""

    cos: jax.Array
    sin: jax.Array


def _tables(angles: jax.Array) -> RopeTables:
    return RopeTables(jnp.cos(angles), jnp.sin(angles))


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> RopeTables:
    """``(cos, sin)`` of ``positions`` [B, T] times ``inv_freq``: [B, T, head_dim / 2] each."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    from pallas_kernels import config  # the backend traced for (compiling_for may name a GPU from a CPU)

    if config.target_backend() != "cpu" or positions.shape[-1] < _TABLES_APART_FROM or jax.device_count() > 1:
        return _tables(angles)
    # XLA CPU fuses cos / sin into the rotation and evaluates them again for every head (9x for
    # SmolLM2's queries: 0.8 ms of a 20 ms prefill layer, vs 0.1 ms with the tables computed once).
    # A conditional is a fusion boundary XLA keeps (optimization_barrier is dropped before fusion
    # on CPU); both branches are the same, so its predicate does not matter. Not with several
    # devices: XLA's SPMD partitioner then replicated the conditional and everything after it
    # (a data-sharded forward came back replicated).
    return jax.lax.cond(positions.reshape(-1)[0] >= 0, _tables, _tables, angles)


def apply_rope(x: jax.Array, positions: jax.Array | RopeTables, inv_freq: np.ndarray, *,
               heads_axis: int = 2) -> jax.Array:
    """Rotate ``x`` by ``positions`` [B, T] or their :class:`RopeTables` (rotate-half layout, as in HF Llama).

    ``x`` is [B, T, H, D] (``heads_axis=2``, the models' layout) or [B, H, T, D]
    (``heads_axis=1``, the KV cache's layout).
    """
    cos, sin = (jnp.expand_dims(jnp.concatenate([a, a], axis=-1), heads_axis)  # [B, T, 1, D] / [B, 1, T, D]
                for a in (positions if isinstance(positions, RopeTables) else rope_tables(positions, inv_freq)))
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
