"""KV-cache grid math: asymmetric min/max grids, codes, per-token / per-channel quantize, outliers.

Pure functions on arrays (no cache, no model): the layer the Pallas KV kernels may import
(with :mod:`llmeq_jax.kv.spec` and :mod:`llmeq_jax.core.rope`). What the grids are and why:
see :mod:`llmeq_jax.kv.spec`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llmeq_jax.core.qarray import int_range, pack, unpack
from llmeq_jax.kv.spec import KeyRanges, KVSpecError

SCALE_DTYPE = jnp.float16  # per-token scales/mins and outlier values


# --------------------------------------------------------------------------- grid


def grid_from_range(lo: jax.Array, hi: jax.Array, bits: int, dtype=jnp.float32):
    """(scale, lo) of the asymmetric grid over [lo, hi], rounded to the storage ``dtype``."""
    levels = 2**bits - 1
    # Round lo down and the scale up to the storage dtype, so the stored grid
    # still covers [lo, hi] and the error bound stays scale / 2.
    # The barriers make the rounding real under jit: XLA on GPU may otherwise keep a
    # float32 value where the program asks for float16 (excess precision), and codes
    # computed with the unrounded grid would not invert exactly with the stored one.
    lo = lo.astype(jnp.float32)
    lo_s = _materialized(lo.astype(dtype))
    lo_s = _materialized(jnp.where(lo_s.astype(jnp.float32) > lo, jnp.nextafter(lo_s, jnp.asarray(-jnp.inf, dtype)), lo_s))
    span = hi.astype(jnp.float32) - lo_s.astype(jnp.float32)
    scale = jnp.maximum(jnp.where(span > 0, span / levels, 1.0), jnp.finfo(jnp.float16).tiny)
    scale_s = _materialized(scale.astype(dtype))
    scale_s = jnp.where(scale_s.astype(jnp.float32) < scale, jnp.nextafter(scale_s, jnp.asarray(jnp.inf, dtype)), scale_s)
    return _materialized(scale_s), lo_s


def _materialized(x: jax.Array) -> jax.Array:
    """``x`` exactly as its dtype holds it (no-op for float32; see :func:`grid_from_range`)."""
    return x if x.dtype == jnp.float32 else jax.lax.optimization_barrier(x)


def quantize_grid(x: jax.Array, scale: jax.Array, lo: jax.Array, bits: int) -> jax.Array:
    """Unsigned codes ``[0, 2^bits-1]`` shifted into the signed storage range (int8, not packed)."""
    qmin, _ = int_range(bits)
    u = jnp.clip(jnp.round((x.astype(jnp.float32) - lo.astype(jnp.float32)) / scale.astype(jnp.float32)), 0, 2**bits - 1)
    return (u + qmin).astype(jnp.int8)


def dequantize_grid(q: jax.Array, scale: jax.Array, lo: jax.Array, bits: int) -> jax.Array:
    qmin, _ = int_range(bits)
    return (q.astype(jnp.float32) - qmin) * scale.astype(jnp.float32) + lo.astype(jnp.float32)


def outlier_indices(x: jax.Array, lo: jax.Array, hi: jax.Array, n: int) -> jax.Array:
    """Indices ``[..., n]`` of the ``n`` entries of each vector (last axis) furthest outside [lo, hi].

    Distance is measured in units of the range, from its centre, so inside-range
    entries rank by how close they are to the edges (the largest magnitudes).
    """
    centre, half = (hi + lo) / 2, jnp.maximum((hi - lo) / 2, 1e-12)
    score = jnp.abs(x.astype(jnp.float32) - centre) / half
    return jax.lax.top_k(score, n)[1]


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, idx, axis=-1)


def _scatter(x: jax.Array, idx: jax.Array, vals: jax.Array) -> jax.Array:
    """``x`` with ``x[..., idx[..., j]] = vals[..., j]`` (n is small: a loop of selects)."""
    lanes = jnp.arange(x.shape[-1])
    for j in range(idx.shape[-1]):
        x = jnp.where(lanes == idx[..., j : j + 1], vals[..., j : j + 1].astype(x.dtype), x)
    return x


# --------------------------------------------------------------------------- stored form


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """Quantized vectors ``[..., D]`` (keys or values of some tokens).

    q: packed codes (uint8 for 2/4 bits, int8 for 8 bits), last axis D / per-byte.
    scale, lo: ``[..., 1]`` float16 per token, or None when the grid is per channel (held elsewhere).
    out_idx (uint8), out_val (float16): ``[..., n]`` sparse outliers, or None.
    """

    q: jax.Array
    scale: jax.Array | None
    lo: jax.Array | None
    out_idx: jax.Array | None
    out_val: jax.Array | None


def quantize_per_token(x: jax.Array, bits: int, n_out: int) -> QuantizedKV:
    """Each vector (last axis) on its own min/max grid; the ``n_out`` largest magnitudes kept in float."""
    xf = x.astype(jnp.float32)
    idx = val = None
    inside = xf
    if n_out:
        idx = jax.lax.top_k(jnp.abs(xf), n_out)[1]
        val = _take(xf, idx).astype(SCALE_DTYPE)
        # Range over the remaining (dense) entries: outliers are replaced by a dense entry's value.
        fill = _take(xf, jnp.argmin(jnp.abs(xf), axis=-1, keepdims=True))
        inside = _scatter(xf, idx, jnp.broadcast_to(fill, idx.shape))
    scale, lo = grid_from_range(jnp.min(inside, -1, keepdims=True), jnp.max(inside, -1, keepdims=True), bits, SCALE_DTYPE)
    q = pack(quantize_grid(xf, scale, lo, bits), bits, -1)
    return QuantizedKV(q, scale, lo, None if idx is None else idx.astype(jnp.uint8), val)


def quantize_per_channel(x: jax.Array, scale: jax.Array, lo: jax.Array, hi: jax.Array, bits: int, n_out: int) -> QuantizedKV:
    """Vectors on a given per-channel grid (``scale``, ``lo``, ``hi`` broadcast against ``x``)."""
    xf = x.astype(jnp.float32)
    idx = val = None
    if n_out:
        idx = outlier_indices(xf, lo, hi, n_out)
        val = _take(xf, idx).astype(SCALE_DTYPE)
    q = pack(quantize_grid(xf, scale, lo, bits), bits, -1)
    return QuantizedKV(q, None, None, None if idx is None else idx.astype(jnp.uint8), val)


def dequantize(stored: QuantizedKV, bits: int, head_dim: int, scale=None, lo=None) -> jax.Array:
    """Float32 vectors ``[..., D]``; per-channel grids pass ``scale``/``lo`` (broadcastable)."""
    scale = stored.scale if scale is None else scale
    lo = stored.lo if lo is None else lo
    x = dequantize_grid(unpack(stored.q, bits, -1, head_dim), scale, lo, bits)
    if stored.out_idx is not None:
        x = _scatter(x, stored.out_idx.astype(jnp.int32), stored.out_val.astype(jnp.float32))
    return x


def quantize_dequantize_values(v: jax.Array, bits: int, n_out: int = 0) -> jax.Array:
    """What the cache returns for values ``[..., D]`` (per token)."""
    return dequantize(quantize_per_token(v, bits, n_out), bits, v.shape[-1])


def quantize_dequantize_keys_per_channel(k: jax.Array, lo: jax.Array, hi: jax.Array, bits: int, n_out: int = 0):
    """What the cache returns for keys ``[..., D]`` on a per-channel range ``lo``/``hi`` (broadcastable)."""
    scale, lo_s = grid_from_range(lo, hi, bits)
    return dequantize(quantize_per_channel(k, scale, lo_s, hi, bits, n_out), bits, k.shape[-1], scale, lo_s)


# --------------------------------------------------------------------------- observed key ranges


def key_ranges_from_keys(keys: jax.Array, outlier_frac: float = 0.0, sink_tokens: int = 0) -> KeyRanges:
    """Per-channel range of calibration keys ``[layers, N, kv_heads, S, head_dim]`` (N rows, S tokens).

    With outliers, the range is the central ``1 - outlier_frac`` quantile band:
    the entries beyond it are the ones the sparse part keeps in float. The first
    ``sink_tokens`` tokens of each row are left out (the cache keeps them in float).
    """
    if sink_tokens >= keys.shape[3]:
        raise KVSpecError(f"sink_tokens={sink_tokens} leaves no calibration token of the {keys.shape[3]} per window")
    keys = keys[:, :, :, sink_tokens:]
    # Layers play the role of rows: every calibration token of a layer counts.
    k = jnp.moveaxis(keys, 2, 1).reshape(keys.shape[0], keys.shape[2], -1, keys.shape[-1])
    lo, hi = observed_key_ranges(k, jnp.ones((k.shape[0], k.shape[2]), bool), outlier_frac)
    return KeyRanges(lo.astype(jnp.float32), hi.astype(jnp.float32))


def observed_key_ranges(keys: jax.Array, valid: jax.Array, outlier_frac: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Per-row, per-channel range of ``keys`` ``[B, KV, T, D]`` over the tokens where ``valid`` ``[B, T]``.

    -> ``(lo, hi)`` each ``[B, KV, D]``. With outliers, the central ``1 - outlier_frac``
    band (as :func:`key_ranges_from_keys`); a row without valid tokens gets ``[0, 0]``.
    """
    k = keys.astype(jnp.float32)
    ok = valid[:, None, :, None]
    if outlier_frac > 0:
        masked = jnp.where(ok, k, jnp.nan)
        lo = jnp.nanquantile(masked, outlier_frac / 2, axis=2)
        hi = jnp.nanquantile(masked, 1 - outlier_frac / 2, axis=2)
    else:
        lo = jnp.min(jnp.where(ok, k, jnp.inf), axis=2)
        hi = jnp.max(jnp.where(ok, k, -jnp.inf), axis=2)
    lo, hi = jnp.nan_to_num(lo, posinf=0.0, neginf=0.0), jnp.nan_to_num(hi, posinf=0.0, neginf=0.0)
    return lo, jnp.maximum(hi, lo)
