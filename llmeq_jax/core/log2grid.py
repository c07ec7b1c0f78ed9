"""Power-of-two ("log2") grids: a sign and an exponent per value, one float scale per tile.

A ``b``-bit log2 code ``c`` is a signed integer in ``[-qmax, qmax]`` with
``qmax = 2^(b-1) - 1`` (the symmetric uniform range, so codes pack exactly like
uniform ones: two 4-bit codes per byte). Its value is

    c == 0 :  0
    c != 0 :  sign(c) * scale * 2^(|c| - qmax)

so the magnitudes are ``scale * {2^(1-qmax), ..., 1/4, 1/2, 1}``; the scale is
the tile's absmax (its largest value is exactly representable). A 4-bit code has
7 magnitudes spanning 2^-6 .. 1: a far wider dynamic range than the uniform grid's
1/7 .. 1, at the price of coarse steps near the top. That suits heavy-tailed
tensors (a few large values, many small ones) and is what "LogQuant"-style
methods (Miyashita et al. 2016, arXiv:1603.01025) build on.

Encoding rounds to the *nearest level in linear space* (the squared-error optimum),
not in log space: between ``2^k`` and ``2^(k+1)`` the switch is at ``1.5 * 2^k``,
between 0 and the smallest level at half that level.

Pure functions on expanded arrays (``ratio = x / scale`` already broadcast);
:mod:`llmeq_jax.core.quantize` computes the scales and tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmeq_jax.core.qarray import int_range


def qmax(bits: int) -> int:
    """Largest code (= number of nonzero magnitudes) of a ``bits``-bit log2 grid."""
    return int_range(bits)[1]


def magnitudes(bits: int) -> jax.Array:
    """The nonzero magnitudes of the grid relative to the scale, smallest first."""
    m = qmax(bits)
    return jnp.exp2(jnp.arange(1 - m, 1, dtype=jnp.float32))


def encode(ratio: jax.Array, bits: int) -> jax.Array:
    """int8 codes of ``ratio = x / scale`` (values beyond +-1 clip to the largest magnitude)."""
    m = qmax(bits)
    r = jnp.minimum(jnp.abs(ratio.astype(jnp.float32)), 1.0)
    # Level index with magnitude <= r (0 when r is below the smallest level). floor(log2 r) may be
    # one off at exact powers of two; the nearest-of-two choice below absorbs that either way.
    k = jnp.clip(jnp.floor(jnp.log2(jnp.maximum(r, jnp.finfo(jnp.float32).tiny))) + m, 0, m)
    lower = jnp.where(k >= 1, jnp.exp2(k - m), 0.0)
    upper = jnp.exp2(jnp.minimum(k + 1, m) - m)
    k = jnp.where(r - lower > upper - r, jnp.minimum(k + 1, m), k)
    return (jnp.sign(ratio) * k).astype(jnp.int8)


def decode(codes: jax.Array, bits: int) -> jax.Array:
    """Value of each ``bits``-bit code relative to the scale (float32): ``sign(c) * 2^(|c| - qmax)``, 0 for 0."""
    c = codes.astype(jnp.float32)
    mag = jnp.where(c == 0, 0.0, jnp.exp2(jnp.abs(c) - qmax(bits)))
    return jnp.sign(c) * mag


def scale_from_absmax(amax: jax.Array) -> jax.Array:
    """Per-tile scale = absmax (the top magnitude is 1); an all-zero tile gets 1, a non-finite one NaN."""
    tiny = jnp.finfo(jnp.float32).tiny
    scale = jnp.where(amax > 0, amax, 1.0)
    return jnp.where(jnp.isfinite(amax), jnp.maximum(scale, tiny), jnp.nan)
