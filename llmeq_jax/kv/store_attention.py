"""Decode attention over the quantized KV store in XLA ops, the grids folded out of the dots.

The Pallas decode kernel (:func:`pallas_kernels.kv_cache.store_decode_attention`) reads the store's
codes where they lie. This is the same computation written for XLA, so that a GPU can run it as
XLA's own GEMM fusions (which stream a bf16 cache at ~2.5 TB/s on an H200) where the kernel is
slower: no dequantized copy of the store is ever asked for, only dots whose code operand is a
conversion of the stored integers, which XLA fuses into the GEMM's operand load.

The grids come off outside the dots (same algebra as the kernel):

* keys, per channel ``k = (c - qmin) * s_k + lo_k``:
  ``q . k = (q * s_k) . c + q . (lo_k - qmin * s_k)``; the second term is one number per query
  (it shifts every score of a row alike, but the log-sum-exp keeps it);
* values, per token ``v = (c - qmin) * s_v + lo_v``:
  ``sum_t p_t v_t = (p * s_v) . c + sum_t p_t (lo_v - qmin * s_v)_t``.

int4 codes are two's complement nibbles, low nibble first (``core.qarray.pack``): exactly the
memory layout of ``jnp.int4``, so the store is bitcast, not unpacked.

Only post-RoPE keys: a key stored before RoPE is rotated by its slot's angle, which no single
dot over the codes can express (the cache dequantizes those through :mod:`llmeq_jax.kv.cache`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from llmeq_jax.core.qarray import int_range

NEG_INF = -1e30  # finite: a row with no allowed slot gives lse ~ -1e30, not nan (as the kernel)


def codes(stored: jax.Array, bits: int) -> jax.Array:
    """The store's codes ``[..., D]`` as signed integers, without unpacking arithmetic: int8 as is, int4
    (uint8 bytes, low nibble first) bitcast to ``jnp.int4``."""
    if bits == 8:
        return stored
    if bits != 4:
        raise ValueError(f"store_attention: bits={bits} is not supported; expected 4 or 8")
    nibbles = jax.lax.bitcast_convert_type(stored, jnp.int4)  # [..., D/2, 2], low nibble first
    # The barrier keeps the bitcast out of the GEMM fusion that reads the codes (a free bitcast of the
    # buffer on its own; the barrier itself compiles to nothing): XLA 0.11.2 aborted the process
    # compiling the bitcast inside a Triton GEMM fusion for a GPU (triton_tiling_propagation.cc:557,
    # "Check failed: dst_dim_it != dst_dim_end"; scripts/gpu_aot.py-style deviceless compile, H200).
    return jax.lax.optimization_barrier(nibbles.reshape(*stored.shape[:-1], stored.shape[-1] * 2))


def operand_dtype(q_dtype):
    """The dots' operand dtype: bfloat16 for half queries -- codes up to 8 bits are exact in it, and the float
    side (q times the key scales, the weights times the value scales) is rounded to it as a bf16 cache's
    attention rounds q and the weights (float16 would need a power-of-two scaling per row, two reductions and
    their launches more on a GPU); float32 for float32 queries (dots at HIGHEST precision)."""
    half = jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return jnp.dtype(jnp.bfloat16) if half else jnp.dtype(jnp.float32)


def fold_key_grid(q, k_scale, k_lo, heads: int, bits: int, sm_scale: float):
    """The per-channel key grid folded into the queries: ``(q s_k sm [B, H, G, D], q . (lo_k - qmin s_k) sm [B, H,
    G])`` in float32 for queries ``q [B, H * G, D]`` and a key grid ``[B or 1, H, 1, D]``. The first is the
    dot's operand against the codes; the second shifts every score of its query alike."""
    bsz, hq, d = q.shape
    qmin, _ = int_range(bits)
    qg = q.astype(jnp.float32).reshape(bsz, heads, hq // heads, d) * sm_scale
    k_scale, k_lo = k_scale.astype(jnp.float32), k_lo.astype(jnp.float32)
    return qg * k_scale, jnp.einsum("bhgd,bhzd->bhg", qg, k_lo - qmin * k_scale)


def slot_mask(length, allowed, bsz: int, slots: int) -> jax.Array:
    """The slots each row reads ``[B, slots]`` bool: written (below ``length``, [B] or a scalar) and ``allowed``
    ([B, slots], or None: all)."""
    ok = jnp.arange(slots)[None, :] < jnp.broadcast_to(jnp.asarray(length, jnp.int32), (bsz,))[:, None]
    return ok if allowed is None else ok & allowed.astype(bool)


def store_attention(q, k_codes, v_codes, k_scale, k_lo, v_scale, v_lo, length, *, bits: int, allowed=None,
                    sm_scale: float | None = None, layer=None):
    """Single-query attention over one layer of the quantized store -> ``(out [B, H_q, D] float32, lse [B, H_q])``.

    Arguments as :func:`pallas_kernels.kv_cache.store_decode_attention` (post-RoPE keys): codes
    ``[B, H_kv, T, D / per-byte]``, key grid ``[B or 1, H_kv, 1, D]``, value grid ``[B, H_kv, T, 1]``,
    ``length`` ``[B]`` or scalar, ``allowed`` ``[B, T]``; ``layer`` picks one layer of stacked stores.
    """
    # The codes of the whole stack, then the layer: a layer sliced before the int4 bitcast's barrier would be
    # copied out of the stack every step (deviceless compile for an H200: 128 MiB a layer at 32K slots).
    k_codes, v_codes = codes(k_codes, bits), codes(v_codes, bits)
    if layer is not None:
        k_codes, v_codes, v_scale, v_lo = (a[layer] for a in (k_codes, v_codes, v_scale, v_lo))
    bsz, h, t = k_codes.shape[:3]
    if q.ndim != 3 or q.shape[0] != bsz or q.shape[1] % h:
        raise ValueError(f"store_attention: q must be [B={bsz}, H_q (a multiple of {h}), D], got {q.shape}")
    hq, d = q.shape[1], q.shape[2]
    qmin, _ = int_range(bits)
    dt = operand_dtype(q.dtype)
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)

    q_codes, row_shift = fold_key_grid(q, k_scale, k_lo, h, bits, sm)
    scores = jnp.einsum("bhgd,bhtd->bhgt", q_codes.astype(dt), k_codes.astype(dt),
                        preferred_element_type=jnp.float32, precision=precision) + row_shift[..., None]
    scores = jnp.where(slot_mask(length, allowed, bsz, t)[:, None, None, :], scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m)  # [B, H, G, T]
    denom = jnp.sum(p, axis=-1)
    v_scale, v_lo = v_scale[..., 0].astype(jnp.float32), v_lo[..., 0].astype(jnp.float32)  # [B, H, T]
    v_off = v_lo - qmin * v_scale
    p_codes = (p * v_scale[:, :, None, :]).astype(dt)
    out = jnp.einsum("bhgt,bhtd->bhgd", p_codes, v_codes.astype(dt),
                     preferred_element_type=jnp.float32, precision=precision)
    out = out + jnp.einsum("bhgt,bht->bhg", p, v_off)[..., None]
    out = out / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)[..., None]
    lse = m[..., 0] + jnp.log(denom)
    return out.reshape(bsz, hq, d), lse.reshape(bsz, hq)
