"""Pieces every kernel shares: Triton-safe rounding, nibble unpacking, masked tile I/O, blocks.

Why hand-written rounding: the Pallas Triton lowering of this JAX version
(0.10.2) has no rule for ``lax.round_p`` (``jnp.round`` and ``jnp.rint`` both
lower to it), so a kernel that calls ``jnp.round`` fails to lower for CUDA.
:func:`round_half_even` builds the same IEEE round-half-to-even from ``floor``,
``where`` and arithmetic, all of which lower.

Why explicit masks: Pallas' Triton lowering turns a block index into plain
pointer offsets without bounds checks, so a block that runs past the end of an
array reads (and writes) out of bounds. Every tile load/store here carries a
mask built from the logical sizes, so ragged M/N/K are handled, not rejected.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TINY = float(jnp.finfo(jnp.float32).tiny)
# tl.dot needs every operand dim >= 16 on NVIDIA tensor cores.
MIN_DOT = 16


def round_half_even(v: jax.Array) -> jax.Array:
    """``jnp.round`` (ties to even) for float32 without ``round_p``.

    f = floor(v) and d = v - f are exact for float32; ties (d == 0.5) go to the
    even neighbour: f + (f mod 2). Values with |v| >= 2^23 are integers (d == 0).
    """
    f = jnp.floor(v)
    d = v - f
    odd = f - 2.0 * jnp.floor(f * 0.5)  # 1.0 when f is odd, else 0.0
    up = jnp.where(d == 0.5, odd, 0.0)
    return jnp.where(d > 0.5, f + 1.0, f + up)


def quantize_sym(v: jax.Array, scale: jax.Array, qmax: int) -> jax.Array:
    """Symmetric grid, core numerics: clip(round(v / scale), -qmax, qmax) as int32."""
    q = round_half_even(v / scale)
    return jnp.clip(q, -float(qmax), float(qmax)).astype(jnp.int32)


def low_nibble(b: jax.Array) -> jax.Array:
    """Signed value of the low 4 bits of each (int32-widened) byte."""
    return ((b & 15) ^ 8) - 8


def high_nibble(b: jax.Array) -> jax.Array:
    """Signed value of the high 4 bits of each (int32-widened) byte."""
    return (((b >> 4) & 15) ^ 8) - 8


def pack_nibbles(even: jax.Array, odd: jax.Array) -> jax.Array:
    """Two int32 arrays of 4-bit values -> bytes ``(even & 0xF) | ((odd & 0xF) << 4)`` (as int32)."""
    return (even & 15) | ((odd & 15) << 4)


def split_pairs(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(..., 2n) -> elements at even and odd positions of the last dim, each (..., n).

    Written as reshape + split because the Triton lowering supports that (a
    strided slice is not supported by interpret mode, and stacking along a
    non-last axis is not supported by the Triton lowering).
    """
    *lead, n = v.shape
    pairs = v.reshape(*lead, n // 2, 2)
    even, odd = jnp.split(pairs, 2, axis=-1)
    return even.reshape(*lead, n // 2), odd.reshape(*lead, n // 2)


def interleave_pairs(even: jax.Array, odd: jax.Array) -> jax.Array:
    """Inverse of :func:`split_pairs` (stack along the last dim, which Triton supports)."""
    *lead, n = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(*lead, 2 * n)


def span(start, size: int, limit: int):
    """(pl.ds(start, size), in-bounds mask of length ``size``) for one dim."""
    idx = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
    return pl.ds(start, size), idx < limit


def load_tile(ref, rows, cols, other=0):
    """Masked 2-D tile load; ``rows``/``cols`` are :func:`span` results."""
    (rs, rm), (cs, cm) = rows, cols
    return plgpu.load(ref.at[rs, cs], mask=rm[:, None] & cm[None, :], other=other)


def store_tile(ref, rows, cols, value):
    (rs, rm), (cs, cm) = rows, cols
    plgpu.store(ref.at[rs, cs], value, mask=rm[:, None] & cm[None, :])


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    """Triton compiler params; passing them also selects the Triton (not Mosaic GPU) backend."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
