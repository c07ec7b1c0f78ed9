"""FP8 (E4M3) grids: each value an 8-bit float, one float32 scale per tile.

The OCP ``E4M3FN`` format (``jnp.float8_e4m3fn``): 1 sign, 4 exponent, 3 mantissa
bits, no infinities, largest magnitude 448, subnormals down to 2^-9. A tile's scale
maps its absmax onto 448, so

    code  = float8_e4m3fn(clip(x / scale, -448, 448))     (round to nearest, ties to even)
    value = float32(code) * scale,    scale = absmax / 448

The codes are stored as their bit patterns in int8 (``QArray.qvalue``, like every
other 8-bit code: checkpoints, packing and byte counts need nothing new) and
bit-cast back to ``float8_e4m3fn`` where a dot consumes them. On a GPU with FP8
tensor cores (sm_89+: Ada, Hopper) an FP8 x FP8 -> float32 dot runs at twice the
bf16 rate; elsewhere XLA widens the operands. The clip before the cast matters:
E4M3FN has no infinity, so a ratio past 448 would become NaN.

Relative error is what a float grid bounds: about 2^-4 of each value (3 mantissa
bits) for any magnitude within 2^-6 .. 448 of the scale, where a uniform int8 grid
has a fixed step of absmax / 127 -- so FP8 keeps small values of a tile that has a
few large ones (activation outliers) better than int8, and large values worse.

Pure functions on expanded arrays (``ratio = x / scale`` already broadcast);
:mod:`llmeq_jax.core.quantize` computes the scales and tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPE = jnp.float8_e4m3fn
# Largest finite E4M3FN magnitude: a tile's absmax maps onto it.
MAX = float(jnp.finfo(DTYPE).max)


def encode(ratio: jax.Array) -> jax.Array:
    """int8 bit patterns of the E4M3 values nearest to ``ratio`` (clipped to +-448 first: no NaN codes)."""
    return as_codes(to_fp8(ratio))


def to_fp8(ratio: jax.Array) -> jax.Array:
    """``ratio`` as ``float8_e4m3fn``, saturated at +-448 (a plain cast would give NaN past it)."""
    return jnp.clip(ratio.astype(jnp.float32), -MAX, MAX).astype(DTYPE)


def as_fp8(codes: jax.Array) -> jax.Array:
    """Stored int8 bit patterns as ``float8_e4m3fn`` values (a bit cast, no arithmetic)."""
    return jax.lax.bitcast_convert_type(codes.astype(jnp.int8), DTYPE)


def as_codes(values: jax.Array) -> jax.Array:
    """``float8_e4m3fn`` values as the int8 bit patterns a QArray stores."""
    return jax.lax.bitcast_convert_type(values, jnp.int8)


def decode(codes: jax.Array) -> jax.Array:
    """Value of each stored code relative to its scale, as float32."""
    return as_fp8(codes).astype(jnp.float32)


def scale_from_absmax(amax: jax.Array) -> jax.Array:
    """Per-tile scale mapping ``amax`` onto 448; an all-zero tile gets 1, a non-finite one NaN."""
    tiny = jnp.finfo(jnp.float32).tiny
    scale = jnp.where(amax > 0, amax / MAX, 1.0)
    return jnp.where(jnp.isfinite(amax), jnp.maximum(scale, tiny), jnp.nan)

